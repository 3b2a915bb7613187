"""keras.io-style programs (tests/keras_patterns/) under tfstrat strategies, against the same
programs without a strategy, on the same global batches.

The default suite runs a fast subset: one process without a strategy (the reference), one with
MirroredNCCL on 2 logical CPUs, one 2-worker CollectiveAllReduce cluster, each running every
pattern of the subset. `scripts/patterns` runs every pattern under every strategy, stock
tf.distribute's included, and prints the table.
"""

import os

import pytest
from compare import TOLERANCE, compare
from table import run_strategy

# keras.io's GAN (no call(), two optimizers of its own) and the other patterns that reach the
# most machinery in one run each.
FAST = [
    "gan",
    "custom_steps",
    "multi_io",
    "steps_per_execution",
    "preprocessing",
    "lr_schedules",
    "sequence_dense",
]
# Loss trackers a custom train_step updates with the loss Keras returns, which Keras 3 divides
# by the replica count under any strategy (`scale_loss_for_distribution`, stock too): these
# logs read 1/replicas of one device's; the weights are exact.
SCALED_LOGS = {"gan": ("fit/d_loss", "fit/g_loss"), "custom_steps": ("fit/loss", "evaluate/loss")}

# Patterns known to fail under a strategy: {(strategy, pattern): a text of the failure's log}.
KNOWN_FAILURES: dict[tuple[str, str], str] = {}

pytestmark = [pytest.mark.patterns, pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("patterns"))
    run_strategy("none", FAST, out)
    return out


def _check(out, kind, replicas):
    failures = []
    for pattern in FAST:
        result = compare(out, pattern, kind)
        known = KNOWN_FAILURES.get((kind, pattern))
        if known is not None:
            log = open(os.path.join(out, f"{kind}.log")).read()
            assert result["cell"].startswith("FAIL") and known in log, (
                f"{pattern} under {kind} no longer fails ({result['cell']}): "
                "remove it from KNOWN_FAILURES"
            )
            continue
        if result["weights"] is None or result["weights"] > TOLERANCE:
            failures.append(f"{pattern}: {result['cell']}")
            continue
        for name, diff in result["per_metric"].items():
            if name in SCALED_LOGS.get(pattern, ()):
                continue
            if diff > TOLERANCE:
                failures.append(f"{pattern}: log {name} differs by {diff:.2g}")
        scaled = SCALED_LOGS.get(pattern, ())
        for name in scaled:
            # 1/replicas of the reference: |m/r - m| / m = 1 - 1/r.
            assert abs(result["per_metric"][name] - (1 - 1 / replicas)) < 1e-4, (pattern, name)
    assert not failures, failures


@pytest.mark.timeout(420)
def test_patterns_mirrored_nccl_equal_one_device(out):
    with open(os.path.join(out, "mirrored.log"), "w") as log:
        run_strategy("mirrored", FAST, out, log)
    _check(out, "mirrored", replicas=2)


@pytest.mark.timeout(480)
def test_patterns_collective_all_reduce_equal_one_device(out):
    run_strategy("collective", FAST, out)
    _check(out, "collective", replicas=2)


def test_a_nan_weight_is_never_judged_exact():
    """NaN compares false with everything: Python's max() would drop it and call the run
    exact. Any weight that is not finite makes the run fail."""
    import numpy as np
    from compare import differences

    ref = {"w0": np.ones(3), "w1": np.ones(2), "m:loss": 1.0}
    run = {"w0": np.ones(3), "w1": np.array([1.0, np.nan]), "m:loss": 1.0}
    dw, dm, _ = differences(run, ref)
    assert dw == float("inf") and dm == 0.0
    assert differences(ref, ref)[0] == 0.0
