"""`CollectiveAllReduce`: one process per worker, synchronous all-reduce, fixed for Keras 3.

Stock `MultiWorkerMirroredStrategy` fails inside Keras 3 `fit` (TF 2.21 / Keras 3.15): its
`_reduce_to` does not map over nested structures, and `reduce(MEAN, scalar, axis=0)` of the
per-step logs raises "Invalid reduction dimension" (keras#20585). It also runs a cross-worker
"does any replica still have data" all-reduce every step. This subclass fixes both failures and
drops the per-step check by giving every worker a slice of every global batch. It stays a
`MultiWorkerMirroredStrategy`: Keras gathers `predict` outputs across workers only for those.
"""

from __future__ import annotations

import json
import logging
import socket
import weakref
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from tfstrat._compat import patches
from tfstrat._compat.tf import collective_all_reduce_strategy as _cars
from tfstrat._compat.tf import (
    context,
    cross_device_utils,
    distribute_lib,
    input_lib,
    input_util,
    nest,
)
from tfstrat._compat.tf import values as _values
from tfstrat.cluster import TFConfig
from tfstrat.cluster import ports as _ports
from tfstrat.errors import AgreementError, ListenError, UsageError
from tfstrat.keras import _fit_scope
from tfstrat.launcher import gpus
from tfstrat.reduce import compression as _compression
from tfstrat.reduce import ring
from tfstrat.reduce.compression import PowerSGD
from tfstrat.reduce.cross_device import SparseAwareAllReduce
from tfstrat.reduce.sparse import DensityPolicy
from tfstrat.strategies import _common, _reuse, _startup, _stopping, _watchdog, transport
from tfstrat.strategies import agreement as _agreement

logger = logging.getLogger(__name__)

_SUM, _MEAN = tf.distribute.ReduceOp.SUM, tf.distribute.ReduceOp.MEAN
DEFAULT_TIMEOUT = 300.0


def _in_nested_control_flow() -> bool:
    """True while tracing a tf.function that is itself traced inside a while/cond."""
    g = tf.compat.v1.get_default_graph()
    while getattr(g, "is_control_flow_graph", False):
        g = g.outer_graph
    g = getattr(g, "outer_graph", None)
    while g is not None:
        if getattr(g, "is_control_flow_graph", False):
            return True
        g = getattr(g, "outer_graph", None)
    return False


class _CollectiveLauncher(cross_device_utils.CollectiveReplicaLauncher):
    """TensorFlow's launcher of one replica's collectives, with two changes.

    Instance keys from a counter variable inside nested control flow: Keras runs
    `steps_per_execution > 1` steps in a while loop; there the call-time instance key
    (cross_device_utils.py, TF 2.21) is never fed ("You must feed a value for placeholder
    tensor 'while/cond/Placeholder'"), and a trace-time key breaks when a shape changes between
    iterations. Each replica has its own counter (`counter`), drawn in trace order: the members
    of one collective, one per replica, draw the same key (one counter shared by a worker's
    devices gave them different keys, and they waited for each other forever).

    No per-op timeout (a thread per op, `_watchdog`): every function tracing a collective here is
    marked for the process's watchdog, with `watch` seconds; an eager all-reduce is a wait.
    """

    counter = None
    watch: float | None = None  # the strategy's timeout; None: not watched

    def _next_instance_key(self):
        _watchdog.WATCHDOG.mark(self.watch)
        if self._use_unique_instance_key() and _in_nested_control_flow():
            return tf.convert_to_tensor(self.counter.assign_add(1))
        return super()._next_instance_key()

    def all_reduce(self, input_tensor, control_input=None, options=None):
        if self.watch is None or not tf.executing_eagerly():
            return super().all_reduce(input_tensor, control_input, options)
        with _watchdog.WATCHDOG.guard(self.watch, "an all-reduce"):
            return super().all_reduce(input_tensor, control_input, options)


# Instance keys of the counters: the replicas' from 2**30, a host's own from 1.5 * 2**30 (its
# group can have the same key as the replicas' with one device per worker); TensorFlow's own
# keys start near 0.
_REPLICA_KEYS, _HOST_KEYS = 1 << 30, 3 << 29


def specialise_launchers(replicas, hosts, watch: float | None) -> None:
    """Makes the launchers of the cross-device ops `replicas` (one launcher per replica) and
    `hosts` (None or the per-host ops) `_CollectiveLauncher`s, each with its own key counter on
    its device, watched for `watch` seconds."""
    for ops, base in ((replicas, _REPLICA_KEYS), (hosts, _HOST_KEYS)):
        for launcher in ops._launchers if ops is not None else ():
            with tf.init_scope(), tf.device(launcher._device):
                counter = tf.Variable(base, dtype=tf.int32, trainable=False, name="key")
            # our own objects: specialised, TensorFlow's class is not patched
            launcher.__class__, launcher.counter = _CollectiveLauncher, counter
            launcher.watch = watch


