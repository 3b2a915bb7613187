"""What this host can compute with, found without initialising TensorFlow's runtime.

`tf.config.list_logical_devices()` initialises the eager runtime, after which no multi-worker
strategy can be created ("Collective ops must be configured at program startup", seen on TF 2.21).
Everything here therefore uses `list_physical_devices` and build information only, so that
`tfstrat.devices()` followed by `tfstrat.auto()` works.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence

from tfstrat.errors import UsageError

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GPU:
    """One physical GPU as TensorFlow reports it.

    Attributes:
        name: TensorFlow's physical device name, e.g. `/physical_device:GPU:0`.
        model: the device's model name where reported, e.g. `NVIDIA A100-SXM4-40GB`.
        compute_capability: `(major, minor)` where reported.
        memory_bytes: total memory where it can be read without initialising the runtime.
    """

    name: str
    model: str | None = None
    compute_capability: tuple[int, int] | None = None
    memory_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """The devices of this host.

    Attributes:
        cpu_count: logical CPUs this process may run on.
        physical_devices: every physical device name TensorFlow lists.
        gpus: the GPUs, in TensorFlow's order.
        cuda_build: whether this TensorFlow build has CUDA (and so NCCL) kernels.
        tpu: the TPU's name (`TPU_NAME`, or `local`) if one is configured, else None.
        tensorflow_version: `tf.__version__`.
        keras_version: `keras.__version__`, or None if Keras is missing.
        visible_gpus: the GPUs this process may use (`tf.config.set_visible_devices` hides
            some from TensorFlow alone); None: all of `gpus`.
    """

    cpu_count: int
    physical_devices: tuple[str, ...]
    gpus: tuple[GPU, ...]
    cuda_build: bool
    tpu: str | None
    tensorflow_version: str
    keras_version: str | None
    visible_gpus: int | None = None

    @property
    def usable_gpus(self) -> int:
        """The GPUs this process may train on."""
        return len(self.gpus) if self.visible_gpus is None else self.visible_gpus

    @property
    def nccl(self) -> bool:
        """Whether NCCL all-reduce can be used: a CUDA build with a GPU (between this host's
        GPUs when it has 2+, and across workers with one or more each, as stock)."""
        return self.cuda_build and len(self.gpus) >= 1

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["nccl"] = self.nccl
        return d

    def _nccl_words(self) -> str:
        if not self.nccl:
            return "no (needs a CUDA build and a GPU)"
        if len(self.gpus) == 1:
            return "yes, across workers (one GPU here: nothing to all-reduce within this host)"
        return "yes"

    def table(self) -> str:
        """A readable multi-line summary, as `tfstrat devices` prints it."""
        rows = [
            ("TensorFlow", self.tensorflow_version),
            ("Keras", self.keras_version or "not installed"),
            ("CPUs", str(self.cpu_count)),
            ("GPUs", str(len(self.gpus))),
            ("CUDA build", "yes" if self.cuda_build else "no"),
            ("NCCL usable", self._nccl_words()),
            ("TPU", self.tpu or "none"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"{k:<{width}}  {v}" for k, v in rows]
        for gpu in self.gpus:
            cc = ".".join(map(str, gpu.compute_capability)) if gpu.compute_capability else "?"
            mem = f"{gpu.memory_bytes / 2**30:.1f} GiB" if gpu.memory_bytes else "? GiB"
            lines.append(f"  {gpu.name}  {gpu.model or '?'}  compute {cc}  {mem}")
        return "\n".join(lines)


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _gpu_info(tf, device) -> GPU:
    try:
        details = tf.config.experimental.get_device_details(device)
    except Exception:  # older drivers raise for unknown devices; the name is still useful
        details = {}
    cc = details.get("compute_capability")
    return GPU(
        name=device.name,
        model=details.get("device_name"),
        compute_capability=tuple(cc) if cc else None,
        memory_bytes=_nvidia_smi_memory(device.name),
    )


def smi_index(tf_index: int, environ=None) -> str:
    """The `nvidia-smi -i` argument for TensorFlow's GPU `tf_index`: nvidia-smi ignores
    `CUDA_VISIBLE_DEVICES`, which renumbers the GPUs CUDA (and TensorFlow) sees.

    Example:
        >>> smi_index(0, {"CUDA_VISIBLE_DEVICES": "2,3"})
        '2'
        >>> smi_index(1, {})
        '1'
    """
    environ = os.environ if environ is None else environ
    visible = [g.strip() for g in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    if "CUDA_VISIBLE_DEVICES" in environ and tf_index < len(visible):
        return visible[tf_index]  # an index or a UUID; nvidia-smi -i takes both
    return str(tf_index)


def _nvidia_smi_memory(name: str) -> int | None:
    """Total memory of a GPU from nvidia-smi, or None; never raises, never waits long."""
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return None
    index = smi_index(int(name.rsplit(":", 1)[-1]))
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "-i",
                index,
                "--query-gpu=memory.total",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return int(out.stdout.strip().splitlines()[0]) * 2**20
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def _tpu_name() -> str | None:
    if os.environ.get("TPU_NAME"):
        return os.environ["TPU_NAME"]
    # A TPU VM exposes its chips as /dev/accel* (v4 and later) or /dev/vfio (v5e and later).
    if any(os.path.exists(f"/dev/accel{i}") for i in range(8)):
        return "local"
    return None


def devices() -> DeviceInfo:
    """Describes this host's devices without initialising TensorFlow's runtime.

    Returns:
        A `DeviceInfo`.

    Example:
        >>> import tfstrat
        >>> info = tfstrat.devices()
        >>> info.cpu_count >= 1
        True
    """
    import tensorflow as tf

    try:
        import keras

        keras_version = keras.__version__
    except ImportError:
        keras_version = None
    physical = tf.config.list_physical_devices()
    gpus = tuple(_gpu_info(tf, d) for d in physical if d.device_type == "GPU")
    return DeviceInfo(
        cpu_count=_cpu_count(),
        physical_devices=tuple(d.name for d in physical),
        gpus=gpus,
        cuda_build=bool(tf.sysconfig.get_build_info().get("is_cuda_build", False)),
        tpu=_tpu_name(),
        tensorflow_version=tf.__version__,
        keras_version=keras_version,
        visible_gpus=len(tf.config.get_visible_devices("GPU")),
    )


def runtime_initialized() -> bool:
    """Whether TensorFlow's eager runtime has started (after which devices are fixed)."""
    from tfstrat._compat.tf import context

    return context.context()._context_handle is not None


