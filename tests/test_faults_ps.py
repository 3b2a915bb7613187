"""Faults of ParameterServer: a ps that stops answering, tasks that disagree on the model or the
cluster, bad input. Real ps and worker processes; every run has a hard time limit."""

import json
import os
import signal
import time

import pytest
from cluster import launch_script, start_task

from tfstrat import TFConfig
from tfstrat.strategies.agreement import describe, digest, first_difference

pytestmark = pytest.mark.faults


TIMEOUT = 10  # the strategy's `timeout=` in these runs
START_UP = 90  # importing TensorFlow, connecting and tracing, on a loaded 2-core machine


def _stop(procs):
    for p in procs:
        try:
            os.kill(p.pid, signal.SIGCONT)  # a stopped process cannot die until continued
        except OSError:
            pass
        p.kill()
        p.wait()


def _start(config, workers_config, *args):
    """ps tasks of `config`, then 2 workers (worker i with `workers_config[i]`)."""
    procs = [
        start_task(config, "ps", i, "-m", "tfstrat", "server")
        for i in range(len(config.addresses("ps")))
    ]
    workers = [
        start_task(c, "worker", i, "faults_ps_run.py", *args) for i, c in enumerate(workers_config)
    ]
    return procs, workers


def _outputs(workers, limit):
    """Each worker's (exit code, output, seconds until its exit was seen)."""
    started, results = time.monotonic(), []
    for w in workers:
        out = w.communicate(timeout=max(1.0, limit - (time.monotonic() - started)))[0]
        results.append((w.returncode, out, time.monotonic() - started))
    return results


@pytest.mark.cluster
@pytest.mark.timeout(START_UP + TIMEOUT + 120)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_stopped_ps_ends_every_worker_naming_it(tmp_path, mode):
    config = TFConfig.local(workers=2, ps=1)
    ps, workers = _start(config, [config] * 2, str(tmp_path), "stop", mode, str(TIMEOUT))
    try:
        marker, deadline = tmp_path / "worker_0.running", time.monotonic() + START_UP
        while not marker.exists():
            assert time.monotonic() < deadline and all(w.poll() is None for w in workers), _outputs(
                workers, 30
            )
            time.sleep(0.1)
        os.kill(ps[0].pid, signal.SIGSTOP)  # alive but silent: a frozen host
        results = _outputs(workers, TIMEOUT + 60)
    finally:
        _stop(ps + workers)
    address = config.addresses("ps")[0]
    for i, (code, out, took) in enumerate(results):
        assert code == 1, out[-3000:]
        # Noticed within TIMEOUT plus two probes, then the exit.
        assert took < TIMEOUT + 30, (took, out[-3000:])
        name = "worker:0 (the chief)" if i == 0 else "worker:1"
        assert f"tfstrat: {name} lost ps:0 at {address}: no answer for" in out, out[-3000:]
        assert "does not answer (stopped, hung or cut off)" in out


@pytest.mark.cluster
@pytest.mark.timeout(START_UP + 60 + 120)
def test_workers_that_build_different_models_all_fail_naming_the_variable(tmp_path):
    # Worker 1 builds Dense(33) where the chief builds Dense(32). A long timeout: the failure
    # must come from the comparison, not from a wait running out.
    config = TFConfig.local(workers=2, ps=1)
    ps, workers = _start(config, [config] * 2, str(tmp_path), "model", "60")
    try:
        results = _outputs(workers, START_UP + 60)
    finally:
        _stop(ps + workers)
    message = (
        "tfstrat: worker:1 has variable sequential/hidden/kernel of shape (20, 33); "
        "worker:0 (the chief) has (20, 32). Run the same model code on every task."
    )
    for code, out, took in results:
        assert code != 0, out[-3000:]
        assert message in out, out[-3000:]
        assert "training finished" not in out
        assert took < START_UP + 60, took


@pytest.mark.cluster
@pytest.mark.timeout(START_UP + 60 + 120)
@pytest.mark.parametrize("case", ["ps", "workers"])
def test_workers_given_different_clusters_all_fail_naming_the_difference(tmp_path, case):
    """ps: the chief knows ps 0 only, worker 1 both ps tasks (named by the start-up
    agreement). workers: the chief's TF_CONFIG has 2 workers, worker 1's 3; the run's
    rendezvous on ps 0 names both counts at once on both, instead of each waiting out its
    timeout (for a worker:2 no chief counts, for a chief that did start)."""
    config = TFConfig.local(workers=3 if case == "workers" else 2, ps=2 if case == "ps" else 1)
    ps_list, worker_list = list(config.addresses("ps")), list(config.addresses("worker"))
    if case == "ps":
        clusters = [{"worker": worker_list, "ps": ps_list[: i + 1]} for i in range(2)]
        message = (
            f"tfstrat: worker:1 has ps {ps_list} in its TF_CONFIG cluster; worker:0 (the "
            f"chief) has {ps_list[:1]}."
        )
    else:
        clusters = [{"worker": worker_list[: 2 + i], "ps": ps_list} for i in range(2)]
        message = (
            "tfstrat: worker:1 has 3 chief and worker task(s) in its TF_CONFIG cluster; "
            "worker:0 (the chief) has 2."
        )
    views = [TFConfig.from_dict({"cluster": c}) for c in clusters]
    ps, workers = _start(config, views, str(tmp_path), "cluster", "60")
    try:
        results = _outputs(workers, START_UP + 60)
    finally:
        _stop(ps + workers)
    for code, out, took in results:
        assert code != 0 and "AgreementError" in out, out[-3000:]
        assert message in out, out[-3000:]
        assert "training finished" not in out
        assert took < START_UP + 30, took  # not the 60 s timeout