class _Extended(_cars.CollectiveAllReduceExtended):
    def __init__(self, container, resolver, options, local_devices, density, watch):
        # None: stock's choice (every GPU, else the CPU); a count of logical CPUs; or names.
        if isinstance(local_devices, int):
            local_devices = [f"/device:CPU:{i}" for i in range(local_devices)]
        self._local_device_names = local_devices
        self._density = density
        if getattr(container, "_tfstrat_reused", False):  # a running server: `_reuse`
            self._std_server_started, self._enable_check_health = True, False
        super().__init__(container, cluster_resolver=resolver, communication_options=options)
        specialise_launchers(self._cross_device_ops, self._host_cross_device_ops, watch)

    def _initialize_local_devices(self, cluster_resolver, worker_device):
        names = self._local_device_names
        if not names:
            return super()._initialize_local_devices(cluster_resolver, worker_device)
        kind = "GPU" if all("GPU:" in n for n in names) else "CPU"
        return tuple(f"{worker_device}{n[n.index('/device:') :]}" for n in names), kind

    def _initialize_strategy(self, cluster_resolver, devices):
        super()._initialize_strategy(cluster_resolver, devices)
        stock = self._cross_device_ops
        self._cross_device_ops = SparseAwareAllReduce(
            stock._devices,
            stock._group_size,
            self._communication_options,
            self._density,
            collective_keys=self._collective_keys,
        )
        hosts = getattr(self, "_host_cross_device_ops", None)
        if hosts is not None:  # a value on no replica (a count, a flag): one device a worker
            self._host_cross_device_ops = SparseAwareAllReduce(
                hosts._devices,
                hosts._group_size,
                self._communication_options,
                self._density,
                collective_keys=self._collective_keys,
            )

    def use_ring(self, ring_, compression) -> None:
        """Every all-reduce across the workers goes over tfstrat's `ring_` (the replicas' and
        the host's, in one order: one `RingCalls`)."""
        replicas, hosts = self._cross_device_ops, getattr(self, "_host_cross_device_ops", None)
        replicas.ring, replicas.compression = ring_, compression
        if hosts is not None and hosts is not replicas:
            hosts.ring, hosts._ring_calls = ring_, replicas._ring_calls

    def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
        # Several devices summed by this worker (`sums_locally`) meet in a merge_call; stock
        # would all-reduce each replica on its own (XLA on GPUs, where there is no merge call).
        if self._cross_device_ops.sums_locally():
            return distribute_lib.StrategyExtendedV2._replica_ctx_all_reduce(
                self, reduce_op, value, options
            )
        return super()._replica_ctx_all_reduce(reduce_op, value, options)

    def _experimental_distribute_dataset(self, dataset, options):
        _common.check_not_empty(dataset)
        return _common.name_empty_input(self._distribute(dataset, options))

    def _distribute(self, dataset, options):
        """Worker w takes rows [w*n//W, (w+1)*n//W) of every global batch of n rows.

        Every worker sees the same number of batches, so no per-step cross-worker check for
        exhausted input is needed. Keras batches with the global batch size; the slices keep
        single-device order. Falls back to TensorFlow's sharding where slicing cannot apply.
        A dataset read from files is sharded by file instead (`_input_files`: each worker reads
        only its share of the files), unless it asks for AutoShardPolicy.DATA.
        """
        from tfstrat.strategies import _input_files

        by_file = _input_files.distribute(self, dataset, options)
        if by_file is not None:
            return by_file
        workers = self._num_workers
        specs = nest.flatten(dataset.element_spec)
        per_replica = options is not None and (
            options.experimental_replication_mode == distribute_lib.InputReplicationMode.PER_REPLICA
        )
        sliceable = all(isinstance(s, tf.TensorSpec) and s.shape.rank for s in specs)
        plain = _common.plain_input_options(self.worker_devices, options)
        if workers == 1 and plain is not None:  # one CPU device: a plain iterator on the host
            return input_util.get_distributed_dataset(
                dataset,
                self._input_workers_with_options(),
                self._container_strategy(),
                num_replicas_in_sync=1,
                input_context=self._make_input_context(),
                options=plain,
            )
        if workers == 1 or per_replica or len(self.worker_devices) != 1 or not sliceable:
            _log_once(
                "input",
                "tfstrat: input sharded by TensorFlow's auto-shard policy "
                "(rebatch + shard; a per-step check for exhausted input runs)",
            )
            return super()._experimental_distribute_dataset(dataset, options)
        _log_once("input", "tfstrat: input sharded by data: each worker slices every global batch")
        index, is_tuple = self._id_in_cluster, type(dataset.element_spec) is tuple

        def take(*args):
            element = args if is_tuple else args[0]
            n = tf.shape(nest.flatten(element)[0], out_type=tf.int64)[0]
            lo, hi = (index * n) // workers, ((index + 1) * n) // workers
            return nest.map_structure(lambda t: t[lo:hi], element)

        data_options = tf.data.Options()
        data_options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.OFF
        )
        sliced = dataset.map(take).with_options(data_options)
        saved = self.experimental_enable_get_next_as_optional
        self.experimental_enable_get_next_as_optional = False
        workers_ = self._input_workers_with_options(options)
        workers_._tfstrat_same_batches = True  # kept by its iterators' specs (`_same_batches`)
        _same_batches()
        try:  # num_replicas_in_sync=None: no rebatch
            return input_util.get_distributed_dataset(
                sliced,
                workers_,
                self._container_strategy(),
                num_replicas_in_sync=None,
                input_context=self._make_input_context(),
                options=plain or options,
            )
        finally:
            self.experimental_enable_get_next_as_optional = saved

    def _create_variable(self, next_creator, **kwargs):
        """A variable's initial value is broadcast from the chief as it is created; workers
        that build different models fail there, in TensorFlow's words. Say it in ours too."""
        try:
            return super()._create_variable(next_creator, **kwargs)
        except tf.errors.InvalidArgumentError as e:
            if "Shape mismatch" not in str(e):
                raise
            detail = str(e).split("Shape mismatch", 1)[1].split(". This is", 1)[0]
            raise AgreementError(
                f"tfstrat: worker {self._id_in_cluster} creating variable "
                f"{kwargs.get('name')!r}: another worker created a variable of another shape "
                f"at the same place (shape mismatch{detail}). Run the same model code on "
                "every task."
            ) from e

    def _reduce_to(self, reduce_op, value, destinations, options):
        if nest.is_nested(value):  # stock MWMS hands the whole structure to one collective
            return nest.map_structure(
                lambda v: self._reduce_to(reduce_op, v, destinations, options), value
            )
        return super()._reduce_to(reduce_op, value, destinations, options)


