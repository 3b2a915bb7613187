"""Which strategy `tfstrat.auto()` picks, and why: one rule list, read by `auto` and by
`tfstrat doctor`. TensorFlow-free (it reads a TFConfig and a DeviceInfo)."""

from __future__ import annotations

from tfstrat.cluster import TFConfig
from tfstrat.cluster.devices import DeviceInfo

DEFAULT = "TensorFlow's default strategy"


def choose(tf_config: TFConfig | None, info: DeviceInfo) -> tuple[str, str]:
    """(strategy name, why) in the order TPU, ps tasks, several workers, two GPUs, default.

    Example:
        >>> host = DeviceInfo(2, (), (), False, None, "2.21.0", "3.15.0")
        >>> choose(TFConfig.from_hosts(["a:1", "b:1"]), host)
        ('CollectiveAllReduce', 'TF_CONFIG has 2 workers')
    """
    if info.tpu:
        return "TPUStrategy", f"TPU {info.tpu} found"
    ps = len(tf_config.addresses("ps")) if tf_config is not None else 0
    if ps:
        return "Hybrid", (
            f"TF_CONFIG has {ps} ps task(s): dense variables all-reduced, tfstrat Embedding "
            "tables on the ps tasks"
        )
    if tf_config is not None and tf_config.num_workers > 1:
        return "CollectiveAllReduce", f"TF_CONFIG has {tf_config.num_workers} workers"
    if info.usable_gpus >= 2:
        return "MirroredNCCL", f"{info.usable_gpus} local GPUs"
    return "default", f"one worker, {info.usable_gpus} GPU(s), no TPU"


def describe(name: str, why: str) -> str:
    """ "CollectiveAllReduce (TF_CONFIG has 2 workers)"; the default strategy by its name."""
    return f"{DEFAULT if name == 'default' else name} ({why})"
