"""Which collective carries a strategy's all-reduces: one decision, from the devices trained on.

`choose` is a pure function of this worker's replica devices (every worker trains on alike),
the worker count and the TensorFlow build, so every case is tested on literal device lists;
`replica_devices` reads a process's visible devices without starting TensorFlow's runtime.

| the replicas (each worker's) | workers | `communication="auto"` |
|---|---|---|
| GPUs of a CUDA build, one logical device per card, 2+ replicas in all (1 or more per worker, one host or many) | any | NCCL (as stock `MultiWorkerMirroredStrategy`) |
| CPU devices (one, or logical ones from `tfstrat.split_cpu`) | 2+ | tfstrat's TCP ring (shared memory between two workers of one machine); several devices of a worker summed by the worker first |
| anything else: CPUs split into logical devices in one process, virtual GPUs (NCCL refuses two ranks on one card), CPUs and GPUs mixed, a build without CUDA | any | TensorFlow's ring; several devices of one process that NCCL does not join are summed by the process itself (`tfstrat.reduce.cross_device`) |

`communication="nccl"` where NCCL cannot run is refused with the reason. GPUs are the ones this process sees: `CUDA_VISIBLE_DEVICES`
hides cards from CUDA, `tf.config.set_visible_devices` from TensorFlow; both count here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tfstrat.errors import UsageError

CHOICES = ("auto", "tcp", "ring", "nccl")


@dataclasses.dataclass(frozen=True)
class Transport:
    """What carries the dense all-reduces: "nccl", "ring" (TensorFlow's) or "tcp" (tfstrat's)."""

    kind: str
    why: str

    @property
    def implementation(self) -> str:
        """The `tf.distribute.experimental.CommunicationImplementation` name."""
        return "NCCL" if self.kind == "nccl" else "RING"


def _is_gpu(name: str) -> bool:
    return "GPU:" in name.upper()


def choose(
    communication: str,
    replicas: Sequence[str],
    workers: int = 1,
    cuda_build: bool = True,
    virtual_gpus: bool = False,
) -> Transport:
    """The transport for `communication=` over `replicas` on each of `workers` workers.

    Args:
        communication: "auto", "tcp", "ring" or "nccl".
        replicas: this worker's replica devices ("/device:GPU:0", "/device:CPU:1", ...).
        workers: how many workers train alike (1: one process).
        cuda_build: whether TensorFlow was built with CUDA (NCCL needs it).
        virtual_gpus: whether a card is split into several logical GPUs.

    Raises:
        UsageError: an unknown `communication`, or "nccl" where NCCL cannot run; the message
            says why and what to use.

    Example:
        >>> choose("auto", ["/device:GPU:0"], workers=4).kind  # one GPU per worker
        'nccl'
        >>> choose("auto", ["/device:CPU:0"], workers=2).kind
        'tcp'
    """
    if communication not in CHOICES:
        raise UsageError(
            f"Received: communication={communication!r}. Use 'auto', 'tcp', 'ring' or 'nccl'."
        )
    replicas = list(replicas)
    total = len(replicas) * max(1, workers)
    gpus = bool(replicas) and all(_is_gpu(d) for d in replicas)
    no_nccl = None
    if not gpus:
        no_nccl = f"the replicas {replicas} are not all GPUs"
    elif not cuda_build:
        no_nccl = "this TensorFlow build has no CUDA"
    elif virtual_gpus:
        no_nccl = "a GPU is split into virtual GPUs (NCCL refuses two ranks on one card)"
    elif total < 2:
        no_nccl = "one replica in all: nothing to all-reduce"
    if communication == "nccl":
        if no_nccl:
            raise UsageError(
                f"Received: communication='nccl' with {workers} worker(s) of replicas "
                f"{replicas}: {no_nccl}; use communication='auto' or 'ring'."
            )
        return Transport("nccl", "asked for")
    if communication == "tcp":
        return Transport("tcp" if workers > 1 else "ring", "asked for")
    if communication == "ring":
        return Transport("ring", "asked for")
    if no_nccl is None:
        return Transport("nccl", f"{total} GPU replicas in all ({len(replicas)} per worker)")
    if workers > 1 and all(not _is_gpu(d) for d in replicas):
        per = "one CPU device" if len(replicas) == 1 else f"{len(replicas)} CPU devices"
        return Transport("tcp", f"{per} per worker")
    return Transport("ring", no_nccl)


def replica_devices(devices: int | Sequence[str] | None = None) -> tuple[list[str], bool]:
    """(this process's replica devices, whether a GPU is split into virtual ones), without
    starting TensorFlow's runtime (fact: `list_logical_devices` would).

    `devices`: None (every visible GPU, else the one CPU), a count of logical CPU devices, or
    names ("/gpu:0" and "/device:GPU:0" alike).
    """
    import tensorflow as tf

    gpus = tf.config.get_visible_devices("GPU")
    logical = [len(tf.config.get_logical_device_configuration(g) or [None]) for g in gpus]
    virtual = any(n > 1 for n in logical)
    if devices is None:
        n = sum(logical)
        return ([f"/device:GPU:{i}" for i in range(n)] or ["/device:CPU:0"]), virtual
    if isinstance(devices, int):
        return [f"/device:CPU:{i}" for i in range(devices)], virtual
    return [normalize(d) for d in devices], virtual


def normalize(name: str) -> str:
    """'/gpu:0', 'GPU:0' and '/device:GPU:0' as '/device:GPU:0' (a job prefix is kept)."""
    head, sep, tail = name.rpartition("/")
    kind, _, index = tail.partition(":")
    if kind.lower() == "device":  # '/device:GPU:0'
        kind, _, index = index.partition(":")
    if kind.upper() not in ("CPU", "GPU", "TPU") or not index.isdigit():
        raise UsageError(
            f"Received: device {name!r}. Name a device as '/gpu:0', '/cpu:1' or '/device:GPU:0'."
        )
    prefix = head + sep if head and not head.endswith("device") else ""
    return f"{prefix.rstrip('/')}/device:{kind.upper()}:{int(index)}"
