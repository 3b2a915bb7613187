"""MirroredNCCL against single-device training, on logical CPU devices.

Each case runs in a fresh interpreter: the CPU must be split before TensorFlow's runtime starts.
"""

import json
import subprocess
import sys

import pytest
from paths import WORKERS

TOLERANCE = 1e-5


def _run(n, sparse_as_dense, tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "mirrored_equiv.py", str(n), sparse_as_dense, str(out)],
        cwd=WORKERS,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {**json.loads(out.read_text()), "log": proc.stdout + proc.stderr}


@pytest.mark.parametrize("n, sparse_as_dense", [(2, "auto"), (4, "true")])
def test_equals_single_device_training(n, sparse_as_dense, tmp_path):
    result = _run(n, sparse_as_dense, tmp_path)
    assert result["replicas"] == n
    for name in ("sgdm", "adam"):
        assert max(result[name]) <= TOLERANCE, (name, result[name])
        assert result[f"{name}_iterations"] == 24
        assert result[f"{name}_predict_rows"] == 8 * n * 24
        # Every replica's copy, and evaluate and predict, as on one device.
        assert result[f"{name}_replica_copies"] == n
        assert max(result[f"{name}_replicas"]) <= TOLERANCE, (name, result[f"{name}_replicas"])
        assert max(result[f"{name}_evaluate"] + result[f"{name}_predict"]) <= TOLERANCE, result
    # One process's replicas are summed by copies on the first device (no collective, whose
    # records would grow with the run: tfstrat/reduce/cross_device.py).
    sent = result["traced"]
    assert result["transport"] == "ring" and "summed by copies" in result["log"], result["log"]
    table = [1000, 8]
    sums = [shapes for kind, shapes in sent if kind == "local_sum"]
    rows = [shape for kind, shape in sent if kind == "local_rows"]
    assert {kind for kind, _ in sent} <= {"local_sum", "local_rows"}, sent
    if sparse_as_dense == "auto":
        # 8 examples x 8 ids per replica: at most 64 x n of 1000 rows, below the threshold.
        assert {d for *_, d in result["decisions"]} == {"sparse"}
        assert rows and all(shape == [64, 8] for shape in rows), sent
        assert not any(table in shapes for shapes in sums), sent
    else:
        assert {d for *_, d in result["decisions"]} == {"dense"}
        assert sums and not rows, sent
        assert all(table in shapes for shapes in sums), sent
    # Every dense gradient summed in one call per step function.
    assert sums and all(len(shapes) >= 6 for shapes in sums), sent


def test_nccl_where_it_cannot_run_is_a_clear_error():
    import tfstrat

    if tfstrat.devices().nccl:
        pytest.skip(
            "this host has 2+ GPUs and a CUDA build, so NCCL is valid here: no error to test"
        )
    with pytest.raises(ValueError, match="communication='nccl'.*use communication='auto'"):
        tfstrat.MirroredNCCL(communication="nccl")