def _same_batches() -> None:
    """`get_next_as_optional` (Keras's loop of `steps_per_execution` > 1 calls it every step)
    asks every worker whether any still has data, in a TensorFlow all-reduce per step. Input
    that every worker slices from the same global batches (`_Extended._distribute`) runs out on
    every worker at once: for it, the count is this worker's own (no collective)."""
    if patches.is_patched(input_lib, "_calculate_replicas_with_values"):
        return
    everyone = input_lib._calculate_replicas_with_values

    def _calculate_replicas_with_values(strategy, input_workers, optional_list):
        if not getattr(input_workers, "_tfstrat_same_batches", False):
            return everyone(strategy, input_workers, optional_list)
        counts = []
        for worker, optionals in zip(input_workers.worker_devices, optional_list):
            with tf.device(worker):
                counts += [tf.cast(v.has_value(), tf.int64) for v in optionals]
        return tf.reduce_sum(counts)

    patches.patch(
        input_lib,
        "_calculate_replicas_with_values",
        _calculate_replicas_with_values,
        "input every worker slices alike runs out everywhere at once: no all-reduce a step",
    )


_logged: set[str] = set()


def _log_once(key: str, message: str):
    if key not in _logged:
        _logged.add(key)
        logger.info(message)


class CollectiveAllReduce(_common.AdoptsKerasOptimizers, tf.distribute.MultiWorkerMirroredStrategy):
    """Synchronous data parallelism with one process per worker, for Keras 3 `fit`.

    The cluster comes from `TF_CONFIG` (or `tf_config`); without one, the process trains alone.
    Dense gradients go out in one packed all-reduce per step (tfstrat's TCP ring on CPU
    workers with one device each, else TensorFlow's ring or NCCL); sparse gradients are
    deduplicated and all-gathered in one call, or densified above the `sparse_as_dense`
    threshold. Clipping set on the optimizer of a model that `fit` trains here
    applies to the all-reduced gradient, as in single-device training. NumPy inputs shuffled by
    Keras are shuffled alike on every worker (a shared TensorFlow seed, set if none is).

    Create it first in the program, before any other TensorFlow op, on every worker alike.

    Args:
        tf_config: the cluster; None reads the `TF_CONFIG` environment variable.
        devices: this worker's devices: None for every visible GPU, else one CPU; a count of
            logical CPU devices (split with `tfstrat.split_cpu(n)` first); or names
            (["/gpu:0"], ["/gpu:0", "/gpu:1"], ["/cpu:0", "/cpu:1"]).
        communication: "auto", "tcp", "ring" or "nccl". "tcp": dense gradients go over
            tfstrat's ring of TCP connections between the workers (two workers on one machine
            exchange the bytes through shared memory; a worker of several devices sums them
            first); "ring"/"nccl": TensorFlow's collectives. "auto"
            (`tfstrat.strategies.transport`): NCCL when every replica is a GPU (one or more per
            worker, 2+ in all), tcp on CPU-only workers, else TensorFlow's ring.
        pack_bytes: split dense gradients into packs of about this many bytes (overlaps
            communication with the backward pass); None sends them in one pack.
        sparse_as_dense: "auto", a fraction in (0, 1], True or False (`DensityPolicy`).
        timeout: seconds a step (or a collective outside one) may wait for a peer before
            failing with an error naming it: tfstrat's ring by its sockets' deadlines,
            TensorFlow's collectives by the process's watchdog thread (no per-op timeout,
            which would start a thread per op: `tfstrat.strategies._watchdog`).
        compression: None (exact), "fp16", "bf16", "powersgd" or `tfstrat.PowerSGD(rank=...)`:
            the step's dense gradients travel compressed between the workers, for slow links
            (`tfstrat.reduce.compression`). Lossy: training no longer equals one device's.
            Sparse gradients and the step's metric states stay exact. Needs the TCP ring and
            one device per worker.

    Environment:
        TF_CONFIG: the cluster and this task, as `tfstrat launch` or Kubeflow set it.

    Example:
        >>> # tfstrat launch --workers 2 -- python train.py, where train.py holds:
        >>> strategy = tfstrat.CollectiveAllReduce()  # doctest: +SKIP
        >>> with strategy.scope():  # doctest: +SKIP
        ...     model = build_model(); model.compile(optimizer="adam", loss="mse")
        >>> model.fit(x, y, batch_size=64)  # doctest: +SKIP
    """

    _extended_class = _Extended  # ModelParallel's across workers creates split variables

    def __init__(
        self,
        tf_config: TFConfig | None = None,
        *,
        devices: int | Sequence[str] | None = None,
        communication: str = "auto",
        pack_bytes: int | None = None,
        sparse_as_dense: str | float | bool = "auto",
        timeout: float | None = DEFAULT_TIMEOUT,
        compression: str | PowerSGD | None = None,
        _agree_on: dict | None = None,
    ):
        tf_config = tf_config if tf_config is not None else _env_config()
        if tf_config is not None:
            tf_config.require_task(type(self).__name__)
        resolver = tf_config.resolver() if tf_config else None
        if tf_config is not None and tf_config.addresses("ps"):
            raise UsageError(
                f"Received: a TF_CONFIG with ps tasks {list(tf_config.addresses('ps'))}. "
                "CollectiveAllReduce uses workers only; drop the ps tasks or use "
                "tfstrat.ParameterServer / tfstrat.Hybrid."
            )
        count = devices if isinstance(devices, int) or devices is None else len(devices)
        replicas, virtual = transport.replica_devices(devices)
        cpus = [d for d in replicas if "CPU:" in d]
        if len(cpus) > 1:
            _check_cpu_split(len(cpus))
        self._transport = transport.choose(
            communication, replicas, _workers(tf_config), _cuda_build(), virtual
        )
        # The replicas the transport was chosen for. Named whenever they are GPUs: stock would
        # ask TF_CONFIG's resolver, which counts no accelerators, and train on the CPU. (One
        # CPU: stock's own device, the worker's.)
        gpu = all("GPU:" in d for d in replicas)
        local = replicas if devices is not None or gpu else None
        tcp = self._uses_tcp_ring(communication, count, tf_config)
        compression = _compression.parse(compression)
        several = len(replicas) > 1
        if compression is not None and (not tcp or several) and _workers(tf_config) > 1:
            raise UsageError(
                f"Received: compression={_compression.describe(compression)!r} with "
                f"communication={communication!r} and {count or 1} device(s) per worker. "
                "Compressed gradients travel on tfstrat's TCP ring from one device per worker: "
                "use one device per worker and communication='tcp' (or 'auto' on CPU-only "
                "workers)."
            )
        implementation = _common.Impl[self._transport.implementation]
        # No timeout_seconds: TensorFlow would start a thread per collective op that sleeps
        # for the whole timeout. The process's watchdog bounds the waits (`_watchdog`).
        options = tf.distribute.experimental.CommunicationOptions(
            bytes_per_pack=pack_bytes or 0, implementation=implementation
        )
        self.density = DensityPolicy(sparse_as_dense)
        self.tf_config = tf_config
        import faulthandler

        faulthandler.enable()  # a worker that crashes (SIGSEGV) prints its Python stacks
        _seed_shuffles()
        reused = _reuse.enter(self, tf_config)  # raises for another TF_CONFIG
        from tfstrat.keras import _saving

        _saving.install()  # model.save on every worker: the chief writes
        with _startup.watchdog(tf_config, None if reused else timeout):
            # MWMS.__init__ hard-codes its extended class; this is its body with ours.
            try:
                distribute_lib.Strategy.__init__(
                    self,
                    self._extended_class(
                        self, resolver, options, local, self.density, timeout or DEFAULT_TIMEOUT
                    ),
                )
            except RuntimeError as e:
                if "at program startup" not in str(e):
                    raise
                raise RuntimeError(
                    f"tfstrat: {type(self).__name__} was created after this process had run "
                    "TensorFlow ops (TensorFlow: 'Collective ops must be configured at program "
                    "startup'). Create the strategy first, before building a model, a dataset, "
                    "a Keras optimizer or a tf.Variable: `strategy = tfstrat."
                    f"{type(self).__name__}(...)` (or `tfstrat.auto()`) at the top of the "
                    "script, then the model inside `with strategy.scope():`."
                ) from e
            _watchdog.WATCHDOG.configure(_task_name_of(tf_config), _peer_devices(tf_config))
            if not reused and _workers(tf_config) > 1:
                _agree_on_cluster(tf_config, timeout or DEFAULT_TIMEOUT)
            if tcp:
                t = timeout or DEFAULT_TIMEOUT
                ring_ = _reuse.ring(lambda: self._connect_ring(t), t)
                self.extended.use_ring(ring_, compression)
        self.timeout = timeout or DEFAULT_TIMEOUT  # waits on other tasks outside collectives
        self._stop = None
        # Models, not ids: a new model can reuse a collected one's id on one worker only.
        self._agreed_models = weakref.WeakSet()
        self._agreement_options = {
            "strategy": type(self).__name__,
            "communication": communication,
            "devices": count or 0,
            "pack_bytes": pack_bytes or 0,
            "sparse_as_dense": str(sparse_as_dense),
            "compression": _compression.describe(compression),
            **(_agree_on or {}),
        }
        if self.extended._num_workers > 1:
            _fit_scope.note_multi_worker(self)  # a fit outside its scope is warned about
            self._stop = _stopping.StopAgreement(self._epoch_sum, _task_name_of(tf_config))
            self._agree(_agreement.describe(tf_config, (), self._agreement_options))
        logger.info(
            "tfstrat: %s, worker %d of %d, %d replica(s) in sync, %s, timeout %s s",
            type(self).__name__,
            self.extended._id_in_cluster,
            self.extended._num_workers,
            self.num_replicas_in_sync,
            _ring_words(self.extended._cross_device_ops.ring)
            if tcp
            else f"{implementation.name.lower()} all-reduce ({self._transport.why})",
            timeout,
        )
        if compression is not None:
            logger.info(
                "tfstrat: compression=%s: %s",
                _compression.describe(compression),
                "the dense gradients travel compressed between the workers (lossy)"
                if tcp
                else "no effect with one worker (nothing travels)",
            )
        if tf_config is None:  # e.g. `python train.py` where `tfstrat launch` was meant
            logger.info(
                "tfstrat: no TF_CONFIG, so this process is the only worker; for more, run it "
                "under `tfstrat launch --workers N -- python ...` (or set TF_CONFIG per task)"
            )

    def _uses_tcp_ring(self, communication: str, count: int | None, tf_config) -> bool:
        return self._transport.kind == "tcp"

    def _connect_ring(self, timeout: float) -> ring.Ring:
        """Every worker listens on its tfstrat port (TF_CONFIG port + 1) at its own address
        towards the other workers (its ring neighbours first, a non-loopback one preferred);
        one all-gather tells the others that address."""
        # Ranks as TensorFlow's: the chief first, then the workers.
        tasks = [
            (f"/job:{job}/replica:0/task:{i}", address)
            for job in ("chief", "worker")
            for i, address in enumerate(self.tf_config.addresses(job))
        ]
        rank, size = self.extended._id_in_cluster, len(tasks)
        mine = tasks[rank][1]
        # Towards the neighbours first, then any other task (a neighbour on this machine, named
        # by a name this host maps to 127.0.1.1, would give loopback: the first worker of the
        # next host's ring, and the two levels' and recursive doubling's partners, connect too).
        others = [tasks[(rank + 1) % size][1], tasks[(rank - 1) % size][1]]
        others += [address for i, (_, address) in enumerate(tasks) if i != rank]
        host = _ports.route_source(others) or _ports.wildcard(_ports.split(mine)[0])
        port, task = _ports.tfstrat_port(mine), _task_name_of(self.tf_config)
        try:
            listener = ring.listen(host, port, task)
        except ListenError as e:
            if not e.in_use:
                raise
            # Another socket holds P + 1 (an outgoing connection's ephemeral port, under a
            # launcher that picked P free but could not reserve P + 1, as Ray does). The peers
            # learn the ring's port from the all-gather below, so any free port serves.
            listener = ring.listen(host, 0, task)
            logger.warning(
                "tfstrat: %s: its ring port %s (TF_CONFIG port + %d) is in use, so the ring "
                "listens on %s instead; a firewall that opens only P and P + %d between the "
                "tasks blocks it (free port %s on this host, or set %s).",
                task,
                port,
                _ports.offset(),
                listener.getsockname()[1],
                _ports.offset(),
                port,
                _ports.PORT_OFFSET_ENV,
            )
            port = listener.getsockname()[1]
        # Advertise the bound address; when bound to all interfaces, the TF_CONFIG host.
        advertised = host if host not in ("0.0.0.0", "::") else _ports.split(mine)[0]
        gather = lambda: self.run(lambda: _gather_address(rank, advertised, port))  # noqa: E731
        gathered = tf.function(gather, autograph=False)()
        rows = self.experimental_local_results(gathered)[0].numpy()
        by_rank = {row[0]: row for row in rows.tolist()}  # one row per device: one per rank
        addresses = [_address_of(by_rank[r]) for r in sorted(by_rank)]
        names = [name for name, _ in tasks]
        return ring.Ring(rank, addresses, listener, timeout, names)

    # -- agreement: every worker runs the same cluster, options and model ------------------

    def _all_gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every worker's `payload`, by rank (eager; tfstrat's ring, else TF's collectives)."""
        ring_ = self.extended._cross_device_ops.ring
        if ring_ is not None:
            lengths = ring_.all_gather(np.array([[len(payload)]], np.int64))[:, 0]
            padded = np.zeros((1, int(lengths.max())), np.uint8)
            padded[0, : len(payload)] = np.frombuffer(payload, np.uint8)
            rows = ring_.all_gather(padded)
        else:
            gather = lambda t: self.experimental_local_results(  # noqa: E731
                self._traced("all_gather", _all_gather)(t)
            )[0].numpy()
            local = len(self.extended.worker_devices)
            lengths = gather(tf.constant([[len(payload)]], tf.int32))[::local, 0]
            padded = np.zeros((1, int(lengths.max())), np.int32)
            padded[0, : len(payload)] = np.frombuffer(payload, np.uint8)
            rows = gather(tf.constant(padded))[::local]
        return [bytes(r[:n].astype(np.uint8)) for r, n in zip(rows, lengths)]

    def _agree(self, desc: dict) -> None:
        """Fails every worker alike, naming the first difference from the chief's (rank 0)."""
        import json

        tasks = [
            f"{job}:{i}"
            for job in ("chief", "worker")
            for i in range(len(self.tf_config.addresses(job)))
        ]
        if len(tasks) > 1:
            tasks[0] += " (the chief)"
        everyone = [json.loads(b) for b in self._all_gather_bytes(json.dumps(desc).encode())]
        for rank, theirs in enumerate(everyone):
            diff = _agreement.first_difference(theirs, everyone[0], tasks[rank], tasks[0])
            if diff:
                raise AgreementError(f"tfstrat: {diff}")

    def _agree_on_model(self, model) -> None:
        """Before a model's first step: its variables (name, shape, dtype, in order)."""
        if self._stop is None or model in self._agreed_models:
            return
        self._agreed_models.add(model)
        self._agree(_agreement.describe(self.tf_config, model.weights, self._agreement_options))

    def run(self, fn, args=(), kwargs=None, options=None):
        model = getattr(fn, "__self__", None)
        ring_ = self.extended._cross_device_ops.ring
        if getattr(fn, "__name__", "") == "train_step" and hasattr(model, "weights"):
            if ring_ is not None:  # plain Python sockets: fine while the step is traced
                self._agree_on_model(model)
            elif self._stop is not None:  # TF's collectives run eagerly before step 2
                self._stop.before_next_step = lambda: self._agree_on_model(model)
        return super().run(fn, args=args, kwargs=kwargs, options=options)

    def _epoch_sum(self, values):
        """Eager sum of a small float32 array over every worker (the stop agreement's)."""
        ring_ = self.extended._cross_device_ops.ring
        if ring_ is not None:
            return ring_.all_reduce(values)
        return self._traced("sum", _sum)(tf.constant(values)).numpy()

    def _traced(self, name: str, fn):
        """`fn(strategy, tensor)` as a function traced once per shape: eager collectives on
        several devices run op by op, and TensorFlow warns that they are slow."""
        functions = self.__dict__.setdefault("_tfstrat_functions", {})
        if name not in functions:
            functions[name] = tf.function(lambda t: fn(self, t), reduce_retracing=True)
        return functions[name]

    @property
    def num_workers(self) -> int:
        return self.extended._num_workers

    @property
    def worker_index(self) -> int:
        return self.extended._id_in_cluster

    # -- the savers' coordination (`tfstrat.keras._saving.Coordinated`) ----------------------

    def _tfstrat_publish(self, key: str, outcome: dict) -> None:
        # TensorFlow's coordination service: every chief and worker joined it at start-up.
        context.context().set_config_key_value(key, json.dumps(outcome))

    def _tfstrat_read_chief(self, key: str, names: list[str]) -> dict:
        value = context.context().get_config_key_value(key, int(self.timeout * 1000))
        return json.loads(value)

    def reduce(self, reduce_op, value, axis=None):
        op = tf.distribute.ReduceOp(reduce_op.upper()) if isinstance(reduce_op, str) else reduce_op
        local = lambda v: self.experimental_local_results(v)  # noqa: E731
        if nest.is_nested(value) and op == _MEAN and axis is None:
            # Keras's symbolic build reduces a data batch only for its shapes; a collective
            # would fail on unequal local batches (and turn int ids into floats).
            return nest.map_structure(lambda v: local(v)[0], value)
        components = value.values if isinstance(value, _values.DistributedValues) else (value,)
        if axis is not None and all(getattr(c, "shape", None) == () for c in components):
            # Keras reduces scalar per-step logs with axis=0, which stock TF rejects
            # (keras#20585). Per-step logs stay local (no collective per step); epoch and
            # evaluate results come from metric variables summed over all workers.
            values = local(value)
            return values[0] if len(values) == 1 else tf.reduce_mean(tf.stack(values))
        return super().reduce(op, value, axis)


