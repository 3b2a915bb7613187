"""`tf.keras` as tf-keras (Keras 2): refused by name under tfstrat's strategies.

TensorFlow's `tf.keras` is Keras 3, unless `TF_USE_LEGACY_KERAS=1` and tf-keras is installed:
then it is Keras 2. Ray Train's `TensorflowTrainer` sets that variable on every worker. tfstrat's
strategies serve Keras 3 (`import keras`): the exactness of `fit` under them rests on what they
do to Keras 3's step, optimizers and input, which a Keras 2 model never runs through, so it
would train without it and without a word (measured: a `tf.keras.Sequential` under MirroredNCCL
on two devices trained, silently). `install()`, when a strategy is created with the variable
set and tf-keras installed, warns once and makes a tf-keras model's `compile` under a tfstrat
strategy raise UsageError naming the variable, tf-keras and the fix. A Keras 3 model (`import
keras`) is untouched by either.
"""

from __future__ import annotations

import importlib.util
import logging
import os

from tfstrat.errors import UsageError

logger = logging.getLogger("tfstrat")
ENV = "TF_USE_LEGACY_KERAS"


def legacy() -> bool:
    """Whether `tf.keras` is tf-keras in this process: the variable set true, tf-keras present."""
    flag = os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes")
    return flag and importlib.util.find_spec("tf_keras") is not None


def message(strategy) -> str:
    return (
        f"tfstrat: this model is a tf-keras (Keras 2) model, and {type(strategy).__name__} "
        f"trains Keras 3 models: {ENV}={os.environ.get(ENV)!r} (Ray Train's TensorflowTrainer "
        "sets it on every worker) makes tf.keras tf-keras. Build the model with Keras 3: "
        "`import keras` and keras.Sequential / keras.layers / keras.Model instead of tf.keras "
        "(Keras 3 ignores the variable), or remove tf-keras from the environment."
    )


def install() -> None:
    """Warns once and guards tf-keras's `Model.compile` when `legacy()` (once per process)."""
    if not legacy():
        return
    import tensorflow as tf
    import tf_keras

    from tfstrat._compat import patches

    if patches.is_patched(tf_keras.Model, "compile"):
        return

    logger.warning(
        "tfstrat: %s=%s: tf.keras is tf-keras (Keras 2) here; tfstrat's strategies train "
        "Keras 3 models (`import keras`), and refuse a tf.keras model at compile.",
        ENV,
        os.environ.get(ENV),
    )
    compile_ = tf_keras.Model.compile

    def compile(self, *args, **kwargs):
        strategy = getattr(self, "_distribution_strategy", None) or tf.distribute.get_strategy()
        if type(strategy).__module__.startswith("tfstrat."):
            raise UsageError(message(strategy))
        return compile_(self, *args, **kwargs)

    compile.__doc__ = compile_.__doc__
    patches.patch(tf_keras.Model, "compile", compile, "a tf-keras model refused by name")
