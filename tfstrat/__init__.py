"""tfstrat: distribution strategies for TensorFlow 2 and Keras 3.

Example:
    >>> import tfstrat
    >>> with tfstrat.CollectiveAllReduce().scope():  # doctest: +SKIP
    ...     model = build_model(); model.compile(optimizer="adam", loss="mse")
    >>> model.fit(dataset)  # doctest: +SKIP

The strategies import TensorFlow when first used, so `import tfstrat` and the `tfstrat`
command's cluster tools (`tf-config`, `launch`) start fast.
"""

from tfstrat import _logging, _runtime
from tfstrat.cluster import TFConfig, TFConfigError
from tfstrat.devices import DeviceInfo, devices, split_cpu
from tfstrat.launch import LaunchConfig, NodeLayout, launch

__version__ = "0.1.0"
_logging.setup()
_runtime.configure()  # TF_CPU_ALLOCATOR_USE_BFC=true unless turned off (see _runtime)

_LAZY = {
    "auto": "tfstrat.strategies.auto",
    "MirroredNCCL": "tfstrat.strategies.mirrored",
    "CollectiveAllReduce": "tfstrat.strategies.collective",
    "ParameterServer": "tfstrat.strategies.ps",
    "Hybrid": "tfstrat.strategies.hybrid",
    "LocalSGD": "tfstrat.strategies.localsgd",
}

__all__ = [
    "TFConfig",
    "TFConfigError",
    "DeviceInfo",
    "devices",
    "split_cpu",
    "LaunchConfig",
    "NodeLayout",
    "launch",
    *_LAZY,
]


def __getattr__(name):
    if name == "keras":  # tfstrat.keras.layers / .callbacks import Keras: only when asked
        import importlib

        return importlib.import_module("tfstrat.keras")
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tfstrat' has no attribute {name!r}")