def _all_gather(strategy, t):
    """Every replica's `t`, concatenated on axis 0 (in a function)."""
    gather = lambda t: tf.distribute.get_replica_context().all_gather(tf.identity(t), 0)  # noqa: E731
    return strategy.run(gather, args=(t,))


def _sum(strategy, t):
    """The sum of `t` over every replica (in a function)."""
    return strategy.reduce(_SUM, strategy.run(tf.identity, args=(t,)), axis=None)


def _env_config() -> TFConfig | None:
    """The cluster of `TF_CONFIG`; None when it is unset (this process trains alone)."""
    import os

    if "TF_CONFIG" not in os.environ:
        return None
    if not os.environ["TF_CONFIG"].strip():
        from tfstrat.cluster import TFConfigError

        raise TFConfigError(
            "Received: TF_CONFIG='' (set but empty). Unset it to train in one process "
            "(`unset TF_CONFIG`), or set the cluster (`tfstrat tf-config --export`, or "
            "`tfstrat launch`, which sets it for every task)."
        )
    return TFConfig.from_env()


def _agree_on_cluster(tf_config: TFConfig, timeout: float) -> None:
    """Before the first collective, through TensorFlow's coordination service (every chief
    and worker joined it at start-up): each task publishes its TF_CONFIG cluster; the chief
    (rank 0) compares every task's with its own, each other task the chief's with its own.

    Without it, tasks given clusters of different sizes start (the coordination service
    knows tasks by name) and fail in their first collective with TensorFlow's "Device ...
    is joining a group with size 3, but that group has size 2"; different addresses for a
    task fail later, in a connect.

    Each task also publishes the UUIDs of the GPUs it sees (`gpus.uuids`): two tasks on one
    card are refused by name here, not by NCCL in the first step ("Duplicate GPU detected")
    or by the second process running out of the memory the first took.
    """
    tasks = [
        f"{job}:{i}" for job in ("chief", "worker") for i in range(len(tf_config.addresses(job)))
    ]
    me, chief = tf_config.task_name, tasks[0]
    mine = _agreement.describe(tf_config)
    ctx = context.context()
    ms = int(timeout * 1000)
    cards = gpus.uuids()
    ctx.set_config_key_value(f"tfstrat/cluster/{me}", json.dumps({"cluster": mine, "gpus": cards}))
    seen = {}
    for other in tasks[1:] if me == chief else [chief]:
        key = f"tfstrat/cluster/{other}"
        seen[other] = json.loads(_published(ctx, key, ms, me, other, "its TF_CONFIG cluster"))
        named = lambda t: f"{t} (the chief)" if t == chief else t  # noqa: E731
        diff = _agreement.first_difference(seen[other]["cluster"], mine, named(other), named(me))
        if diff:
            raise AgreementError(f"tfstrat: {diff}")
    # Tasks that see one GPU between them: the chief compares every task's cards (UUIDs are
    # unique to a card, whichever machine), publishes its finding, and every task refuses.
    if me == chief:
        refusal = gpus.sharing({me: cards, **{t: r["gpus"] for t, r in seen.items()}})
        ctx.set_config_key_value("tfstrat/gpus-shared", json.dumps(refusal))
    else:
        refusal = json.loads(
            _published(ctx, "tfstrat/gpus-shared", ms, me, chief, "the tasks' GPUs it compared")
        )
    if refusal:
        raise UsageError(f"tfstrat: {me}: {refusal}")


