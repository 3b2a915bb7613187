"""BatchNormalization under every synchronous strategy, against one device; Hybrid's table lines.

`tests/workers/batchnorm_equiv.py` trains a model with two BatchNormalization layers on global
batches whose halves differ (so unsynchronized replicas see different statistics), once with
`synchronized=True`, once without, and once without for a single step; the chief then trains
the same on one device. Under Hybrid the model's three tables cover the three placements.
"""

import re

import numpy as np
import pytest
from cluster import launch_script, run_script

TOLERANCE = 1e-5
STATS = [f"{bn}/{s}" for bn in ("bn1", "bn2") for s in ("moving_mean", "moving_variance")]


def _rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _check(out, workers: list[str]):
    chief = np.load(out / f"{workers[0]}.npz")
    # synchronized=True: every weight, moving statistics and tables included, equals one
    # device's, and so does evaluate (which reads the moving statistics).
    paths = [k[len("ref/sync/") :] for k in chief.files if k.startswith("ref/sync/")]
    assert set(STATS) <= set(paths) and len(paths) >= 12, paths
    errors = {p: _rel(chief[f"sync/{p}"], chief[f"ref/sync/{p}"]) for p in paths}
    assert max(errors.values()) <= TOLERANCE, errors
    # Unsynchronized: after one step from the same weights, the averaged moving mean is one
    # device's; the moving variance is the mean of the replicas' own, smaller (documented).
    assert _rel(chief["local1/bn1/moving_mean"], chief["ref/local1/bn1/moving_mean"]) <= TOLERANCE
    variance, ref_variance = (
        chief["local1/bn1/moving_variance"],
        chief["ref/local1/bn1/moving_variance"],
    )
    assert np.all(variance <= ref_variance * (1 + TOLERANCE)), (variance, ref_variance)
    assert _rel(variance, ref_variance) > 0.01, (variance, ref_variance)
    # Every replica and every worker holds the same statistics, and the chief's file has them.
    import h5py

    everyone = [np.load(out / f"{w}.npz") for w in workers]
    for run in ("sync", "local", "local1"):
        for stat in STATS:
            copies = np.concatenate([d[f"copies/{run}/{stat}"] for d in everyone])
            assert len(copies) == 2, (run, stat, copies)
            assert _rel(copies[1], copies[0]) <= 1e-6, (run, stat, copies)
        with h5py.File(out / f"{run}.weights.h5") as saved:
            for group, bn in (("batch_normalization", "bn1"), ("batch_normalization_1", "bn2")):
                file_mean = np.asarray(saved[f"layers/{group}/vars/2"])
                np.testing.assert_array_equal(file_mean, chief[f"{run}/{bn}/moving_mean"])
    evaluated, ref_evaluated = chief["sync/evaluate"], chief["ref/sync/evaluate"]
    assert abs(evaluated - ref_evaluated) <= TOLERANCE * abs(ref_evaluated), (
        evaluated,
        ref_evaluated,
    )


@pytest.mark.cluster
def test_mirrored_two_logical_cpus(tmp_path):
    run_script("batchnorm_equiv.py", "mirrored", str(tmp_path))
    _check(tmp_path, ["mirrored_0"])


@pytest.mark.cluster
@pytest.mark.slow
def test_collective_two_workers(tmp_path):
    code, log = launch_script("batchnorm_equiv.py", "collective", str(tmp_path), workers=2)
    assert code == 0, log[-6000:]
    _check(tmp_path, ["worker_0", "worker_1"])


def _table_lines(log: str) -> dict[str, str]:
    found = re.findall(r"\[worker:0\] tfstrat: Hybrid table (\w+) \((.*)", log)
    return {name: rest for name, rest in found}


@pytest.mark.cluster
@pytest.mark.slow
def test_hybrid_with_a_ps_and_its_table_lines(tmp_path):
    code, log = launch_script("batchnorm_equiv.py", "hybrid", str(tmp_path), workers=2, ps=1)
    assert code == 0, log[-6000:]
    _check(tmp_path, ["worker_0", "worker_1"])
    assert (
        "every embedding table whose gradient is sparse on the ps tasks (sparse='auto')" in log
    ), log[-3000:]
    lines = _table_lines(log)
    assert sorted(lines) == ["movie", "movie_bias", "table"], log[-3000:]
    assert lines["table"].startswith(
        "200 x 4, tfstrat.keras.layers.Embedding): on ps 0 in 1 part(s), no copy on the workers; the batch's rows "
        "are fetched from the ps"
    ), lines
    # A plain keras.layers.Embedding goes by its gradient: sparse to the ps, dense (l2) not.
    assert lines["movie_bias"].startswith(
        "200 x 1, keras.layers.Embedding): on ps 0 in 1 part(s)"
    ), lines
    assert lines["movie"].startswith(
        "200 x 2, keras.layers.Embedding): mirrored on every worker (embeddings_regularizer=L2 gives every "
        "row a gradient); dense gradient, all-reduced whole (1,600 bytes per step). To put it "
        "on the ps: drop its embeddings_regularizer."
    ), lines
    assert "movie_bias/embeddings is mirrored but its gradient is sparse" not in log
    regularized = re.findall(r"\[worker:\d\] regularized table: (.*)", log)
    assert regularized == ["mirrored: embeddings_regularizer=L2 gives every row a gradient"] * 2, (
        log[-3000:]
    )
