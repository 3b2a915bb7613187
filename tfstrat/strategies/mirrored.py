"""`MirroredNCCL`: one process, several local devices, synchronous all-reduce."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import tensorflow as tf

from tfstrat._compat.tf import input_util
from tfstrat.cluster.devices import local_devices
from tfstrat.keras import _shuffle
from tfstrat.reduce.cross_device import SparseAwareAllReduce
from tfstrat.reduce.sparse import DensityPolicy
from tfstrat.strategies import _common, _watchdog, transport
from tfstrat.strategies.collective import specialise_launchers

logger = logging.getLogger(__name__)


class MirroredNCCL(_common.AdoptsKerasOptimizers, tf.distribute.MirroredStrategy):
    """Synchronous data parallelism over the devices of one process.

    Dense gradients go out in one packed NCCL all-reduce on two or more physical GPUs; on CPUs
    and virtual devices this process adds the replicas' copies itself (no TensorFlow collective,
    whose records grow with the run: `tfstrat.reduce.cross_device`). Sparse gradients (`IndexedSlices` from Embedding
    layers) are deduplicated on each replica and all-gathered in one collective, or densified
    when the replicas could touch more than `sparse_as_dense` of the table's rows.

    Args:
        devices: device names; None for every GPU, else every logical CPU device (split the CPU
            first with `tfstrat.split_cpu(n)`).
        communication: "auto", "nccl" (GPUs only) or "ring".
        sparse_as_dense: "auto", a fraction in (0, 1], True or False (see `DensityPolicy`).
        timeout: seconds a step's collectives may wait before failing, or None (wait for
            ever: the devices are this process's own). Bounded by the process's watchdog
            thread, not a thread per op (`tfstrat.strategies._watchdog`).

    Raises:
        ValueError: `communication="nccl"` where NCCL cannot run, or an unknown option.

    Example:
        >>> import tfstrat, keras
        >>> tfstrat.split_cpu(2)  # doctest: +SKIP
        >>> strategy = tfstrat.MirroredNCCL()  # doctest: +SKIP
        >>> with strategy.scope():  # doctest: +SKIP
        ...     model = keras.Sequential([keras.layers.Dense(1)])
        ...     model.compile(optimizer="sgd", loss="mse")
    """

    _instances = 0

    def __init__(
        self,
        devices: Sequence[str] | None = None,
        *,
        communication: str = "auto",
        sparse_as_dense: str | float | bool = "auto",
        timeout: float | None = None,
    ):
        devices = local_devices(devices)
        _shuffle.seed_shuffles(set_global_seed=False)  # reshuffled per epoch, replayable
        chosen = transport.choose(communication, devices, 1, _cuda_build(), _virtual_gpus())
        implementation = _common.Impl[chosen.implementation]
        # Each instance its own collective group keys: TF 2.21 starts every MirroredStrategy
        # at group key 1, so a second one over another number of devices in the same process
        # fails ("joining a group with size 3, but that group has size 2").
        MirroredNCCL._instances += 1
        self._collective_key_base = 100_000 * MirroredNCCL._instances
        super().__init__(devices=devices)
        extended = self.extended
        # No timeout_seconds (a thread per collective op): the process's watchdog (`_watchdog`).
        options = tf.distribute.experimental.CommunicationOptions(implementation=implementation)
        self.density = DensityPolicy(sparse_as_dense)
        # Shares the strategy's collective keys: two key generators for one device group would
        # hand out colliding instance keys.
        ops = SparseAwareAllReduce(
            extended._devices,
            len(extended._devices),
            options,
            self.density,
            collective_keys=extended._collective_keys,
        )
        # steps_per_execution > 1: instance keys from a counter per replica, so that every
        # replica draws the same sequence of keys (`collective._CollectiveLauncher`).
        specialise_launchers(ops, None, timeout)
        if timeout is not None:
            _watchdog.WATCHDOG.configure("this process", [])
        extended._cross_device_ops = ops
        extended._collective_ops = ops
        extended._communication_options = options
        how = f"{implementation.name.lower()} all-reduce"
        if ops.sums_locally():
            how = "summed by copies between the devices (no collective)"
        logger.info(
            "tfstrat: MirroredNCCL over %d device(s) %s, %s (%s)",
            len(devices),
            list(devices),
            how,
            chosen.why,
        )

    def experimental_distribute_dataset(self, dataset, options=None):
        _common.check_not_empty(dataset)  # else a bare StopIteration from Keras's first next()
        extended = self.extended
        plain = _common.plain_input_options(extended.worker_devices, options)
        if plain is None:
            distributed = super().experimental_distribute_dataset(dataset, options)
        else:  # one CPU device: stock's path (MirroredExtended) with a plain iterator
            distributed = input_util.get_distributed_dataset(
                dataset,
                extended._input_workers_with_options(),
                self,
                num_replicas_in_sync=self.num_replicas_in_sync,
                options=plain,
            )
        return _common.name_empty_input(distributed)


def _cuda_build() -> bool:
    return bool(tf.sysconfig.get_build_info().get("is_cuda_build", False))


def _virtual_gpus() -> bool:
    """Whether a visible GPU is split into several logical ones (NCCL refuses them)."""
    return transport.replica_devices(None)[1]