def _published(ctx, key: str, ms: int, me: str, other: str, what: str) -> str:
    try:
        return ctx.get_config_key_value(key, ms)
    except tf.errors.OpError as e:
        raise AgreementError(
            f"tfstrat: {me}: {other} did not publish {what} within "
            f"{ms / 1000:g} s after start-up ({type(e).__name__}: {e.message.splitlines()[0]}). "
            "Run the same program on every task; raise `timeout=` if it starts slowly."
        ) from e


def _peer_devices(tf_config: TFConfig | None) -> list[tuple[str, str]]:
    """(name, device prefix) of every other chief and worker task: the collectives' peers."""
    if tf_config is None:
        return []
    named = [name.split(":") for name, _ in _startup.peers(tf_config)]
    return [(f"{job}:{i}", f"/job:{job}/replica:0/task:{i}") for job, i in named]


def _task_name_of(tf_config: TFConfig | None) -> str:
    return (tf_config and tf_config.task_name) or "this worker"


def _ring_words(ring_) -> str:
    if ring_ is not None and ring_.transport == "shared memory":
        return "tcp ring (dense; shared memory with the other worker), TensorFlow ring (the rest)"
    if ring_ is not None and ring_.levels is not None:
        local = ring_.levels[0]
        within = local.transport if local else "alone on its host"
        return (
            f"tcp ring (dense: within this host first ({within}), then one worker a host "
            "across the hosts), TensorFlow ring (the rest)"
        )
    return "tcp ring (dense), TensorFlow ring (the rest)"


