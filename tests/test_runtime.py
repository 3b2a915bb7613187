"""The process settings tfstrat makes (`tfstrat/runtime/allocator.py`): TensorFlow's BFC CPU allocator.

A step under a one-device strategy ran at half the speed of plain Keras with TensorFlow's
default CPU allocator (benchmarks/overhead). These tests fail if a process that uses
tfstrat's strategies is not on the BFC allocator, asserting the setting and the allocator
TensorFlow reports, never a time. Each case is a fresh Python process (the allocator is chosen
once per process); they start together to share the TensorFlow import time.
"""

import io
import json
import os
import subprocess
import sys

import pytest
from paths import WORKERS

from tfstrat import LaunchConfig, launch
from tfstrat.runtime import allocator as _runtime

PY = sys.executable
PROBE = str(WORKERS / "runtime_probe.py")
LOG_LINE = "tfstrat: TensorFlow's BFC CPU allocator"


def _env(**changes):
    env = {k: v for k, v in os.environ.items() if k not in (_runtime.ALLOCATOR, _runtime.SWITCH)}
    # The probe tells the allocators apart by their statistics (only BFC keeps them), but
    # with oneDNN's optimizations on (TensorFlow's default on CPUs with AVX-512) TensorFlow's
    # default CPU allocator is oneDNN's, which keeps them too: turned off, every case is exact.
    env.update(TF_CPP_MIN_LOG_LEVEL="2", TFSTRAT_LOG_LEVEL="INFO", TF_ENABLE_ONEDNN_OPTS="0")
    env.update(changes)
    return env


CASES = {
    "default": (["fit"], {}),
    "turned_off": (["create"], {_runtime.SWITCH: "default"}),
    "users_choice": (["create"], {_runtime.ALLOCATOR: "false"}),
    "too_late": (["late"], {}),
    "import_only": (["import"], {}),
}


