"""What a new user sees: `tfstrat launch` of the digits example (as scripts/demo runs it) prints
one progress bar and no TensorFlow start-up noise; --show all, --log-dir and --verbose give the
rest; `tfstrat doctor` checks a live cluster's peers.

Real processes throughout: the launcher as a user types it (`python -m tfstrat launch`), real
TensorFlow tasks, `tfstrat server` for the doctor's peers.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from tfstrat.commands import main as cli
from tfstrat.runtime import quiet as _quiet

PY = sys.executable
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = re.compile(r"^\[(\w+:\d+)\] ")
# TensorFlow's C++ log lines ("I0000 00:00:1795431175.941969   16799 cudart_stub.cc:31] ...").
CPP_LINE = re.compile(r"^(\[\w+:\d+\] )?[IWEF]\d{4} [\d:.]+ +\d+ [\w.]+:\d+\] ")
ABSL = ("absl::InitializeLog", "WARNING:absl:")


def _env(**changes) -> dict:
    """This process's environment without the logging settings the launcher should make."""
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TFSTRAT_SHOW")}
    env.pop(_quiet.VERBOSE, None)
    env.update(changes)
    return env


def _launch(*args, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "tfstrat", "launch", *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _prefixes(text: str) -> set[str]:
    return {m[1] for m in map(PREFIX.match, text.splitlines()) if m}


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """scripts/demo's launch of examples/digits.py (2 epochs), with the default --show."""
    logs = tmp_path_factory.mktemp("logs")
    proc = _launch(
        "--workers", "2", "--threads-per-task", "1", "--timeout", "200", "--log-dir", str(logs),
        "--", PY, "examples/digits.py", "--epochs", "2",
    )  # fmt: skip
    return proc, logs


@pytest.mark.cluster
@pytest.mark.timeout(260)
def test_digits_shows_one_progress_bar_and_no_start_up_noise(digits):
    proc, logs = digits
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    lines = out.splitlines()
    assert not [x for x in lines if CPP_LINE.match(x) or any(a in x for a in ABSL)], out
    assert "cuInit" not in out and "cuda drivers" not in out, out
    # One stream: only worker:0's lines, one "Epoch 1/2" and one per-epoch progress line each.
    assert _prefixes(out) == {"worker:0"}, out
    assert sum(x.endswith("Epoch 1/2") for x in lines) == 1, out
    assert (
        f"showing worker:0 (--show all for every task); every task's full output goes to {logs}"
        in out
    )
    result = [x for x in lines if "] result: 2 replica(s), test accuracy" in x]
    assert len(result) == 1, out
    assert float(result[0].split("test accuracy ")[1].split(",")[0]) > 0.7, result


@pytest.mark.cluster
@pytest.mark.timeout(260)
def test_log_dir_has_every_tasks_whole_output(digits):
    proc, logs = digits
    assert sorted(os.listdir(logs)) == ["worker-0.log", "worker-1.log"], proc.stdout[-3000:]
    for name in ("worker-0.log", "worker-1.log"):
        text = (logs / name).read_text()
        assert "Epoch 2/2" in text and "result: 2 replica(s), test accuracy" in text, text
        assert not PREFIX.match(text), text[:300]  # the task's own lines, unprefixed
    # The log keeps what the screen hid (a CPU-only machine prints TensorFlow's CUDA notice).
    if "cuda drivers" in (logs / "worker-1.log").read_text():
        assert "cuda drivers" not in proc.stdout


NOISY = (
    "import os; print('level', os.environ.get('TF_CPP_MIN_LOG_LEVEL'), os.environ['TFSTRAT_TASK']);"
    "print('WARNING: All log messages before absl::InitializeLog() is called are written to STDERR')"
)


@pytest.mark.parametrize("verbose", [False, True])
def test_verbose_hides_nothing_and_show_picks_a_task(verbose):
    """The launcher's part of --verbose, on a task that prints absl's notice (TensorFlow's
    own lines: the digits test above)."""
    flags = ["--verbose"] if verbose else []
    proc = _launch("--workers", "2", "--show", "worker:1", *flags, "--", PY, "-c", NOISY)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert _prefixes(out) == {"worker:1"}, out
    # Without --verbose, TF_CPP_MIN_LOG_LEVEL=2 (C++ errors only) unless the user set it.
    assert f"[worker:1] level {'None' if verbose else '2'} worker:1" in out, out
    assert ("absl::InitializeLog" in out) == verbose, out


def test_line_filter_names_what_it_hides():
    shown = _quiet.LineFilter()
    # Before a no-driver notice, a failing cuInit is a real problem: shown.
    assert shown.shows("E0000 00:00:1.2  7 cuda_platform.cc:52] failed call to cuInit: X")
    assert not shown.shows(
        "I0000 00:00:1.2  7 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU "
        "will not be used."
    )
    assert not shown.shows("E0000 00:00:1.2  7 cuda_platform.cc:52] failed call to cuInit: X")
    # Printed twice by every task on CPUs where oneDNN's kernels are on by default.
    assert not shown.shows(
        "I0000 00:00:1795595832.833073    2107 port.cc:153] oneDNN custom operations are on. "
        "You may see slightly different numerical results due to floating-point round-off "
        "errors from different computation orders. To turn them off, set the environment "
        "variable `TF_ENABLE_ONEDNN_OPTS=0`."
    )
    assert not shown.shows("WARNING:absl:Changing the value of option auto_shard_policy from A")
    # TensorFlow 2.19's duplicate CUDA plugin registrations, printed by every task
    assert not shown.shows(
        "E0000 00:00:1795839492.293430    1272 cuda_dnn.cc:8579] Unable to register cuDNN "
        "factory: Attempting to register factory for plugin cuDNN when one has already been "
        "registered"
    )
    assert not shown.shows(
        "W0000 00:00:1795839492.308602    1272 computation_placer.cc:177] computation placer "
        "already registered. Please check linkage and avoid linking the same target more than once."
    )
    assert shown.shows("WARNING:absl:something else")
    assert shown.shows("tfstrat: layer 'e' is a keras.layers.Embedding: ...")
    assert _quiet.LineFilter(verbose=True).shows(
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
    )
    assert all(why for why, _ in _quiet.NOISE_LINES)


# tfstrat doctor


@pytest.fixture(scope="module")
def live_cluster():
    """Two worker tasks running `tfstrat server` under `tfstrat launch --show all`: their
    addresses, read from both tasks' lines."""
    launcher = subprocess.Popen(
        [PY, "-m", "tfstrat", "launch", "--workers", "2", "--show", "all", "--timeout", "150",
         "--", PY, "-m", "tfstrat", "server"],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    addresses, seen = {}, []
    try:
        for line in launcher.stdout:
            seen.append(line)
            m = re.match(r"\[(worker:\d)\] tfstrat server: \1 serving at (\S+)", line)
            if m:
                addresses[m[1]] = m[2]
            if len(addresses) == 2:
                break
        assert len(addresses) == 2, "".join(seen)
        assert not [x for x in seen if CPP_LINE.match(x) or "absl" in x], "".join(seen)
        yield [addresses["worker:0"], addresses["worker:1"]]
    finally:
        launcher.send_signal(signal.SIGTERM)
        try:
            launcher.communicate(timeout=30)
        finally:
            launcher.kill()


def _doctor(monkeypatch, capsys, workers) -> tuple[int, str]:
    tf_config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": 0}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config))
    code = cli.main(["doctor", "--timeout", "2"])
    return code, capsys.readouterr().out


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_doctor_on_a_live_cluster_passes(live_cluster, monkeypatch, capsys):
    code, out = _doctor(monkeypatch, capsys, live_cluster)
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].startswith("ok    TensorFlow 2.21"), out
    assert "ok    tfstrat.auto() would pick CollectiveAllReduce (TF_CONFIG has 2 workers)" in out
    port = int(live_cluster[0].rsplit(":", 1)[1])
    assert any(f"worker:0 listens on {port}/tcp" in x and f"{port + 1}/tcp" in x for x in lines)
    assert f"ok    worker:1 at {live_cluster[1]} (127.0.0.1) answers on port" in out, out
    assert lines[-1] == "tfstrat doctor: ok"
    assert all(x.split()[0] in ("ok", "note") for x in lines[:-1]), out


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_doctor_fails_naming_a_peer_that_does_not_answer(live_cluster, monkeypatch, capsys):
    with socket.socket() as s:  # a port nothing listens on (closed at once)
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    start = time.monotonic()
    code, out = _doctor(monkeypatch, capsys, [live_cluster[0], dead])
    assert code == 1, out
    assert f"FAIL  worker:1 at {dead} (127.0.0.1) does not answer on port" in out, out
    assert "start its task" in out
    assert out.splitlines()[-1] == "tfstrat doctor: 1 check(s) failed"
    assert time.monotonic() - start < 60  # a refused connection is not waited for


@pytest.mark.cluster
@pytest.mark.timeout(200)
def test_a_model_fitted_outside_the_scope_is_named_once_on_every_worker():
    # It trained each worker alone without a word. A warning, not an error: a model trained on
    # one worker on purpose (a reference on the chief) is fine.
    proc = _launch(
        "--workers", "2", "--threads-per-task", "1", "--timeout", "150", "--show", "all",
        "--", PY, "tests/workers/first_hour_mistakes.py", "no_scope",
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    warning = (
        "tfstrat: model.fit of 'sequential', a model built outside `strategy.scope()`, while "
        "CollectiveAllReduce runs 2 workers: each worker trains it alone"
    )
    for task in ("worker:0", "worker:1"):
        lines = [x for x in out.splitlines() if x.startswith(f"[{task}]") and warning in x]
        assert len(lines) == 1, (task, out[-4000:])  # two fits, one warning
        assert f"[{task}] trained" in out


@pytest.mark.cluster
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "mode, message",
    [
        (
            "late",
            "RuntimeError: tfstrat: CollectiveAllReduce was created after this process had run "
            "TensorFlow ops (TensorFlow: 'Collective ops must be configured at program "
            "startup'). Create the strategy first",
        ),
        (
            "late_outer",
            "a Keras optimizer created before the strategy. Creating it ran TensorFlow ops, "
            "and a multi-worker strategy must come first in the program (TensorFlow: "
            "'Collective ops must be configured at program startup'). Pass "
            "outer_optimizer='diloco', or the optimizer's config instead",
        ),
    ],
)
def test_a_strategy_created_after_tensorflow_ops_is_refused_naming_the_fix(mode, message):
    # It ended in TensorFlow's "Collective ops must be configured at program startup" alone.
    proc = _launch(
        "--workers", "2", "--threads-per-task", "1", "--timeout", "150", "--show", "all",
        "--", PY, "tests/workers/first_hour_mistakes.py", mode,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert "] trained" not in out
    # The first worker's error (the launcher stops the other, which may not get as far).
    assert message in out, out[-4000:]
