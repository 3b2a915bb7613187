"""Ray Train on a local Ray cluster runs tfstrat's strategies: Ray starts the workers and writes
their TF_CONFIG (workers only), and CollectiveAllReduce, Hybrid without ps tasks and LocalSGD
(sync_every=1, plain SGD) each end with identical weights on both workers, equal to
single-device training. Needs the `ray` extra (scripts/test installs it); elsewhere the tier
skips saying why. With tf-keras on the workers' path too (scripts/test installs it apart), as
Ray's docs advise: Ray Train sets TF_USE_LEGACY_KERAS=1, so tf.keras is Keras 2 there, and the
recipe's `import keras` models train as Keras 3. Run: `scripts/test -m ray`."""

import os
import subprocess
import sys

import numpy as np
import pytest
from common import relative_errors
from paths import WORKERS

pytestmark = [pytest.mark.ray, pytest.mark.cluster]

TOLERANCE = 1e-5
STRATEGIES = ("collective", "hybrid", "localsgd")


def _weights(npz):
    return [npz[f"w{k}"] for k in range(len(npz.files))]


def _env() -> dict:
    """The environment of the processes the tier starts: scripts/test installs the `ray` extra
    into a directory of its own (TFSTRAT_TEST_RAY), after the venv's own packages on the path:
    Ray Train requires pandas, which Keras would import into every TensorFlow process of the
    rest of the suite."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "RAY_DEDUP_LOGS": "0"}
    paths = [*filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    # tf-keras too, as Ray's own docs tell TensorFlow users to install it: with Ray Train's
    # TF_USE_LEGACY_KERAS=1, tf.keras is Keras 2 on the workers; the recipe's `import keras`
    # models are Keras 3 whatever the variable says.
    for extra in ("TFSTRAT_TEST_TFKERAS", "TFSTRAT_TEST_RAY"):
        if os.environ.get(extra):
            paths.append(os.environ[extra])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


@pytest.mark.timeout(420)
def test_ray_train_runs_every_strategy_equal_to_single_device(tmp_path):
    env = _env()
    probe = subprocess.run(
        [sys.executable, "-c", "import ray.train"], capture_output=True, text=True, env=env
    )
    if probe.returncode != 0:  # scripts/test installs the extra: in CI a missing one fails
        error = probe.stderr.strip().splitlines()[-1:]
        if os.environ.get("CI", "").lower() in ("1", "true"):
            pytest.fail(f"CI must run the ray tier, but `import ray.train` failed: {error}")
        pytest.skip(
            "the ray tier needs the `ray` extra (pip install tfstrat[ray], or scripts/test)"
        )
    proc = subprocess.run(
        [sys.executable, "ray_equiv.py", str(tmp_path), *STRATEGIES],
        cwd=WORKERS,
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    if os.environ.get("TFSTRAT_TEST_TFKERAS"):  # Ray set TF_USE_LEGACY_KERAS, tf-keras was there
        assert "TF_USE_LEGACY_KERAS=1: tf.keras is tf-keras" in proc.stdout + proc.stderr
    reference = _weights(np.load(tmp_path / "reference.npz"))
    for kind in STRATEGIES:
        workers = [_weights(np.load(tmp_path / f"{kind}-{w}.npz")) for w in (0, 1)]
        for w, weights in enumerate(workers):
            errs = relative_errors(weights, reference)
            assert max(errs) <= TOLERANCE, (kind, w, errs)
        for a, b in zip(*workers, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=kind)  # the workers agree exactly
        # Training moved the weights (an equality of untrained copies would prove nothing).
        assert max(np.abs(a - b).max() for a, b in zip(workers[0], reference_init(tmp_path))) > 1e-3


def reference_init(tmp_path):
    """The initial weights every process starts from (ray_equiv.build's seed)."""
    rng = np.random.default_rng(1)
    shapes = [w.shape for w in _weights(np.load(tmp_path / "reference.npz"))]
    return [rng.normal(scale=0.3, size=s).astype("float32") for s in shapes]