def split_cpu(n: int) -> list[str]:
    """Splits the host CPU into `n` logical devices, so CPU-only hosts can run several replicas.

    Must run before TensorFlow's runtime starts (before any op runs or any logical device is
    listed). Calling it again with the same `n` is a no-op.

    Args:
        n: the number of logical CPU devices, at least 1.

    Returns:
        The logical device names, `/device:CPU:0` .. `/device:CPU:{n-1}`.

    Raises:
        ValueError: if `n` < 1.
        RuntimeError: if TensorFlow's runtime already started with a different split.

    Example:
        >>> import tfstrat
        >>> tfstrat.split_cpu(2)
        ['/device:CPU:0', '/device:CPU:1']
    """
    import tensorflow as tf

    if not isinstance(n, int) or n < 1:
        raise UsageError(f"Received: n={n!r}. split_cpu needs a positive integer device count.")
    cpu = tf.config.list_physical_devices("CPU")[0]
    names = [f"/device:CPU:{i}" for i in range(n)]
    current = tf.config.get_logical_device_configuration(cpu)
    if current is not None and len(current) == n:
        return names
    if runtime_initialized():
        have = len(current) if current else 1
        raise RuntimeError(
            f"Received: split_cpu({n}) after TensorFlow's runtime started with {have} CPU "
            "device(s). Call tfstrat.split_cpu() first in your program, before any TensorFlow "
            "op runs or a strategy is created."
        )
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)]
    )
    from tfstrat.runtime import logs

    logs.setup()  # called before any strategy: tfstrat's own log lines show from here on
    logger.info("tfstrat: split the CPU into %d logical devices", n)
    return names


def local_devices(devices: Sequence[str] | None = None) -> list[str]:
    """The devices a one-process strategy should replicate over.

    Args:
        devices: explicit device names, or None for every visible GPU (each logical one of a
            split card), else every logical CPU device (as split by `split_cpu`, or the one CPU).

    Returns:
        Device names for `tf.distribute.MirroredStrategy(devices=...)`.
    """
    if devices is not None:
        devices = list(devices)
        if not devices:
            raise UsageError("Received: devices=[]. Pass None for every local device, or names.")
        return devices
    import tensorflow as tf

    # The GPUs this process may use (`tf.config.set_visible_devices` hides some from
    # TensorFlow, `CUDA_VISIBLE_DEVICES` from CUDA), each as many times as it is split.
    gpus = tf.config.get_visible_devices("GPU")
    n = sum(len(tf.config.get_logical_device_configuration(g) or [None]) for g in gpus)
    if n:
        return [f"/device:GPU:{i}" for i in range(n)]
    cpu = tf.config.list_physical_devices("CPU")[0]
    split = tf.config.get_logical_device_configuration(cpu)
    n = len(split) if split else 1
    logger.info(
        "tfstrat: no GPUs; replicating over %d logical CPU device(s)%s",
        n,
        "" if split else " (call tfstrat.split_cpu(n) first for more)",
    )
    return [f"/device:CPU:{i}" for i in range(n)]
