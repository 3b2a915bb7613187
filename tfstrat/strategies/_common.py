"""Pieces shared by the all-reduce strategies."""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

_Impl = tf.distribute.experimental.CommunicationImplementation


def communication_implementation(communication: str, devices: Sequence[str]) -> _Impl:
    """Maps `communication=` to a collective implementation, checking NCCL can run.

    "auto" is NCCL when every device is a physical GPU of a CUDA build and there are two or
    more; ring otherwise (CPUs, virtual GPUs, one device).
    """
    gpus = [d for d in devices if "GPU" in d.upper()]
    physical = tf.config.list_physical_devices("GPU")
    cuda = bool(tf.sysconfig.get_build_info().get("is_cuda_build", False))
    nccl_ok = cuda and len(gpus) == len(devices) and len(physical) >= 2
    if communication == "auto":
        return _Impl.NCCL if nccl_ok else _Impl.RING
    if communication == "ring":
        return _Impl.RING
    if communication == "nccl":
        if not nccl_ok:
            raise ValueError(
                f"Received: communication='nccl' with devices {list(devices)} on a host with "
                f"{len(physical)} GPU(s){'' if cuda else ' and a TensorFlow build without CUDA'}."
                " NCCL needs two or more physical GPUs; use communication='auto' or 'ring'."
            )
        return _Impl.NCCL
    raise ValueError(f"Received: communication={communication!r}. Use 'auto', 'nccl' or 'ring'.")