@pytest.mark.cluster
@pytest.mark.timeout(400)
def test_a_batch_smaller_than_the_workers_and_empty_input_are_refused(tmp_path):
    code, log = launch_script("faults_ps_run.py", str(tmp_path), "input", workers=2, ps=1)
    assert code == 0, log[-6000:]
    batch = "Received: a global batch of 1 row(s) for 2 workers."
    empty = "Received: an empty dataset (it yields no batch)."
    for w in range(2):
        errors = json.loads((tmp_path / f"worker_{w}.json").read_text())
        for case in ("fit_batch_1", "fit_batch_1_again", "evaluate_batch_1"):
            assert errors[case][0] == "UsageError" and batch in errors[case][1], errors
            assert "Use batch_size >= 2" in errors[case][1]
        for case in ("fit_empty", "predict_empty"):
            assert errors[case][0] == "UsageError" and empty in errors[case][1], errors
        # Whole batches on every worker: one row is enough to predict.
        assert errors["fit_batch_8"] is None and errors["predict_one_row"] is None, errors


def test_first_difference_names_the_task_and_the_item():
    config = TFConfig.local(workers=2, ps=1)
    chief = describe(config, [("dense/kernel", (20, 32), "float32")], {"mode": "sync"})
    assert digest(chief) == digest(json.loads(json.dumps(chief)))
    assert first_difference(chief, chief, "worker:1", "chief") is None
    other = describe(config, [("dense/kernel", (20, 33), "float32")], {"mode": "sync"})
    assert digest(other) != digest(chief)
    assert first_difference(other, chief, "worker:1", "chief") == (
        "worker:1 has variable dense/kernel of shape (20, 33); chief has (20, 32). "
        "Run the same model code on every task."
    )
    other = describe(config, [("dense/kernel", (20, 32), "float16")], {"mode": "sync"})
    assert "has variable dense/kernel of dtype float16; chief has float32" in first_difference(
        other, chief, "worker:1", "chief"
    )
    extra = describe(config, [("dense/kernel", (20, 32), "float32"), ("b", (3,), "float32")], {})
    assert first_difference(extra, chief, "worker:1", "chief").startswith(
        "worker:1 has no mode; chief has 'sync'. Create the strategy with the same arguments"
    )
    extra["options"] = chief["options"]
    assert first_difference(extra, chief, "worker:1", "chief") == (
        "worker:1 has 2 variables; chief has 1: the first extra one is worker:1's b of shape "
        "(3,). Run the same model code on every task."
    )
    smaller = describe(TFConfig.local(workers=1, ps=1), [], {})
    assert first_difference(smaller, chief, "worker:1", "chief").startswith("worker:1 has worker [")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigterm_stops_parameter_server_workers_after_a_step_saves_and_exits_143(tmp_path, mode):
    """Before, a ParameterServer worker died at once on SIGTERM (no backup) and, under sync,
    the others waited for its gradients until their timeout."""
    started = time.monotonic()
    code, out = launch_script("faults_stop.py", str(tmp_path), "sigterm", f"ps-{mode}", ps=1)
    took = time.monotonic() - started
    assert code == 143, out[-6000:]
    results = [json.loads((tmp_path / f"sigterm_{i}.json").read_text()) for i in range(2)]
    assert results[1]["stop"] == "sigterm", results  # worker 1 got SIGTERM after batch 6
    # The launcher does not blame the ps that the workers' logs name: they stopped as told.
    assert "failed first (exit code 143)" in out, out[-6000:]
    assert "probable cause" not in out, out[-6000:]
    if mode == "sync":
        # Every worker stops after the same step: the request rode worker 1's next mail, and
        # the chief's BackupAndRestore saved that step.
        assert results[0]["stop"] == "sigterm", results
        assert results[0]["iterations"] == results[1]["iterations"] <= 8, results
        assert os.listdir(tmp_path / "backup"), "BackupAndRestore saved nothing"
    # async: worker 1 alone stopped after its next step; the launcher then stopped the rest.
    assert "waited" not in out and "second SIGTERM: exiting now" not in out, out[-6000:]
    assert took < 300, took
