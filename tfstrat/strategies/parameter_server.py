"""`ParameterServer`: variables on ps tasks, each worker its own `fit` (between-graph replication).

Keras 3 has no parameter-server path (its `fit` refuses ParameterServerStrategy's datasets). This strategy brings back TF1's:
each worker process connects its eager context to the ps tasks (fact 4) and trains with plain
`model.fit`; every variable created in the scope lives on a ps task, shared by all workers by
name. The strategy is a one-replica strategy per worker: the forward and backward pass run on
the worker, reads and optimizer updates run on the ps that holds each variable.

- `mode="async"`: every worker applies its own gradient (the mean over its own rows) as soon
  as it has it: per worker, so slices of unequal rows are not weighted against each other.
- `mode="sync"`: each step takes the gradients of `replicas_to_aggregate` workers, weighs each
  by its rows (the mean over the rows of those workers: with every worker, one device's
  gradient of the global batch however it splits) and applies them once (`tfstrat.ps.sync`);
  later gradients of that step are dropped and counted.

Metrics and Keras's random-seed state stay on the worker: `fit`'s logs are per worker. Custom
training loops (docs/custom-loops.md): under sync each worker is a replica; `reduce`, `gather`
and a metric read outside a step go across the workers through ps 0 (`steps_exchange`).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import weakref

import tensorflow as tf

from tfstrat import runtime
from tfstrat._compat.tf import distribute_lib, nest, one_device_strategy
from tfstrat._compat.tf import values as distributed_values
from tfstrat.cluster import TFConfig
from tfstrat.errors import AgreementError, UsageError
from tfstrat.keras import _fit_scope
from tfstrat.keras._shuffle import seed_shuffles
from tfstrat.launcher import gpus
from tfstrat.ps import steps
from tfstrat.ps import variables as psvars
from tfstrat.ps.connect import Heartbeat, connect
from tfstrat.ps.sync import SyncReplicas
from tfstrat.ps.tables import rpc_address
from tfstrat.reduce.sparse import dedup, scale
from tfstrat.strategies import _compute, _custom_loops, _exact_step, _reuse, _stopping
from tfstrat.strategies import agreement as _agreement

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 300.0
DEFAULT_PARTITION_BYTES = 4 << 20
_SLICED_STEPS = ("train_step", "test_step")


def _stays_local(kwargs) -> bool:
    """Metric accumulators and Keras's seed state are per worker."""
    name = kwargs.get("name") or ""
    return kwargs.get("synchronization") == tf.VariableSynchronization.ON_READ or name.startswith(
        "seed_generator_state"
    )


