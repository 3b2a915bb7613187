"""`tfstrat.devices` as a module path: `from tfstrat.devices import DeviceInfo` keeps working.
Device detection lives in `tfstrat.cluster.devices`."""

from tfstrat.cluster.devices import (
    GPU,
    DeviceInfo,
    devices,
    local_devices,
    runtime_initialized,
    split_cpu,
)

__all__ = ["GPU", "DeviceInfo", "devices", "local_devices", "runtime_initialized", "split_cpu"]