@pytest.fixture(scope="module")
def probes():
    procs = {
        name: subprocess.Popen(
            [PY, PROBE, *args],
            env=_env(**env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, (args, env) in CASES.items()
    }
    results = {}
    for name, p in procs.items():
        out, err = p.communicate(timeout=240)
        line = [x for x in out.splitlines() if x.startswith("PROBE ")]
        assert p.returncode == 0 and line, f"{name}: exit {p.returncode}\n{out}\n{err[-3000:]}"
        results[name] = (json.loads(line[0][6:]), err)
    return results


def test_import_tfstrat_changes_nothing_in_the_process(probes):
    report, err = probes["import_only"]
    assert report["import_changed_env"] == [] and not report["import_imported_tensorflow"], report
    assert report["env"] is None and report["allocator"] == "default", report
    assert LOG_LINE not in err, err


def test_creating_a_strategy_puts_the_process_on_the_bfc_allocator(probes):
    report, err = probes["default"]
    assert report["env"] == "true", report
    assert report["allocator"] == "bfc", report
    assert report["peak"] > 0, report  # the strategies' steps allocated through it
    assert err.count(LOG_LINE) == 1, err  # logged once, though two strategies were created


def test_one_cpu_device_trains_as_without_a_strategy(probes):
    report, _ = probes["default"]
    assert report["max_diff"]["mirrored"] < 1e-6, report
    assert report["max_diff"]["car"] < 1e-6, report


def test_mirrored_one_cpu_device_reads_input_through_a_plain_iterator(probes):
    # Not a MultiDeviceIterator: its GeneratorDataset sets glibc's mmap threshold for the
    # whole process (_common.plain_input_options), and it can crash TF when deleted.
    report, _ = probes["default"]
    assert report["iterators"]["mirrored"] == "OwnedIterator", report


def test_collective_one_cpu_device_reads_input_through_a_plain_iterator(probes):
    report, _ = probes["default"]
    assert report["iterators"]["car"] == "OwnedIterator", report


def test_turned_off_keeps_tensorflows_allocator(probes):
    report, err = probes["turned_off"]
    assert report["env"] is None and report["allocator"] == "default", report
    assert LOG_LINE not in err and "TF_CPU_ALLOCATOR_USE_BFC" not in err, err


def test_the_users_own_setting_wins_silently(probes):
    report, err = probes["users_choice"]
    assert report["env"] == "false" and report["allocator"] == "default", report
    assert LOG_LINE not in err and "TF_CPU_ALLOCATOR_USE_BFC" not in err, err


def test_too_late_warns_once_naming_the_variable(probes):
    report, err = probes["too_late"]
    assert report["env"] is None and report["allocator"] == "default", report
    warning = [x for x in err.splitlines() if "before the first tfstrat strategy" in x]
    assert len(warning) == 1, err
    assert "TF_CPU_ALLOCATOR_USE_BFC=true" in warning[0], warning
    assert "TFSTRAT_CPU_ALLOCATOR=default" in warning[0], warning


@pytest.mark.cluster
def test_tasks_that_tfstrat_launch_starts_use_the_bfc_allocator(monkeypatch):
    # A task that never imports tfstrat, launched from a process whose environment does not
    # have the variable either: only the launcher can have set it.
    for name in (_runtime.ALLOCATOR, _runtime.SWITCH):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(_runtime, "_state", None)
    out = io.StringIO()
    code = launch(LaunchConfig([PY, PROBE, "bare"], workers=1, timeout=180), out)
    text = out.getvalue()
    line = [x for x in text.splitlines() if "PROBE " in x]
    assert code == 0 and line, text
    report = json.loads(line[0].split("PROBE ", 1)[1])
    assert report["env"] == "true" and report["switch"] == "bfc", report
    assert report["allocator"] == "bfc", report


# --- task_env: what `tfstrat launch` adds to a task's environment ---------------------------


def test_task_env_sets_the_allocator_and_marks_it_as_tfstrats(monkeypatch):
    monkeypatch.setattr(_runtime, "_state", None)
    env = _runtime.task_env({"PATH": "/bin"})
    assert env == {"PATH": "/bin", _runtime.ALLOCATOR: "true", _runtime.SWITCH: "bfc"}


def test_task_env_keeps_the_users_value(monkeypatch):
    monkeypatch.setattr(_runtime, "_state", None)
    assert _runtime.task_env({_runtime.ALLOCATOR: "false"}) == {_runtime.ALLOCATOR: "false"}


def test_task_env_turned_off_drops_the_value_tfstrat_set(monkeypatch):
    monkeypatch.setattr(_runtime, "_state", "set")
    monkeypatch.setenv(_runtime.ALLOCATOR, "true")
    env = _runtime.task_env({_runtime.ALLOCATOR: "true", _runtime.SWITCH: "default"})
    assert env == {_runtime.SWITCH: "default"}


def test_task_env_rejects_an_unknown_switch_value_naming_it():
    with pytest.raises(ValueError, match="TFSTRAT_CPU_ALLOCATOR='jemalloc'"):
        _runtime.task_env({_runtime.SWITCH: "jemalloc"})


# --- the dataset iterators of Keras's loops: destroyed off the training thread ---------------


def test_fits_dataset_iterators_are_destroyed_off_the_training_thread():
    """TensorFlow's iterator destructor can wait seconds for the pipeline's autotuner (an epoch
    started up to 36 s late with two devices): under a tfstrat strategy every iterator of `fit`
    and its validation goes on tfstrat's release thread, with Python's cyclic collector off
    (nothing of it waits in a reference cycle for a collection on some other thread); stock
    Keras's go on the training thread (the control, run first in the same process)."""
    p = subprocess.run(
        [PY, str(WORKERS / "iterator_release.py")],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    line = [x for x in p.stdout.splitlines() if x.startswith("RELEASE ")]
    assert p.returncode == 0 and line, f"exit {p.returncode}\n{p.stdout}\n{p.stderr[-3000:]}"
    report = json.loads(line[0][len("RELEASE ") :])
    assert report["missing"] == {"stock": 0, "tfstrat": 0}, report
    # 3 epochs of training and validation: at least 6 iterators, 3 handles each
    assert len(report["stock"]) >= 18 and set(report["stock"]) == {"MainThread"}, report
    assert len(report["tfstrat"]) >= 18, report
    assert set(report["tfstrat"]) == {"tfstrat-iterator-release"}, report
