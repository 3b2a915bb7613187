"""ParameterServer: real ps tasks and workers started by `tfstrat launch`, against one device."""

import json
import os
import sys
import time

import numpy as np
import pytest
from cluster import RUN_TIMEOUT, in_background, launch_script, run_script, start_task
from common import relative_errors

TOLERANCE = 1e-5
STEPS = 40  # ps_equiv.py: 2 epochs of 20 global batches


def _loaded(*paths):
    """Each .weights.h5 loaded into the stock model in one process without tfstrat."""
    run_script("ps_equiv.py", os.path.dirname(paths[0]), "--reference", "--load", *map(str, paths))
    out = []
    for path in paths:
        npz = np.load(str(path) + ".npz")
        out.append([npz[f"arr_{i}"] for i in range(len(npz.files))])
    return out


def _check_equal_to_reference(out_dir, reference):
    names = ("sgd", "adagrad")
    loaded = _loaded(*(out_dir / f"{n}.weights.h5" for n in names))
    for name, weights in zip(names, loaded):
        ref = [reference[f"{name}/w{i}"] for i in range(len(weights))]
        errs = relative_errors(weights, ref)
        assert max(errs) <= TOLERANCE, (name, errs)


@pytest.fixture(scope="module")
def _reference_run(tmp_path_factory):
    """The one-device run, started in the background: it goes on while the cluster runs."""
    out = tmp_path_factory.mktemp("reference")
    return out, in_background(run_script, "ps_equiv.py", str(out), "--reference")


@pytest.fixture(scope="module")
def reference(_reference_run):
    out, running = _reference_run
    running.result()
    return np.load(out / "reference.npz")


@pytest.fixture(scope="module")
def one_ps(tmp_path_factory, _reference_run):
    out = tmp_path_factory.mktemp("one_ps")
    code, log = launch_script("ps_equiv.py", str(out), workers=2, ps=1)
    assert code == 0, log[-6000:]
    return out


@pytest.mark.cluster
def test_two_workers_one_ps_equal_single_device(one_ps, reference):
    _check_equal_to_reference(one_ps, reference)
    for w in range(2):
        report = json.loads((one_ps / f"worker_{w}.json").read_text())
        for name in ("sgd", "adagrad"):
            # The optimizer's iteration counter is the global step: once per step, not per worker.
            assert report[name]["iterations"] == STEPS
            assert report[name]["predict_rows"] == 480  # predict runs whole batches
            devices = report[name]["devices"]
            assert all(d == "/job:ps/replica:0/task:0/device:CPU:0" for d in devices.values())
            # Each step receives its worker's 12 rows of the 24, cut on the worker's host (a
            # GPU worker copies its rows to its GPU, not the global batch).
            assert report[name]["step_rows"] == [12], report[name]
            host = f"/job:worker/replica:0/task:{w}/device:CPU:0"
            assert report[name]["slice_devices"] == [host], report[name]
        assert report["dropped"] == 0