class _Extended(one_device_strategy.OneDeviceExtended):
    def __init__(self, container, device, *, tf_config, worker, timeout):
        super().__init__(container, device)
        self.tf_config = tf_config
        self.worker = worker
        self.is_chief = tf_config.is_chief
        self.timeout = timeout
        self.num_ps = len(tf_config.addresses("ps"))
        self.placement = psvars.Placement(self.num_ps)
        self._created = 0
        self._prefix = _reuse.ps_prefix()  # a second strategy's own ps variables
        self.group = int(self._prefix.strip("g/") or 0)  # and its own sync state on ps 0
        # Variables whose ps resource has another shape than declared: reported to every
        # task by the agreement before the first step (raising here would leave the others
        # waiting for this task until their timeout).
        self.problems: list[str] = []

    # -- variables ------------------------------------------------------------------------

    def shared(self, name, shape, dtype, device, *, initial_value=None, owner=None):
        """A variable shared by every worker; the chief initialises it (or `owner`, if given)."""
        var = psvars.shared_variable(
            self._prefix + name, shape, dtype, device, strategy=self._container_strategy()
        )
        if initial_value is None:
            return var
        self._initialise(
            var, initial_value, self.is_chief if owner is None else owner == self.worker
        )
        return var

    def _initialise(self, var, initial_value, here: bool, label: str = ""):
        """Initialises `var` on its ps (here) or waits until the chief has."""
        if not here:
            psvars.wait_initialized(var, self.timeout, "the chief")
            return self._check_resource(var, label)
        if psvars.is_initialized(var):  # a restarted chief keeps the ps's values
            return self._check_resource(var, label)
        with tf.device(var.device):
            value = initial_value() if callable(initial_value) else initial_value
            var.assign(tf.cast(value, var.dtype), read_value=False)

    def _check_resource(self, var, label: str):
        """Records a ps resource whose shape is not the declared one (TensorFlow does not check it)."""
        if not var.shape.is_fully_defined():
            return
        held = psvars.resource_shape(var)
        if held == var.shape:
            return
        index = psvars.ps_index_of(var)
        problem = (
            f"{self.tf_config.trainer_name()} declares variable {label or var._shared_name!r} "
            f"(shared as {var._shared_name}) of shape {tuple(var.shape)}, but ps:{index} at "
            f"{self.tf_config.addresses('ps')[index]} holds it with shape {tuple(held)}. The "
            "tasks build different models, or the ps tasks kept an earlier run's variables "
            "(restart them)."
        )
        logger.warning("tfstrat: %s", problem)
        self.problems.append(problem)

    def _create_variable(self, next_creator, **kwargs):
        colocate_with = kwargs.pop("colocate_with", None)
        if _stays_local(kwargs):
            with tf.device(self._device):
                var = next_creator(**kwargs)
            return self._summed_on_read(var, kwargs)
        initial_value = kwargs["initial_value"]
        dtype = kwargs.get("dtype")
        if dtype is None:
            probe = initial_value() if callable(initial_value) else initial_value
            dtype = tf.convert_to_tensor(probe).dtype
        dtype = tf.as_dtype(dtype)
        shape = psvars.static_shape(initial_value, kwargs.get("shape"))
        name = kwargs.get("name") or "Variable"
        self._created += 1
        shared_name = f"{self._prefix}{self._created:05d}_{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}"
        if colocate_with is not None:
            index = psvars.ps_index_of(colocate_with)
        else:
            index = getattr(psvars._pin, "index", None)
        nbytes = shape.num_elements() * dtype.size
        index = self.placement.choose(shared_name, nbytes, index)
        device = psvars.ps_device(index)
        var = psvars.shared_variable(
            shared_name,
            shape,
            dtype,
            device,
            strategy=self._container_strategy(),
            trainable=kwargs.get("trainable", True),
            name=name,
            aggregation=kwargs.get("aggregation") or tf.VariableAggregation.NONE,
        )
        self._initialise(var, initial_value, self.is_chief, label=name)
        return var

    replicas = 1  # the workers, in sync mode (`ParameterServer.__init__`)

    @property
    def _num_replicas_in_sync(self):
        # Sync: one replica per worker, as tf.distribute counts them (Keras divides a step's
        # loss by it, undone in the push; a custom loop's `compute_average_loss` and
        # InputContext use it). Async: 1, each worker's step its own, as in tf.distribute's
        # ParameterServerStrategy.
        return self.replicas

    def _summed_on_read(self, var, kwargs):
        """A metric's state variable (sync): summed (or averaged) over the workers when read
        outside a step, as tf.distribute's on-read variables sum their replicas
        (`ParameterServer.reduce`, through ps 0); inside a step, this worker's own."""
        aggregation = kwargs.get("aggregation")
        sums = (tf.VariableAggregation.SUM, tf.VariableAggregation.MEAN)
        if self.replicas == 1 or aggregation not in sums:
            return var
        return distributed_values.SyncOnReadVariable(
            self._container_strategy(), (var,), aggregation
        )

    def _validate_colocate_with_variable(self, colocate_with_variable):
        pass  # any variable: slots follow their variable to its ps task

    def _update(self, var, fn, args, kwargs, group):
        # The optimizer's arithmetic runs where the variable lives: on its ps task.
        with tf.device(var.device), distribute_lib.UpdateContext(var.device):
            result = fn(var, *args, **kwargs)
            return result if group else nest.map_structure(self._local_results, result)

    @property
    def should_checkpoint(self):
        return self.is_chief

    @property
    def should_save_summary(self):
        return self.is_chief


