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
ALL = ("dataset", "function", "inner", "eval", "checkpoint")

pytestmark = [pytest.mark.loops, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("loops_reference")
    run_script("custom_loops.py", str(out), "--strategy", "none")
    return json.loads((out / "reference.json").read_text())


def _run(tmp_path, strategy, workers=2, ps=0, cases=ALL):
    args = ("custom_loops.py", str(tmp_path), "--strategy", strategy, "--cases", ",".join(cases))
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
    ],
)
def test_tutorial_loops_equal_one_device(reference, tmp_path, strategy, workers, ps):
    reports = _run(tmp_path, strategy, workers, ps)
    replicas = {"mirrored": 2, "model-parallel": 1}.get(strategy, 2)
    for task, report in reports.items():
        assert report["num_replicas_in_sync"] == replicas, task
        _equal(report, reference, ALL)
        # strategy.gather of the first global batch's labels: the whole batch, in order
        assert report["dataset"]["gathered_labels"] == reference["dataset"]["gathered_labels"]
