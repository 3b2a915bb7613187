"""Mixed precision: one replica's overflow makes every replica and worker skip the same step.

tests/workers/mixed_precision.py trains a model (a Dense layer beside an Embedding, whose table
Hybrid holds on its ps) whose row 47 overflows the Dense layer for the replica given it, with
`fit` and with a custom loop, under float32 with an explicit
LossScaleOptimizer (exact arithmetic: equal to one device to float32 rounding), mixed_float16
and mixed_bfloat16. Every run must skip the steps one device skips, end at one device's loss
scale, hold finite weights (equal on every worker, bit for bit) and be within the policy's
rounding of one device's. Keras's own LossScaleOptimizer takes replica 0's local answer: inf
in every weight under MirroredStrategy, workers out of step under CollectiveAllReduce.
"""

import json

import numpy as np
import pytest
from cluster import launch_script, run_script
from common import check_mixed_precision

POLICIES = ["float32", "mixed_float16", "mixed_bfloat16"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("mixed_precision")
    run_script("mixed_precision.py", str(out), "reference", *POLICIES)
    return out


_check = check_mixed_precision


def _same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind", ["mirrored", "modelparallel"])
def test_replicas_of_one_process_skip_the_same_steps(reference, tmp_path, kind):
    """MirroredNCCL on 2 logical CPUs; ModelParallel on a (2, 2) mesh, its table split."""
    run_script("mixed_precision.py", str(tmp_path), kind, *POLICIES)
    _check(tmp_path, kind, reference)


@pytest.mark.cluster
@pytest.mark.parametrize(
    "kind,ps,policies",
    [
        ("collective", 0, POLICIES),
        # The chief decides from the aggregated gradients (fit; custom loops: not the protocol).
        ("ps", 1, ["mixed_float16"]),
        # The table on the ps: its rows are pushed once the step's verdict is known.
        ("hybrid", 1, POLICIES),
    ],
)
def test_workers_skip_the_same_steps(reference, tmp_path, kind, ps, policies):
    code, log = launch_script("mixed_precision.py", str(tmp_path), kind, *policies, ps=ps)
    assert code == 0, log[-6000:]
    first, second = (_check(tmp_path, f"{kind}_worker_{i}", reference) for i in (0, 1))
    assert _same_bits(first, second)


@pytest.mark.cluster
def test_localsgd_decides_with_everyone_at_sync_every_1_and_alone_between_syncs(
    reference, tmp_path
):
    """sync_every=1 is CollectiveAllReduce: the same skips as one device. sync_every=4: each
    worker keeps its own loss scale (worker 1 holds row 47: it skips, worker 0 does not), and
    the averaged weights are finite and the same on both workers."""
    for every, policies in ((1, ["float32", "mixed_float16"]), (4, ["mixed_float16"])):
        args = ("mixed_precision.py", str(tmp_path), "localsgd", f"--sync-every={every}")
        code, log = launch_script(*args, *policies)
        assert code == 0, log[-6000:]
    first, second = (_check(tmp_path, f"localsgd1_worker_{i}", reference) for i in (0, 1))
    assert _same_bits(first, second)
    alone = [json.loads((tmp_path / f"localsgd4_worker_{i}.json").read_text()) for i in (0, 1)]
    fits = [report["mixed_float16/fit"] for report in alone]
    assert fits[0]["scales"] == [32768.0] * 8 and fits[0]["iterations"] == 8, fits
    assert fits[1]["scales"][-1] == 8192.0 and fits[1]["iterations"] == 6, fits
    assert all(f["finite"] for f in fits)
    arrays = [np.load(tmp_path / f"localsgd4_worker_{i}.npz") for i in (0, 1)]
    assert _same_bits(*({k: a[k] for k in a.files} for a in arrays))


@pytest.mark.cluster
def test_fp16_compressions_overflow_is_skipped_by_every_worker(reference, tmp_path):
    """CollectiveAllReduce(compression="fp16") under float32 with a LossScaleOptimizer: row 47
    (5e4 here, its label one the model gets wrong) gives its worker a gradient that float32
    holds but the 16-bit wire would turn into inf (over 65,504) after Keras's finite check.
    The verdict counts it: `fit` skips those steps on every worker and halves the loss scale,
    as one device skips them under mixed_float16, and the weights stay finite, the same bits
    on both workers (was: inf in every weight). The custom loop's gradient (divided by the
    global batch, no rows weighting) stays in range: nothing skipped, finite."""
    code, log = launch_script("mixed_precision.py", str(tmp_path), "collective-fp16", "float32")
    assert code == 0, log[-6000:]
    assert "tfstrat: compression=fp16" in log
    assert "go uncompressed" not in log, log[-6000:]  # the densified table gradient rides too
    skips_of = json.loads((reference / "reference.json").read_text())["mixed_float16/fit"]
    runs = []
    for i in (0, 1):
        report = json.loads((tmp_path / f"collective-fp16_worker_{i}.json").read_text())
        fit, loop = report["float32/fit"], report["float32/loop"]
        assert fit["finite"] and loop["finite"], (i, report)
        assert (fit["scales"], fit["iterations"]) == (skips_of["scales"], 6), (i, fit, skips_of)
        assert (loop["scales"], loop["iterations"]) == ([32768.0] * 8, 8), (i, loop)
        arrays = np.load(tmp_path / f"collective-fp16_worker_{i}.npz")
        runs.append({k: arrays[k] for k in arrays.files})
    assert _same_bits(*runs)