def _workers(tf_config: TFConfig | None) -> int:
    if tf_config is None:
        return 1
    return len(tf_config.addresses("chief")) + len(tf_config.addresses("worker"))


def _check_cpu_split(count: int):
    cpu = tf.config.list_physical_devices("CPU")[0]
    have = len(tf.config.get_logical_device_configuration(cpu) or [None])
    if have < count:
        raise UsageError(
            f"Received: devices={count} with the CPU split into {have} logical device(s). "
            f"Call tfstrat.split_cpu({count}) before creating the strategy."
        )


def _cuda_build() -> bool:
    return bool(tf.sysconfig.get_build_info().get("is_cuda_build", False))


def _seed_shuffles():
    """Keras shuffles NumPy inputs with an unseeded op: a shared global seed makes every worker
    draw the same permutation, so slicing never repeats or drops an example; the order of each
    epoch comes from (seed, epoch), so epochs differ and a resumed run replays them."""
    from tfstrat.keras import _shuffle

    _shuffle.seed_shuffles()


def _gather_address(rank: int, host: str, port: int):
    """All-gathers (rank, port, address) rows: [rank, port, n, 16 address bytes as 4 ints].
    A host name (when bound to all interfaces) is resolved here to the address peers use."""
    try:
        packed = socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
    except OSError:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        family, address = info[0], info[4][0].split("%", 1)[0]
        packed = socket.inet_pton(family, address)
    words = np.frombuffer(packed.ljust(16, b"\0"), ">i4").astype(np.int32)
    row = tf.constant([[rank, port, len(packed), *words.tolist()]], tf.int32)
    return tf.distribute.get_replica_context().all_gather(row, 0)


def _address_of(row: list[int]) -> str:
    n = row[2]
    packed = np.array(row[3:7], np.int32).astype(">i4").tobytes()[:n]
    family = socket.AF_INET if n == 4 else socket.AF_INET6
    return _ports.join(socket.inet_ntop(family, packed), row[1])
