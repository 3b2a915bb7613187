"""Process settings tfstrat makes on the user's behalf, applied when a strategy is created
(never at `import tfstrat`): its log handler (`logs`), filters for TensorFlow's warnings that
say nothing (`quiet`) and TensorFlow's BFC allocator on the CPU (`allocator`). `traffic` reads
the process's TCP byte counts for tests and benchmarks."""

from tfstrat._compat import legacy_keras, versions
from tfstrat.runtime import allocator, logs


def apply() -> None:
    """Checks the TensorFlow and Keras versions (`tfstrat._compat.versions`) and applies
    tfstrat's process settings once; strategies call it before TensorFlow creates its devices
    (see `allocator.configure` for what happens when that is too late)."""
    logs.setup()
    versions.check()
    legacy_keras.install()  # tf.keras as tf-keras (TF_USE_LEGACY_KERAS=1): refused by name
    allocator.configure()
    allocator.announce()