@pytest.mark.cluster
def test_two_ps_partitioned_equal_single_device_and_load_a_one_ps_checkpoint(
    one_ps, reference, tmp_path
):
    code, log = launch_script(
        "ps_equiv.py",
        str(tmp_path),
        "--partitions=2",
        f"--reload={one_ps / 'sgd.weights.h5'}",
        "--traffic",
        workers=2,
        ps=2,
    )
    assert code == 0, log[-6000:]
    _check_equal_to_reference(tmp_path, reference)
    report = json.loads((tmp_path / "worker_1.json").read_text())
    devices = report["sgd"]["devices"]
    assert devices["embedding/embeddings_part_0"] == "/job:ps/replica:0/task:0/device:CPU:0"
    assert devices["embedding/embeddings_part_1"] == "/job:ps/replica:0/task:1/device:CPU:0"
    assert {d.split("/task:")[1][0] for d in devices.values()} == {"0", "1"}
    # Evaluating a 1.6 MB table in 2 parts: tfstrat's Embedding fetches rows (24 x 8 ids of 64
    # bytes per step, plus the dense layers), Keras's the whole table every step.
    table = report["table_bytes"]
    assert report["tfstrat"]["bytes_per_step"] < 0.05 * table, report
    assert report["stock"]["bytes_per_step"] > 0.9 * table, report
    # A checkpoint of the 1-ps run (one table) loads into the 2-part table of this run.
    original, reloaded = _loaded(one_ps / "sgd.weights.h5", tmp_path / "sgd.reloaded.weights.h5")
    for a, b in zip(original, reloaded, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.cluster
def test_backup_workers_drop_the_stale_gradients_of_a_held_worker(tmp_path):
    # Worker 2 releases each push only after that step was applied without it.
    code, log = launch_script(
        "ps_faults.py",
        str(tmp_path),
        "backup",
        workers=3,
        ps=1,
    )
    assert code == 0, log[-6000:]
    reports = [json.loads((tmp_path / f"worker_{w}.json").read_text()) for w in range(3)]
    assert reports[0]["iterations"] == 20  # every step applied, with 2 of 3 gradients
    assert reports[0]["dropped"] == reports[1]["dropped"] == 0
    assert reports[2]["dropped"] >= 1
    assert all(np.isfinite(r["loss"]).all() for r in reports)
    # Each step is SGD(0.1) on the mean of workers 0 and 1's gradients (8 rows each), which a
    # plain Keras copy computed at the step's weights; worker 2's is left out.
    steps = np.load(tmp_path / "steps.npz")
    weights = sum(1 for n in steps.files if n.startswith("step0/before/"))
    all_three = []
    for s in range(20):
        for k in range(weights):
            before, after = steps[f"step{s}/before/{k}"], steps[f"step{s}/after/{k}"]
            g0, g1, g2 = (steps[f"step{s}/grad{w}/{k}"] for w in range(3))
            want = before - 0.1 * (g0 + g1) / 2
            np.testing.assert_allclose(after, want, rtol=1e-6, atol=1e-7, err_msg=f"{s}/{k}")
            all_three.append(np.abs(after - (before - 0.1 * (g0 + g1 + g2) / 3)).max())
    assert max(all_three) > 1e-4, max(all_three)  # worker 2's gradient would have shown
    # An explicit AutoShardPolicy.FILE, which ParameterServer cannot honour, is refused.
    assert "auto_shard_policy=FILE under ParameterServer" in reports[0]["file_policy_error"]


@pytest.mark.cluster
def test_async_applies_each_workers_own_gradients(tmp_path):
    """Async: each worker's rows move one half of a table that the other worker's rows never
    touch (workers/ps_async_rows.py), so whatever the order of the two workers' updates, each
    half must end as one device training on that worker's rows alone: a ps that dropped one
    worker's gradients, or applied one twice, fails here though the step counter (which counts
    updates, not what they applied) and the digits' accuracy would not see it."""
    run_script("ps_async_rows.py", str(tmp_path), "--reference")
    code, log = launch_script("ps_async_rows.py", str(tmp_path), workers=2, ps=1)
    assert code == 0, log[-6000:]
    want = np.load(tmp_path / "reference.npz")
    moved = np.abs(want["worker_0"][:10] - want["worker_1"][:10]).max()
    assert moved > 0.05, "each worker's reference moves its own half"
    for w in (0, 1):
        got = np.load(tmp_path / f"worker_{w}.npz")
        assert int(got["iterations"]) == 2 * 20, (w, int(got["iterations"]))
        table = got["table"]
        for half, rows in ((0, slice(0, 10)), (1, slice(10, 20))):
            err = np.abs(table[rows] - want[f"worker_{half}"][rows]).max()
            assert err <= TOLERANCE, (f"worker {w} reads the rows of worker {half}", err)


@pytest.mark.cluster
def test_async_reaches_the_accuracy_of_sync_on_digits(tmp_path):
    accuracy = {}
    for mode in ("sync", "async"):
        out = tmp_path / mode
        out.mkdir()
        code, log = launch_script("ps_digits.py", str(out), mode, workers=2, ps=1)
        assert code == 0, log[-6000:]
        reports = [json.loads((out / f"worker_{w}.json").read_text()) for w in range(2)]
        accuracy[mode] = float(np.mean([r["accuracy"] for r in reports]))
        # 4 epochs of 35 steps: sync applies each step once; async counts every worker's
        # update exactly (one atomic increment on the ps). The worker that reads last, after
        # both fits ended, sees them all.
        steps = 4 * 35
        assert max(r["iterations"] for r in reports) == (steps if mode == "sync" else 2 * steps)
    assert accuracy["sync"] > 0.85, accuracy
    assert accuracy["async"] > accuracy["sync"] - 0.05, accuracy
    print(f"accuracy after 4 epochs: {accuracy}")  # pytest -rP shows it


@pytest.mark.cluster
@pytest.mark.faults
def test_a_killed_ps_fails_every_worker_naming_it(tmp_path):
    from tfstrat import TFConfig

    timeout = 20
    config = TFConfig.local(workers=2, ps=1)
    procs = [start_task(config, "ps", 0, "-m", "tfstrat", "server")]
    procs += [
        start_task(config, "worker", i, "ps_faults.py", str(tmp_path), "kill-ps", str(timeout))
        for i in range(2)
    ]
    try:
        outs = [p.communicate(timeout=RUN_TIMEOUT)[0] for p in procs[1:]]
        ended = time.time()  # both workers have exited
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for p, out in zip(procs[1:], outs):
        assert p.returncode != 0, out[-3000:]
        assert "training finished" not in out
        # The error names the ps: TensorFlow's name for it, or the sync step's call to it.
        assert "/job:ps/replica:0/task:0" in out or "on ps:0 (table server at" in out, out[-3000:]
    # From the kill: at most one wait's timeout, and a busy machine's slack.
    took = ended - float(outs[0].split("worker 0 kills ps:0 now, at ")[1].split()[0])
    assert took < timeout + 30, (took, outs[0][-3000:])
    # Under the launcher, the ps's death stops the run with a non-zero code naming it.
    code, log = launch_script("ps_faults.py", str(tmp_path), "kill-ps", "20", workers=2, ps=1)
    assert code != 0
    assert "ps:0 failed first" in log, log[-3000:]


@pytest.mark.cluster
def test_a_ps_task_running_the_training_script_serves_then_exits_0(tmp_path):
    from tfstrat import TFConfig

    config = TFConfig.local(workers=1, ps=1)
    script = ("ps_digits.py", str(tmp_path), "async")
    ps = start_task(config, "ps", 0, *script)
    worker = start_task(config, "worker", 0, *script)
    try:
        out = worker.communicate(timeout=RUN_TIMEOUT)[0]
        assert worker.returncode == 0, out[-3000:]
        ps_out = ps.communicate(timeout=30)[0]  # the ps sees the worker gone and exits
    finally:
        for p in (ps, worker):
            p.kill()
            p.wait()
    assert ps.returncode == 0, ps_out[-3000:]
    assert "every worker has finished" in ps_out


@pytest.mark.faults
def test_an_unreachable_ps_is_named_within_the_timeout():
    import subprocess

    from tfstrat import TFConfig

    config = TFConfig.local(workers=1, ps=1).for_task("worker", 0)
    address = config.addresses("ps")[0]
    env = dict(os.environ, **config.to_env())
    # The fault is there from the start: the clock starts as the strategy is created, after
    # TensorFlow's import, which takes seconds and waits for nothing.
    code = (
        "import time, tensorflow, tfstrat\n"
        "started = time.monotonic()\n"
        "try:\n"
        "    tfstrat.ParameterServer(timeout=2)\n"
        "finally:\n"
        "    print('took', time.monotonic() - started, flush=True)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0
    assert f"Could not reach ps:0 at {address} within 2 s" in proc.stderr, proc.stderr[-2000:]
    took = float(proc.stdout.split("took")[-1])
    assert took < 2 + 5, took  # the 2 s timeout, and a busy machine's slack


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(mode="eventually"), "mode='eventually'. Use 'sync' or 'async'"),
        (dict(replicas_to_aggregate=3), "replicas_to_aggregate=3 with 2 worker(s)"),
        (dict(partitions=0), "partitions=0. Use 'auto' or an integer >= 1"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    from tfstrat import TFConfig
    from tfstrat.strategies.parameter_server import ParameterServer

    config = TFConfig.local(workers=2, ps=1).for_task("worker", 0)
    with pytest.raises(ValueError) as e:
        ParameterServer(config, **kwargs)
    assert message in str(e.value)


def test_a_cluster_without_ps_tasks_is_refused():
    from tfstrat import TFConfig
    from tfstrat.strategies.parameter_server import ParameterServer

    with pytest.raises(ValueError, match="without ps tasks.*tfstrat launch --ps 1"):
        ParameterServer(TFConfig.local(workers=2).for_task("worker", 0))


@pytest.mark.cluster
def test_only_the_chief_writes_and_every_worker_restores(tmp_path):
    from cluster import assert_chief_wrote_and_workers_restored

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    code, log = launch_script(
        "callbacks_run.py", str(tmp_path), "ps", workers=2, ps=1, env={"TMPDIR": str(scratch)}
    )
    assert code == 0, log[-6000:]
    assert_chief_wrote_and_workers_restored(tmp_path, scratch)
