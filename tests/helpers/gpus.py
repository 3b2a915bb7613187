"""The GPU tier: `requires_gpus(n)` marks a test `gpu` and skips it, naming what is missing, on
a machine with fewer than n GPUs (it runs wherever TensorFlow lists n)."""

import pytest


def gpu_count() -> int:
    """Physical GPUs TensorFlow lists (listing them does not start its runtime)."""
    import tensorflow as tf

    return len(tf.config.list_physical_devices("GPU"))


def requires_gpus(n: int):
    have = gpu_count()
    skip = pytest.mark.skipif(
        have < n, reason=f"needs {n} GPUs with a CUDA build of TensorFlow; this machine has {have}"
    )
    return [pytest.mark.gpu, skip]