class ParameterServer(distribute_lib.Strategy):
    """Variables on ps tasks, one `fit` per worker: synchronous (with backups) or asynchronous.

    Run it with `tfstrat launch --workers N --ps M -- python train.py` (or any launcher that
    sets `TF_CONFIG`). In a ps task, creating the strategy serves that ps and exits the
    process when the workers are done, so one script can serve every role.

    Args:
        tf_config: the cluster; None reads `TF_CONFIG`. It must hold at least one ps task.
        mode: "sync" (each step averages `replicas_to_aggregate` workers' gradients and applies
            them once) or "async" (each worker's update is applied as it comes).
        replicas_to_aggregate: gradients per synchronous step; default all workers. Fewer
            makes the slowest workers backups whose late gradients are dropped (`dropped`).
        partitions: "auto" splits `tfstrat.keras.layers.Embedding` tables of at least
            `partition_bytes` across every ps task; an integer forces that many parts for
            every such table; 1 never splits.
        partition_bytes: the size from which "auto" splits a table.
        timeout: seconds any wait (for a ps, the chief, a step, gradients) may take before it
            fails with an error naming what it waited for.

    Input: the dataset given to `fit` / `evaluate` carries the global batch; worker w trains
    on rows [w*n//W, (w+1)*n//W) of each batch of n rows. `predict` runs whole batches on
    every worker. `fit`'s logs are per worker (computed on that worker's rows); under sync a
    metric read outside a step (`metric.result()` after a custom loop) sums every worker's.
    """

    def __init__(
        self,
        tf_config: TFConfig | None = None,
        *,
        mode: str = "sync",
        replicas_to_aggregate: int | None = None,
        partitions: str | int = "auto",
        partition_bytes: int = DEFAULT_PARTITION_BYTES,
        timeout: float = DEFAULT_TIMEOUT,
    ):
        runtime.apply()  # tfstrat's process settings, before TensorFlow creates its devices
        tf_config = tf_config if tf_config is not None else _env_config()
        _check_config(tf_config, mode, partitions)
        if tf_config.task_type == "ps":
            from tfstrat.ps.server import serve_until_workers_exit

            serve_until_workers_exit(tf_config)  # does not return
        workers = tf_config.num_workers
        required = workers if replicas_to_aggregate is None else int(replicas_to_aggregate)
        if not 1 <= required <= workers:
            raise UsageError(
                f"Received: replicas_to_aggregate={replicas_to_aggregate} with {workers} "
                f"worker(s). Use a number from 1 to {workers}, or None for all."
            )
        worker = _worker_index(tf_config)
        seed_shuffles()  # workers slice the same global batches: they must shuffle alike
        from tfstrat.keras import _saving

        _saving.install()  # model.save on every worker: the chief writes
        device = connect(tf_config, timeout)
        self._heartbeat = Heartbeat(tf_config, timeout).start()
        super().__init__(
            _Extended(self, device, tf_config=tf_config, worker=worker, timeout=timeout)
        )
        self.mode = mode
        if mode == "sync":
            self.extended.replicas = workers
        _custom_loops.install()
        _mark_keras_input()
        self._tfstrat_builds_eagerly = True
        self.partitions = partitions
        self.partition_bytes = partition_bytes
        self._options = dict(
            mode=mode,
            replicas_to_aggregate=required,
            partitions=partitions,
            partition_bytes=partition_bytes,
        )
        client = steps.Client(
            rpc_address(tf_config.addresses("ps")[0]),
            timeout,
            device,
            group=self.extended.group,
            worker=worker,
        )
        self._steps = client  # also `reduce` and `gather` across workers
        # A new run on ps 0 (it may have outlived an earlier run's workers): the earlier
        # run's step state is dropped, and what this run publishes there is keyed by its id.
        names = [tf_config.trainer_name(w) for w in range(workers)]
        self._run = client.start_run(workers, names).hex()
        # Before any variable: tasks with other clusters would place variables elsewhere and
        # wait for each other's variables until their timeouts.
        self._agree("cluster", _agreement.describe(tf_config, (), self._options), "cluster")
        if workers > 1:
            _fit_scope.note_multi_worker(self)  # a fit outside its scope is warned about
        self.sync = None
        if mode == "sync":
            self.sync = SyncReplicas(
                self,
                num_workers=workers,
                worker=worker,
                replicas_to_aggregate=required,
                steps=client,
            )
        # SIGTERM and a callback's stop_training: under sync, a request rides the worker's
        # mail and every worker stops after the step whose mails carried it; under async, each
        # worker stops after its own next step (its steps wait for no one).
        task = f"{tf_config.task_type}:{tf_config.task_index}"
        self._stop = _stopping.StopAgreement(lambda asked: asked, task)
        self._adopted: set[int] = set()
        # Models, not ids: a new model can reuse a collected one's id on one task only.
        self._agreed = weakref.WeakSet()
        self._warned: set[str] = set()
        self._input_rows: int | None = None  # first batch of the latest distributed dataset
        logger.info(
            "tfstrat: ParameterServer (%s%s), worker %d of %d, %d ps task(s), computing on %s, "
            "timeout %g s",
            mode,
            f", {required} of {workers} per step" if mode == "sync" else "",
            worker,
            workers,
            self.extended.num_ps,
            device.rsplit("/", 1)[-1],
            timeout,
        )

    # -- cluster ----------------------------------------------------------------------------

    @property
    def num_workers(self) -> int:
        return self.extended.tf_config.num_workers

    @property
    def worker_index(self) -> int:
        return self.extended.worker

    @property
    def tf_config(self) -> TFConfig:
        return self.extended.tf_config

    @property
    def timeout(self) -> float:
        return self.extended.timeout

    # -- the savers' coordination (`tfstrat.keras._saving.Coordinated`), through ps 0 -------

    def _tfstrat_publish(self, key: str, outcome: dict) -> None:
        psvars.publish(f"{self._run}/{key}", 0, outcome, self)

    def _tfstrat_read_chief(self, key: str, names: list[str]) -> dict:
        where = f"ps:0 at {self.tf_config.addresses('ps')[0]}"
        for _, theirs in psvars.read_published(
            f"{self._run}/{key}", [0], self.timeout, lambda w: names[w], where, "save outcome", self
        ):
            return theirs
        raise AssertionError("unreachable: read_published yields or raises")

    @property
    def dropped(self) -> int:
        """Stale gradients of this worker that no step applied (sync with backup workers)."""
        return self.sync.dropped if self.sync else 0

    def placement_summary(self) -> str:
        return self.extended.placement.summary()

    def table_layout(self, name: str, rows: int, nbytes: int) -> list[int | None]:
        """The ps task of each part of an embedding table (`tfstrat.keras.layers.Embedding`)."""
        num_ps = self.extended.num_ps
        if self.partitions == "auto":
            parts = num_ps if nbytes >= self.partition_bytes else 1
        else:
            parts = int(self.partitions)
        parts = max(1, min(parts, rows))
        if parts == 1:
            return [None]
        first = int(min(range(num_ps), key=lambda i: self.extended.placement.bytes[i]))
        layout = [(first + k) % num_ps for k in range(parts)]
        logger.info("tfstrat: table %s split into %d parts on ps %s", name, parts, layout)
        return layout

    # -- steps --------------------------------------------------------------------------------

    def run(self, fn, args=(), kwargs=None, options=None):
        model = getattr(fn, "__self__", None)
        step = getattr(fn, "__name__", "")
        if model is None:  # a custom loop's step: its input is this worker's rows already
            if self.sync is not None:
                inner_fn = fn

                def fn(*a, **k):  # reads the global step before any variable (`tfstrat.ps.sync`)
                    with tf.control_dependencies([self.sync.begin_step()]):
                        return inner_fn(*a, **k)

            return super().run(fn, args=args, kwargs=kwargs, options=options)
        with tf.init_scope():  # the checks talk to the ps: eagerly, while Keras traces
            self._check_model(model, step)
        self._adopt(model)
        if step in _SLICED_STEPS and self.num_workers > 1:
            self._check_rows(_static_rows(args))
            self._guard_rows(model, step)
            # On the host, where Keras's input stays (`experimental_distribute_dataset`):
            # only this worker's rows reach its GPU.
            with tf.device(self.extended._input_device), tf.name_scope("tfstrat_worker_rows"):
                args = self._slice(args)
        if step == "train_step" and model is not None:
            self._stop.attach(model)
        if self.sync is not None and step == "train_step":
            inner = fn
            _exact_step._watch_keras_scaling()

            def fn(*a, **k):
                # The worker's rows, for the rows weighting of its gradient (`push`), and
                # whether Keras computed the mean loss they weigh (`_exact_step._step`).
                state = _exact_step._step
                state.rows, state.scaled = _compute.rows_of((a, k)), False
                try:
                    with tf.control_dependencies([self.sync.begin_step()]):
                        return inner(*a, **k)
                finally:
                    state.rows, state.scaled = None, False

        return super().run(fn, args=args, kwargs=kwargs, options=options)

    def _slice(self, args):
        w, n_workers = self.worker_index, self.num_workers
        flat = [t for t in nest.flatten(args) if isinstance(t, tf.Tensor) and t.shape.rank]
        if not flat:
            return args
        n = tf.shape(flat[0], out_type=tf.int64)[0]
        lo, hi = (w * n) // n_workers, ((w + 1) * n) // n_workers

        def take(t):
            return t[lo:hi] if isinstance(t, tf.Tensor) and t.shape.rank else t

        return nest.map_structure(take, args)

    # -- agreement ------------------------------------------------------------------------

    def _agree(self, key: str, desc: dict, what: str) -> None:
        """Publishes this task's description on ps 0 and compares every task's with the
        chief's; any difference (or a problem a task recorded) fails every task alike."""
        ext, n = self.extended, self.num_workers
        names = [ext.tf_config.trainer_name(w) for w in range(n)]
        mine = {"description": desc, "problems": list(ext.problems), "gpus": gpus.uuids()}
        psvars.publish(f"{self._run}/agree/{key}", ext.worker, mine, self)
        seen = {ext.worker: mine}
        others = [w for w in range(n) if w != ext.worker]
        where = f"ps:0 at {ext.tf_config.addresses('ps')[0]}"
        for w, theirs in psvars.read_published(
            f"{self._run}/agree/{key}", others, ext.timeout, lambda w: names[w], where, what, self
        ):
            seen[w] = theirs
            if 0 not in seen:
                continue  # the chief's description is the reference
            for v in sorted(seen):
                diff = _agreement.first_difference(
                    seen[v]["description"], seen[0]["description"], names[v], names[0]
                )
                if diff:
                    raise AgreementError(f"tfstrat: {diff}")
            for v in sorted(seen):  # same descriptions, but a ps held other shapes
                if seen[v]["problems"]:
                    raise AgreementError(f"tfstrat: {seen[v]['problems'][0]}")
        # Every task has every task's record: two on one GPU are refused by each of them.
        refusal = gpus.sharing({names[v]: seen[v]["gpus"] for v in sorted(seen)})
        if refusal:
            raise UsageError(f"tfstrat: {names[ext.worker]}: {refusal}")

    def _check_model(self, model, step: str) -> None:
        """Before a model's first training step, every task agrees on its variables."""
        if step != "train_step" or model in self._agreed:
            if self.extended.problems:  # evaluate or predict only: nobody else to tell
                raise AgreementError(f"tfstrat: {self.extended.problems[0]}")
            return
        self._agreed.add(model)
        held = [w.value for w in model.weights if psvars.ps_index_of(w.value) is not None]
        if not held:
            return
        desc = _agreement.describe(self.extended.tf_config, model.weights, self._options)
        # Keyed by the model's first shared variable: the same model on every task.
        self._agree(f"model/{held[0]._shared_name}", desc, f"description of model {model.name!r}")

    # -- input ----------------------------------------------------------------------------

    def experimental_distribute_dataset(self, dataset, options=None):
        """Keras's input (each fit, evaluate and predict): whole global batches, sliced in the
        step (`run`), where `train_on_batch` input is sliced too. A custom loop's: worker w's
        rows [w*n//W, (w+1)*n//W) of each global batch of n rows, sliced here.

        With several workers Keras's batches stay on the host (not fetched to the worker's
        GPU): the step slices them there, so each worker copies its rows to its GPU, not the
        whole global batch (W times its share)."""
        self._input_rows = _first_batch_rows(dataset)
        self._refuse_file_sharding(dataset)
        if self.num_workers == 1:
            return super().experimental_distribute_dataset(dataset, options)
        if getattr(_keras_input, "active", False):
            return super().experimental_distribute_dataset(dataset, _on_host(options))
        self._check_rows(None)
        return super().experimental_distribute_dataset(self._sliced(dataset), options)

    def _sliced(self, dataset):
        """This worker's rows of each element (`_slice`, as the step slices Keras's input)."""
        whole = isinstance(dataset.element_spec, tuple)
        return dataset.map(lambda *element: self._slice(element if whole else element[0]))

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """`dataset_fn` gets this worker's InputContext: one input pipeline per worker, and
        (sync) the workers counted as replicas, so `get_per_replica_batch_size` is its share."""
        context = tf.distribute.InputContext(
            num_input_pipelines=self.num_workers,
            input_pipeline_id=self.worker_index,
            num_replicas_in_sync=self.num_replicas_in_sync,
        )
        dataset = dataset_fn(context)
        return super().distribute_datasets_from_function(lambda _: dataset, options)

    def _refuse_file_sharding(self, dataset) -> None:
        """Every worker reads the whole dataset and takes its slice of each global batch; an
        explicit AutoShardPolicy.FILE would otherwise be ignored without a word."""
        policy = dataset.options().experimental_distribute.auto_shard_policy
        if self.num_workers < 2 or policy != tf.data.experimental.AutoShardPolicy.FILE:
            return
        raise UsageError(
            "Received: a dataset with auto_shard_policy=FILE under ParameterServer. "
            "ParameterServer gives every worker the whole dataset and slices each global batch "
            "(reading by file is not supported under it): set AutoShardPolicy.DATA (or AUTO), "
            "or use tfstrat.CollectiveAllReduce / tfstrat.Hybrid, which read by file."
        )

    def _check_rows(self, rows: int | None) -> None:
        """Refuses a global batch too small to give every worker a row."""
        rows = rows if rows is not None else self._input_rows
        self._input_rows = None
        if rows is not None and rows < self.num_workers:
            raise UsageError(
                f"Received: a global batch of {rows} row(s) for {self.num_workers} workers. "
                "ParameterServer gives worker w rows [w*n//W, (w+1)*n//W) of each batch of n "
                "rows, so a worker would train on nothing (its loss would read 0.0 and sync "
                f"steps would average its zero gradient in). Use batch_size >= {self.num_workers}."
            )

    def _guard_rows(self, model, step: str) -> None:
        """Checks the input of later `fit`/`evaluate` calls too: Keras traces a step once."""
        attr = "train_function" if step == "train_step" else "test_function"
        function = getattr(model, attr, None) if model is not None else None
        if function is None or getattr(function, "_tfstrat_rows_checked", False):
            return

        def checked(data):
            self._check_rows(_eager_rows(data))
            return function(data)

        checked._tfstrat_rows_checked = True
        setattr(model, attr, checked)

    def _adopt(self, model):
        """Hooks the model's optimizer (once): sparse dedup, and the sync protocol."""
        optimizer = getattr(model, "optimizer", None)
        if optimizer is None or id(optimizer) in self._adopted:
            return
        self._warn_stock_embeddings(model)
        logger.info("tfstrat: %s", self.placement_summary())
        where = [f"{w.path} ps:{psvars.ps_index_of(w.value)}" for w in model.weights]
        logger.info(
            "tfstrat: placement: %s%s", ", ".join(where[:40]), " ..." if len(where) > 40 else ""
        )
        self._adopt_optimizer(optimizer)

    def _tfstrat_custom_apply(self, optimizer):
        """A custom loop's first `apply_gradients` (`_custom_loops`): the optimizer is adopted
        as `fit`'s is, and its step runs the same protocol. Returns what to call instead, or
        None when the optimizer is adopted already (Keras's own apply, inside the protocol)."""
        if getattr(optimizer, "_tfstrat_ps_adopted", False):
            return None
        self._adopt_optimizer(optimizer)
        return optimizer.apply

    def _adopt_optimizer(self, optimizer):
        self._adopted.add(id(optimizer))
        _custom_loops.adopted(optimizer)
        _atomic_increment(optimizer)
        original = optimizer.apply
        sync, is_chief, stop = self.sync, self.extended.is_chief, self._stop

        def apply(grads, trainable_variables=None):
            variables = (
                list(trainable_variables)
                if trainable_variables is not None
                else list(optimizer._trainable_variables)
            )
            grads = [dedup(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
            asks = stop.flags(tf.float32)
            if sync is None:  # async: each worker stops on its own requests, after its step
                applied = original(grads, variables)
                stop.agree(asks)
                return applied
            if not optimizer.built:
                optimizer.build(variables)
            pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
            tf_pairs = [(g, v.value) for g, v in pairs]
            state = _exact_step._step
            # Keras's loss, and a custom loop's `compute_average_loss`, are divided by the
            # replica count (the workers); the sum of the workers' gradients is one device's.
            replicas = self.num_replicas_in_sync
            tf_pairs = [(scale(g, replicas), v) for g, v in tf_pairs]
            delivered = sync.push(tf_pairs, state.rows if state.scaled else None, asks)
            if not is_chief:
                done, agreed = sync.finish([delivered])
            else:
                averaged, agreed = sync.aggregate(tf_pairs, delivered)
                # Every write of the step after the wait, the iteration counter's too: it
                # depends on no gradient, so it ran as soon as the step began, where a
                # worker's read (or a late worker's checkpoint restore) could cross it.
                with tf.control_dependencies([agreed]):
                    original([g for g, _ in averaged], [v for _, v in pairs])
                # Reads ordered after every update: publish only once the step is applied.
                applied = [optimizer.iterations.value.read_value()]
                applied += [v.value.is_initialized() for _, v in pairs]
                applied += [v.value.is_initialized() for v in optimizer.variables]
                done = sync.publish(applied)
            with tf.control_dependencies([done]):  # the step's requests, alike on every worker
                stop.agree(agreed)
            return done

        optimizer.apply = apply
        if sync is not None:
            finalize = optimizer.finalize_variable_values

            def finalize_then_mark_done(variables):  # Keras calls it when `fit` ends
                finalize(variables)
                sync.mark_done()

            optimizer.finalize_variable_values = finalize_then_mark_done

    def _warn_stock_embeddings(self, model):
        import keras

        from tfstrat.keras.layers import Embedding

        for layer in model._flatten_layers(include_self=False):
            if isinstance(layer, keras.layers.Embedding) and not isinstance(layer, Embedding):
                if layer.name not in self._warned and layer.built:
                    self._warned.add(layer.name)
                    logger.warning(
                        "tfstrat: layer %r is a keras.layers.Embedding: its lookup reads the "
                        "whole table from the ps every step. Use tfstrat.keras.layers.Embedding "
                        "(same arguments and weights) to move only the rows a batch needs.",
                        layer.name,
                    )

    def reduce(self, reduce_op, value, axis=None):
        """Across the workers (sync: each is a replica) through ps 0, as tf.distribute sums
        replicas; async: this worker's own (its one replica)."""
        if axis is not None:  # per-step logs: one replica, nothing to reduce across
            values = self.experimental_local_results(value)
            return values[0] if len(values) == 1 else value
        local = super().reduce(reduce_op, value, axis)
        if self.num_replicas_in_sync == 1:
            return local
        if isinstance(local, distributed_values.DistributedValues):  # an on-read variable's
            local = local.values[0].read_value()
        mean = str(getattr(reduce_op, "value", reduce_op)).upper() == "MEAN"

        def across(t):
            summed = tf.add_n(self._across_workers(t, "strategy.reduce"))
            summed = tf.reshape(summed, tf.shape(t))
            if mean:
                summed = summed / self.num_replicas_in_sync
            return tf.cast(summed, t.dtype)

        return nest.map_structure(across, local)

    def gather(self, value, axis):
        """Every worker's rows, in worker order (sync; async: this worker's), as tf.distribute
        concatenates its replicas' values."""
        values = self.experimental_local_results(value)
        local = values[0] if len(values) == 1 else value
        if self.num_replicas_in_sync == 1:
            return local

        def across(t):
            t = tf.convert_to_tensor(t)
            front = tf.experimental.numpy.moveaxis(t, axis, 0)
            rest = tf.shape(front)[1:]
            parts = self._across_workers(front, "strategy.gather")
            shape = tf.concat([[-1], rest], 0)
            whole = tf.concat([tf.reshape(p, shape) for p in parts], 0)
            return tf.cast(tf.experimental.numpy.moveaxis(whole, 0, axis), t.dtype)

        return nest.map_structure(across, local)

    def _across_workers(self, t, what: str) -> list:
        """Each worker's `t` (flattened, float64), in worker order, through ps 0."""
        n = self.num_workers
        flat = tf.reshape(tf.cast(tf.convert_to_tensor(t), tf.float64), [-1])
        names = [self.tf_config.trainer_name(w) for w in range(n)]
        out = self._steps.exchange(flat, n, what, names)
        counts = tf.cast(out[:n], tf.int64)
        return tf.split(out[n:], counts, num=n)


_keras_input = threading.local()  # .active while Keras distributes its own input


def _on_host(options):
    """`options` (or the defaults) with batches left on the host, not fetched to the device."""
    options = options if options is not None else tf.distribute.InputOptions()
    return options._replace(experimental_fetch_to_device=False)  # a namedtuple


def _mark_keras_input() -> None:
    """Tells Keras's input from a custom loop's (`experimental_distribute_dataset`)."""
    from tfstrat._compat import patches
    from tfstrat._compat.keras import TFEpochIterator

    if patches.is_patched(TFEpochIterator, "__init__"):
        return
    keras_init = patches.original(TFEpochIterator, "__init__")

    def __init__(self, *args, **kwargs):
        _keras_input.active = True
        try:
            keras_init(self, *args, **kwargs)
        finally:
            _keras_input.active = False

    patches.patch(
        TFEpochIterator,
        "__init__",
        __init__,
        "ParameterServer slices Keras's input in the step (whole batches in the dataset) and a "
        "custom loop's in the dataset",
    )


def _atomic_increment(optimizer) -> None:
    """`optimizer.iterations.assign_add` as one AssignAddVariableOp on the ps.

    Keras's `assign_add` is `assign(self + value)`: a read and a write, two ps ops; async
    workers interleaving them lose increments (3,063 of 4,000 counted, measured).
    """
    iterations = optimizer._iterations

    def assign_add(value):
        return iterations.value.assign_add(tf.cast(value, iterations.value.dtype))

    iterations.assign_add = assign_add


def _first_batch_rows(dataset) -> int | None:
    """Rows in the dataset's first batch; ValueError if it has none."""
    cardinality = int(dataset.cardinality())
    if cardinality == 0:
        raise UsageError(_EMPTY)
    rows = _static_rows(dataset.element_spec)
    if rows is not None and cardinality != tf.data.UNKNOWN_CARDINALITY:
        return rows
    # Keras itself reads the first batch of every input under a strategy (its symbolic
    # build), so one more read costs no more than that.
    for element in dataset.take(1):
        return _eager_rows(element)
    raise UsageError(_EMPTY)


_EMPTY = (
    "Received: an empty dataset (it yields no batch). fit, evaluate and predict under "
    "tfstrat.ParameterServer need at least one batch; check that x has rows."
)


def _static_rows(structure) -> int | None:
    for item in nest.flatten(structure):
        shape = getattr(item, "shape", None)
        if shape is not None and shape.rank:
            return shape[0]
    return None


def _eager_rows(data) -> int | None:
    """The batch size of eager data (`train_on_batch`); None for an iterator."""
    if isinstance(data, (tf.data.Iterator, tf.distribute.DistributedIterator)):
        return None
    for item in nest.flatten(data):
        if isinstance(item, (tf.Tensor, tf.SparseTensor)) or hasattr(item, "shape"):
            shape = tf.TensorShape(item.shape)
            if shape.rank:
                return shape[0]
    return None


def _env_config() -> TFConfig:
    if not os.environ.get("TF_CONFIG"):
        raise UsageError(
            "ParameterServer needs a cluster with ps tasks: set TF_CONFIG (e.g. run under "
            "`tfstrat launch --workers 2 --ps 1 -- python train.py`) or pass tf_config=."
        )
    return TFConfig.from_env()


def _check_config(tf_config: TFConfig, mode: str, partitions) -> None:
    tf_config.require_task("ParameterServer")
    if mode not in ("sync", "async"):
        raise UsageError(f"Received: mode={mode!r}. Use 'sync' or 'async'.")
    if partitions != "auto" and not (isinstance(partitions, int) and partitions >= 1):
        raise UsageError(f"Received: partitions={partitions!r}. Use 'auto' or an integer >= 1.")
    if not tf_config.addresses("ps"):
        raise UsageError(
            f"Received: a cluster without ps tasks ({dict(tf_config.cluster)}). ParameterServer "
            "needs at least one: `tfstrat launch --ps 1 ...`, or use tfstrat.CollectiveAllReduce."
        )
    if tf_config.task_type not in ("chief", "worker", "ps"):
        raise UsageError(
            f"Received: task type {tf_config.task_type!r}. ParameterServer runs in chief, "
            "worker and ps tasks."
        )


def _worker_index(tf_config: TFConfig) -> int:
    if tf_config.task_type == "chief":
        return 0
    return tf_config.task_index + (1 if tf_config.addresses("chief") else 0)
