"""Custom training loops (TensorFlow's tutorials: `strategy.run`, `strategy.reduce`, distributed
datasets, `tf.train.Checkpoint`) under every strategy, against the same loop on one device.

One cluster per strategy runs every case of `tests/workers/custom_loops.py`; the synchronous
strategies must end within 1e-5 of one device in every case, on every worker.
"""

import json

import numpy as np
import pytest
from cluster import launch_script, run_script
from common import relative_errors

TOLERANCE = 1e-5
ALL = ("dataset", "function", "inner", "eval", "checkpoint", "fit_step")

pytestmark = [pytest.mark.loops, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One device, row gradients densified: every strategy but ModelParallel sums an embedding
    row's repeats before its optimizer step (the dense update's semantics)."""
    out = tmp_path_factory.mktemp("loops_reference")
    run_script("custom_loops.py", str(out), "--strategy", "none")
    return json.loads((out / "reference.json").read_text())


@pytest.fixture(scope="module")
def sparse_reference(tmp_path_factory):
    """One device as Keras has it (its sparse Adagrad steps each repeat of a row): what
    ModelParallel reproduces."""
    out = tmp_path_factory.mktemp("loops_sparse_reference")
    run_script("custom_loops.py", str(out), "--strategy", "none-sparse")
    return json.loads((out / "reference.json").read_text())


def _run(tmp_path, strategy, workers=2, ps=0, cases=ALL, extra=()):
    args = ("custom_loops.py", str(tmp_path), "--strategy", strategy, "--cases", ",".join(cases))
    args += tuple(extra)
    if workers == 0:
        run_script(*args)
        return {"reference": json.loads((tmp_path / "reference.json").read_text())}
    code, log = launch_script(*args, workers=workers, ps=ps)
    assert code == 0, log[-6000:]
    reports = {}
    for path in tmp_path.glob("*.json"):
        reports[path.stem] = json.loads(path.read_text())
    assert len(reports) == workers, (sorted(reports), log[-3000:])
    return reports


def _equal(report, reference, cases):
    """Every case's final weights within TOLERANCE of one device's, and its losses too."""
    for case in cases:
        mine, ref = report[case], reference[case]
        errs = relative_errors(
            [np.asarray(w) for w in mine["weights"]], [np.asarray(w) for w in ref["weights"]]
        )
        assert max(errs) <= TOLERANCE, (case, errs)
        for key in ("losses", "accuracy", "loss", "iterations", "restored_equal_saved"):
            if key in ref:
                assert np.allclose(mine[key], ref[key], rtol=1e-5, atol=1e-6), (case, key)


@pytest.mark.cluster
@pytest.mark.parametrize(
    "strategy,workers,ps",
    [
        ("mirrored", 0, 0),
        ("collective", 2, 0),
        ("hybrid", 2, 0),
        ("hybrid", 2, 1),
        ("ps-sync", 2, 1),
        ("localsgd", 2, 0),
        ("model-parallel", 0, 0),
        ("model-parallel-workers", 2, 0),
    ],
)
def test_tutorial_loops_equal_one_device(request, tmp_path, strategy, workers, ps):
    sparse = strategy.startswith("model-parallel")
    reference = request.getfixturevalue("sparse_reference" if sparse else "reference")
    reports = _run(tmp_path, strategy, workers, ps)
    # Each worker is a replica (ParameterServer sync too); a mesh counts its devices: (2, 2)
    # in one process (with FSDP: the table, the kernels sharded over the batch axis too) and
    # over 2 workers.
    replicas = 4 if strategy.startswith("model-parallel") else 2
    local = {"mirrored": 2, "model-parallel": 4, "model-parallel-workers": 2}.get(strategy, 1)
    per_replica = 8  # the global batch is 16, over 2 workers or 2 slices of the batch axis
    for task, report in reports.items():
        assert report["num_replicas_in_sync"] == replicas, task
        _equal(report, reference, ALL)
        # strategy.gather of the first global batch's labels: every replica's rows, in replica
        # order (the whole batch; under ModelParallel each slice once per device of its group)
        labels = reference["dataset"]["gathered_labels"]
        if strategy.startswith("model-parallel"):
            slices = 2  # the mesh's batch axis
            n = len(labels) // slices
            labels = [v for k in range(slices) for v in labels[k * n : (k + 1) * n] * 2]
        assert report["dataset"]["gathered_labels"] == labels, task
        assert report["dataset"]["local_results"] == local, task
        # The InputContext: one pipeline per process, this one's id, the replica's share
        index = int(task.rsplit("_", 1)[1]) if workers else 0
        expected = [max(workers, 1), index, per_replica]
        assert report["function"]["contexts"][0] == expected, (task, report["function"])


@pytest.mark.cluster
def test_ps_async_loop_applies_every_workers_steps(reference, tmp_path):
    """ParameterServer(mode="async") trains the loop too (each worker's step applied as it
    comes: not compared with one device): the ps counts every worker's steps, the loss falls,
    and each worker is one replica (tf.distribute's ParameterServerStrategy counts so)."""
    extra = ("--lr", "0.5", "--epochs", "4")  # one device's loss falls by 2% over 4 epochs
    reports = _run(tmp_path, "ps-async", 2, 1, cases=("dataset",), extra=extra)
    steps = 2 * reference["dataset"]["iterations"]  # 7 global batches x 4 epochs
    for task, report in reports.items():
        assert report["num_replicas_in_sync"] == 1, task
        assert report["dataset"]["final_iterations"] == 2 * steps, (task, report["dataset"])
        before, after = report["dataset"]["loss_before_after"]  # over every example
        assert after < before, (task, before, after)


@pytest.mark.cluster
def test_localsgd_local_steps_refuse_a_custom_loop_by_name(tmp_path):
    """LocalSGD(sync_every=3) steps locally only in fit's step; a custom loop's step would
    all-reduce every gradient (synchronous SGD) without a word: refused at the first apply."""
    import time

    start = time.monotonic()
    code, log = launch_script(
        "custom_loops.py", str(tmp_path), "--strategy", "localsgd-k", "--cases", "dataset"
    )
    assert code != 0 and "CUSTOM-LOOPS-DONE" not in log, log[-3000:]
    assert "SGD.apply_gradients outside model.fit under tfstrat.LocalSGD(sync_every=3)" in log
    assert "LocalSGD(sync_every=1)" in log, log[-3000:]
    assert time.monotonic() - start < 60, "waited for a timeout instead of refusing"


@pytest.mark.cluster
def test_hybrid_table_applied_by_another_optimizer_is_refused(tmp_path):
    """A ps-held table pushes with the latest optimizer made in the scope; a loop applying it
    with an earlier one would train it with the wrong settings: refused by name."""
    code, log = launch_script(
        "custom_loops.py", str(tmp_path), "--strategy", "hybrid", "--cases", "two_optimizers", ps=1
    )
    assert code != 0 and "CUSTOM-LOOPS-DONE" not in log, log[-3000:]
    assert "Received: optimizer 'first' applying gradients to tokens/embeddings" in log, log[-3000:]
    assert "optimizer 'second'" in log and "Hybrid(sparse=[])" in log, log[-3000:]
