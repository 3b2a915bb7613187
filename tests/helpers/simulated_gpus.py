"""GPUs that exist only in TensorFlow's device lists, so that the code deciding devices and
transports can be followed on a machine without a GPU, up to (not into) a step.

`simulate(cards, split)` makes `tf.config.list_physical_devices`, `get_visible_devices` and
`get_logical_device_configuration` report `cards` GPUs, each split into `split` logical GPUs
when `split` > 1, as TensorFlow reports them on a GPU host before its runtime starts (the
lists are read without starting it). The runtime itself is untouched: it has only the CPU,
so no op may run on a simulated GPU; strategies are constructed, and their decisions read.
This TensorFlow is a CUDA build (`tf.sysconfig.get_build_info()["is_cuda_build"]`), as on a
GPU host. `from_environment()` simulates one card per entry of `CUDA_VISIBLE_DEVICES`, the
binding `tfstrat launch` gave the task.
"""

from __future__ import annotations

import os

_REAL = {}  # TensorFlow's own functions, kept at the first call: `simulate` may be called again


def simulate(cards: int, split: int = 1) -> None:
    import tensorflow as tf

    if not _REAL:
        _REAL.update(
            listed=tf.config.list_physical_devices,
            visible=tf.config.get_visible_devices,
            logical=tf.config.get_logical_device_configuration,
        )
    physical = [
        tf.config.PhysicalDevice(name=f"/physical_device:GPU:{i}", device_type="GPU")
        for i in range(cards)
    ]
    real_list, real_visible, real_logical = _REAL["listed"], _REAL["visible"], _REAL["logical"]

    def listed(real):
        def devices(device_type=None):
            if device_type is not None and device_type.upper() == "GPU":
                return list(physical)
            return real(device_type) + (physical if device_type is None else [])

        return devices

    def logical(device):
        if device.device_type != "GPU":
            return real_logical(device)
        if split < 2:
            return None
        return [tf.config.LogicalDeviceConfiguration(memory_limit=1024) for _ in range(split)]

    tf.config.list_physical_devices = tf.config.experimental.list_physical_devices = listed(
        real_list
    )
    tf.config.get_visible_devices = tf.config.experimental.get_visible_devices = listed(
        real_visible
    )
    tf.config.get_logical_device_configuration = logical
    tf.config.experimental.get_virtual_device_configuration = logical


def from_environment() -> int:
    """Simulates one GPU per entry of this task's CUDA_VISIBLE_DEVICES; returns the count."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    cards = len([g for g in (visible or "").split(",") if g.strip()])
    simulate(cards)
    return cards
