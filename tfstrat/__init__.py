"""tfstrat: distribution strategies for TensorFlow 2 and Keras 3.

Example:
    >>> import tfstrat
    >>> with tfstrat.CollectiveAllReduce().scope():  # doctest: +SKIP
    ...     model = build_model(); model.compile(optimizer="adam", loss="mse")
    >>> model.fit(dataset)  # doctest: +SKIP

`import tfstrat` imports neither TensorFlow nor Keras and changes nothing in the process: the
strategies import TensorFlow when first used and apply tfstrat's process settings when created
(`tfstrat.runtime`), so the `tfstrat` command's cluster tools start fast.

The layers, from the bottom: `errors`; `cluster` (TF_CONFIG, hosts, ports, devices) and
`runtime` (process settings), both TensorFlow-free; `_compat` (the one seam to TensorFlow's
and Keras's internals); `reduce` (all-reduce), `ps` (parameter servers and their tables) and
`keras` (layers, callbacks, Keras integration); `strategies`; `launcher` (`tfstrat launch`,
TensorFlow-free); `bench` and `commands` (the `tfstrat` command).
"""

# The old module paths `tfstrat.launch` and `tfstrat.devices` are imported first, so that the
# names below (functions of the same names) are what `tfstrat.launch` and `tfstrat.devices` are.
from tfstrat import devices as _devices_module  # noqa: F401
from tfstrat import launch as _launch_module  # noqa: F401
from tfstrat.cluster import TFConfig
from tfstrat.cluster.devices import DeviceInfo, devices, split_cpu
from tfstrat.cluster.layout import NodeLayout
from tfstrat.errors import TFConfigError, TfstratError
from tfstrat.launcher.api import LaunchConfig, launch

__version__ = "0.1.0"

_LAZY = {
    "auto": "tfstrat.strategies.auto",
    "MirroredNCCL": "tfstrat.strategies.mirrored",
    "CollectiveAllReduce": "tfstrat.strategies.collective",
    "ParameterServer": "tfstrat.strategies.parameter_server",
    "Hybrid": "tfstrat.strategies.hybrid",
    "LocalSGD": "tfstrat.strategies.localsgd",
    "ModelParallel": "tfstrat.strategies.model_parallel",
    "DeviceMesh": "tfstrat.mesh.layout",
    "LayoutMap": "tfstrat.mesh.layout",
    "PowerSGD": "tfstrat.reduce.compression",
}

__all__ = [
    "TFConfig",
    "TFConfigError",
    "TfstratError",
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
