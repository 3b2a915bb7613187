"""`LocalSGD`: each worker trains alone for `sync_every` steps, then the workers average.

Local SGD (SparkNet's rounds: train on your own data, average the parameters) and DiLoCo
(Douillard et al., 2023: the averaged change of the parameters is a pseudo-gradient for an
outer optimizer, e.g. Nesterov SGD). Between sync points a worker talks to no other worker:
its gradient "all-reduce" is local, so bytes per step drop by about `sync_every` against
`CollectiveAllReduce`, at some cost in accuracy (the README's "LocalSGD and DiLoCo").

Built on `CollectiveAllReduce` (this class is one): its cluster set-up, TCP ring or
TensorFlow collectives, agreement and stop handling. What changes is the training step:

- the inner optimizer's gradient reduction becomes local: Keras divides each replica's loss
  by the replica count (`scale_loss_for_distribution`), which is undone, so each worker steps
  on the mean gradient of its own shard; clipping applies to that gradient;
- after the optimizer step, a counter of steps since the last sync advances; when it reaches
  `sync_every`, one all-reduce (one TCP ring call, or one TensorFlow collective) carries every
  trainable variable, every averaged statistic (BatchNormalization's moving mean and
  variance), the inner optimizer's slots when `sync_slots=True`, and the stop flags of
  `_stopping` (a stop or SIGTERM takes effect at a sync point, where every worker holds the
  same weights); the average weighs each worker by the rows it trained on since the last
  sync (equal shards: the plain mean), and a worker whose slice of a batch is empty runs no
  forward pass and steps on a zero gradient;
- the end of every epoch (before validation and the epoch's callbacks) syncs when steps were
  taken since the last sync, so checkpoints, evaluation and `predict` see one model.

State that a resume needs rides in the inner optimizer's variables, so `model.save_weights`
and tfstrat's `BackupAndRestore` keep it: the steps and rows since the last sync, the weights
at the last sync (with an outer optimizer) and the outer optimizer's own variables. A plain Keras
model loads such a checkpoint's weights (its optimizer, if any, is skipped with Keras's
warning about the variable count).
"""

from __future__ import annotations

import contextlib
import json
import logging
import weakref

import tensorflow as tf

from tfstrat._compat import patches
from tfstrat.cluster import TFConfig
from tfstrat.errors import UsageError
from tfstrat.reduce import sparse
from tfstrat.strategies import _batchnorm, _common, _compute, _exact_step
from tfstrat.strategies.collective import DEFAULT_TIMEOUT, CollectiveAllReduce

logger = logging.getLogger(__name__)

#: DiLoCo's outer optimizer (Douillard et al., 2023, section 3): what `outer_optimizer="diloco"`
#: stands for.
DILOCO = {"learning_rate": 0.7, "momentum": 0.9, "nesterov": True}


def _check_arguments(sync_every, outer_optimizer, sync_slots, timeout):
    """Errors that name the value and the fix, raised before any TensorFlow op runs."""
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise UsageError(
            f"Received: sync_every={sync_every!r}. LocalSGD averages the workers' weights every "
            "`sync_every` optimizer steps: use an integer >= 1 (1 is synchronous SGD; DiLoCo "
            "uses tens to hundreds)."
        )
    if not isinstance(sync_slots, bool):
        raise UsageError(f"Received: sync_slots={sync_slots!r}. Use True or False.")
    if timeout is not None and (isinstance(timeout, bool) or not timeout > 0):
        raise UsageError(f"Received: timeout={timeout!r}. Use a number of seconds > 0.")
    if outer_optimizer is None or isinstance(outer_optimizer, (str, dict)):
        if isinstance(outer_optimizer, str) and outer_optimizer != "diloco":
            raise UsageError(
                f"Received: outer_optimizer={outer_optimizer!r}. Use None (plain averaging), "
                "'diloco' (SGD(0.7, momentum=0.9, nesterov=True)), a Keras optimizer, or its "
                "`keras.optimizers.serialize(...)` dict."
            )
        return
    import keras

    if not isinstance(outer_optimizer, keras.optimizers.Optimizer) or isinstance(
        outer_optimizer, keras.optimizers.LossScaleOptimizer
    ):
        raise UsageError(
            f"Received: outer_optimizer={outer_optimizer!r} (a {type(outer_optimizer).__name__})"
            ". The outer optimizer must be a Keras optimizer, e.g. "
            "keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True) (DiLoCo's), or 'diloco', "
            "or None for plain averaging."
        )
    for name, value in (
        ("weight_decay", outer_optimizer.weight_decay),
        ("use_ema", outer_optimizer.use_ema),
        ("gradient_accumulation_steps", outer_optimizer.gradient_accumulation_steps),
        ("clipnorm", outer_optimizer.clipnorm),
        ("global_clipnorm", outer_optimizer.global_clipnorm),
        ("clipvalue", outer_optimizer.clipvalue),
    ):
        if value:
            raise UsageError(
                f"Received: an outer optimizer with {name}={value!r}. LocalSGD applies the "
                "outer optimizer's update rule to the pseudo-gradient only; create it without "
                f"{name} (set it on the inner optimizer, the one given to compile)."
            )


def _outer_config(outer_optimizer):
    """(class name, config) of the outer optimizer argument, or None."""
    if outer_optimizer is None:
        return None
    if outer_optimizer == "diloco":
        return {"class_name": "SGD", "config": dict(DILOCO)}
    if isinstance(outer_optimizer, dict):
        if "class_name" not in outer_optimizer:
            raise UsageError(
                f"Received: outer_optimizer={outer_optimizer!r}. A dict must be "
                "`keras.optimizers.serialize(optimizer)`'s (with 'class_name' and 'config')."
            )
        return {"class_name": outer_optimizer["class_name"], **outer_optimizer}
    config = outer_optimizer.get_config()
    return {
        "class_name": type(outer_optimizer).__name__,
        "config": config,
        "_object": outer_optimizer,
    }


def _local(variable):
    """This worker's own copy of a (Keras, possibly mirrored) variable: a plain tf.Variable.

    Assigning it changes this worker only, without TensorFlow's merge_call (which cannot run
    inside the sync's tf.cond: its branch is another graph than the step's)."""
    v = variable if isinstance(variable, tf.Variable) else variable.value
    get = getattr(v, "_get_on_device_or_primary", None)
    return get() if get is not None else v


class _State:
    """One inner optimizer's LocalSGD state (its variables live in the optimizer)."""

    def __init__(self, since, rows, anchors, outer, own):
        self.since = since  # steps since the last sync (int64 scalar)
        self.rows = rows  # this worker's rows since the last sync (float32): its weight
        self.anchors = anchors  # weights at the last sync (outer optimizer only), else []
        self.outer = outer  # the outer optimizer (a copy made in the strategy's scope) or None
        self.own = own  # ids of the variables above: not the inner optimizer's slots
        self.sync_fn = None  # the eager (end of epoch) sync, a tf.function


class LocalSGD(CollectiveAllReduce):
    """Local SGD and DiLoCo: workers step alone and average every `sync_every` steps.

    Each worker runs the inner optimizer (the one given to `compile`) on its own shard of the
    global batch (the dataset carries the global batch, sharded as in
    `CollectiveAllReduce`), with no traffic between workers; every `sync_every` optimizer
    steps the workers all-reduce their weights (one TCP ring call). Then:

    - `outer_optimizer=None`: the average replaces every worker's weights (Local SGD,
      SparkNet);
    - an outer optimizer (DiLoCo): the pseudo-gradient, the weights at the last sync minus
      the average, is applied to the weights at the last sync by the outer optimizer, the
      same on every worker. DiLoCo's default is `keras.optimizers.SGD(0.7, momentum=0.9,
      nesterov=True)`, also spelled `outer_optimizer="diloco"`.

    BatchNormalization's moving statistics are averaged at every sync; the inner optimizer's
    slots (momentum, Adam's moments) too with `sync_slots=True`, else each worker keeps its
    own. The end of every epoch syncs when steps were taken since the last sync, so the model
    that validation, callbacks and checkpoints see is the same on every worker. With
    `sync_every=1`, plain SGD and no outer optimizer this is synchronous SGD (equal to
    `CollectiveAllReduce` and to one device on the global batch). `tfstrat.auto()` never
    picks it: it changes the training algorithm.

    Create it first in the program, before any other TensorFlow op, on every worker alike.
    A Keras optimizer is a TensorFlow op too: on a cluster, give `outer_optimizer` as
    "diloco" or as a config dict (`{"class_name": "SGD", "config": {"learning_rate": 0.7,
    "momentum": 0.9, "nesterov": True}}`); LocalSGD builds the outer optimizer in its scope
    (a Keras optimizer object given here is copied from its config, never updated).

    Args:
        tf_config: the cluster; None reads the `TF_CONFIG` environment variable.
        sync_every: optimizer steps between syncs (an integer >= 1).
        outer_optimizer: None (plain averaging), "diloco", a Keras optimizer, or
            `keras.optimizers.serialize(...)` of one. Its clipping, weight decay and EMA
            are not supported (create it without them).
        sync_slots: also average the inner optimizer's slots at every sync.
        timeout: seconds a sync may wait for a peer before failing with an error.
        communication: "auto", "tcp" or "ring", as in `CollectiveAllReduce`.

    Raises:
        ValueError: a bad argument (the message names it and the fix), or more than one
            device per worker.
        tfstrat.errors.AgreementError (a ValueError): workers created it with different arguments.

    Environment:
        TF_CONFIG: the cluster and this task, as `tfstrat launch` or Kubeflow set it.

    Example:
        >>> # tfstrat launch --workers 2 -- python train.py, where train.py holds:
        >>> strategy = tfstrat.LocalSGD(sync_every=16, outer_optimizer="diloco")  # doctest: +SKIP
        >>> with strategy.scope():  # doctest: +SKIP
        ...     model = build_model(); model.compile(optimizer="adamw", loss="mse")
        >>> model.fit(x, y, batch_size=64, epochs=3)  # doctest: +SKIP
    """

    def __init__(
        self,
        tf_config: TFConfig | None = None,
        *,
        sync_every: int = 8,
        outer_optimizer=None,
        sync_slots: bool = False,
        timeout: float | None = DEFAULT_TIMEOUT,
        communication: str = "auto",
    ):
        _check_arguments(sync_every, outer_optimizer, sync_slots, timeout)
        outer = _outer_config(outer_optimizer)
        self.sync_every = sync_every
        self.sync_slots = sync_slots
        self._outer_spec = outer
        described = None
        if outer is not None:
            plain = {k: v for k, v in outer.items() if k != "_object"}
            described = json.dumps(plain, sort_keys=True, default=str)
        try:
            super().__init__(
                tf_config,
                communication=communication,
                timeout=timeout,
                _agree_on={
                    "sync_every": sync_every,
                    "outer_optimizer": described or "none",
                    "sync_slots": sync_slots,
                },
            )
        except RuntimeError as e:
            if outer is None or "_object" not in outer or "at program startup" not in str(e):
                raise
            raise UsageError(
                f"Received: outer_optimizer={outer_optimizer!r}, a Keras optimizer created "
                "before the strategy. Creating it ran TensorFlow ops, and a multi-worker "
                "strategy must come first in the program (TensorFlow: 'Collective ops must "
                "be configured at program startup'). Pass outer_optimizer='diloco', or "
                f"the optimizer's config instead: {{'class_name': "
                f"'{outer['class_name']}', 'config': {{...}}}} (what "
                "keras.optimizers.serialize returns)."
            ) from e
        if len(self.extended.worker_devices) > 1:
            raise UsageError(
                f"Received: {len(self.extended.worker_devices)} devices on this worker "
                f"({list(self.extended.worker_devices)}). LocalSGD trains one device per "
                "worker; make one device visible to each worker process (e.g. "
                "CUDA_VISIBLE_DEVICES=0), or use tfstrat.CollectiveAllReduce."
            )
        self._states: dict[int, _State] = {}  # id(inner optimizer) -> its state
        self._optimizers = weakref.WeakValueDictionary()
        self._hooked_models = weakref.WeakSet()
        _install_build_hook()
        logger.info(
            "tfstrat: LocalSGD, sync every %d step(s), %s%s",
            sync_every,
            "plain averaging" if outer is None else f"outer optimizer {described}",
            ", inner optimizer slots averaged" if sync_slots else "",
        )

    # -- state, created with the inner optimizer's own variables ---------------------------

    def _on_optimizer_build(self, inner, variables):
        """Creates the LocalSGD state as variables of `inner` (saved and restored with it)."""
        if id(inner) in self._states:
            return
        # (Already in this strategy's scope when built from a custom loop's step.)
        scope = contextlib.nullcontext() if tf.distribute.get_strategy() is self else self.scope()
        with scope, tf.init_scope():
            since = inner.add_variable((), initializer="zeros", dtype="int64",
                                       name="localsgd_since_sync")  # fmt: skip
            rows = inner.add_variable((), initializer="zeros", dtype="float32",
                                      name="localsgd_rows_since_sync")  # fmt: skip
            own = [since, rows]
            anchors, outer = [], None
            if self._outer_spec is not None:
                anchors = [
                    inner.add_variable_from_reference(v, name="localsgd_anchor") for v in variables
                ]
                for a, v in zip(anchors, variables, strict=True):
                    a.assign(v)
                outer = self._make_outer()
                outer.build(anchors)
                own += anchors
                for v in outer.variables:
                    inner._track_variable(v)
                    own.append(v)
        self._states[id(inner)] = _State(since, rows, anchors, outer, {id(v) for v in own})
        self._optimizers[id(inner)] = inner

    def _make_outer(self):
        import keras

        spec = self._outer_spec
        obj = spec.get("_object")
        if obj is not None:
            outer = type(obj).from_config(dict(spec["config"]))
        else:
            outer = keras.optimizers.deserialize(
                {"class_name": spec["class_name"], "config": dict(spec["config"])}
            )
        outer._tfstrat_outer = True  # its build is not an inner optimizer's (the build hook)
        # The pseudo-gradient is identical on every worker: no all-reduce of its own.
        outer._all_reduce_sum_gradients = lambda grads_and_vars: grads_and_vars
        return outer

    def _slots(self, inner, state):
        """The inner optimizer's slots: its variables other than the step counter, the
        learning rate and LocalSGD's own."""
        skip = {id(inner.iterations), *state.own}
        lr = getattr(inner, "_learning_rate", None)
        if isinstance(lr, tf.Variable) or hasattr(lr, "assign"):
            skip.add(id(lr))
        return [v for v in inner.variables if id(v) not in skip and "float" in str(v.dtype)]

    # -- the training step ------------------------------------------------------------------

    def run(self, fn, args=(), kwargs=None, options=None):
        from keras.optimizers import Optimizer

        model = getattr(fn, "__self__", None)
        compiled = getattr(model, "optimizer", None)  # a LossScaleOptimizer wraps the inner one
        inner = getattr(compiled, "inner_optimizer", compiled)
        if getattr(fn, "__name__", "") != "train_step" or not isinstance(inner, Optimizer):
            return super().run(fn, args=args, kwargs=kwargs, options=options)
        ring_ = self.extended._cross_device_ops.ring
        if ring_ is not None:  # as CollectiveAllReduce.run: agree on the model first
            self._agree_on_model(model)
        elif self._stop is not None:
            self._stop.before_next_step = lambda: self._agree_on_model(model)
        if not compiled.built:
            with tf.init_scope():
                compiled.build(model.trainable_variables)
        if id(inner) not in self._states:  # built before this strategy hooked it
            self._on_optimizer_build(inner, model.trainable_variables)
        self._reduce_locally(inner)
        if self._stop is not None:
            self._stop.attach(model)
        _common.exact_logs_for_empty_slices(model)
        self._sync_at_epoch_end(model)
        step = self._local_step(model, fn, inner, compiled)
        # Not CollectiveAllReduce.run: its step all-reduces gradients and statistics.
        return tf.distribute.MultiWorkerMirroredStrategy.run(
            self, step, args=args, kwargs=kwargs, options=options
        )

    def _reduce_locally(self, inner):
        """The inner optimizer's gradient "all-reduce" becomes local: Keras's 1/replicas loss
        scaling undone (each worker steps on its own shard's mean gradient), then clipped."""
        if getattr(inner, "_tfstrat_localsgd", None) is self:
            return
        _exact_step._watch_keras_scaling()
        replicas = self.num_replicas_in_sync

        def reduce_locally(grads_and_vars):
            pairs = list(grads_and_vars)
            scale = replicas if _exact_step._step.scaled else 1
            grads = [None if g is None else sparse.scale(g, scale) for g, _ in pairs]
            grads = _common.clip_aggregated(inner, grads)
            return [(g, v) for g, (_, v) in zip(grads, pairs, strict=True)]

        inner._all_reduce_sum_gradients = reduce_locally
        inner._clip_gradients = lambda grads: grads
        inner._tfstrat_clipping = True
        inner._tfstrat_localsgd = self

    def _local_step(self, model, fn, inner, compiled):
        """`compiled`: the optimizer `fit` calls (`inner`, or a LossScaleOptimizer around it,
        which decides alone on each worker between syncs: `tfstrat.keras._loss_scale`)."""
        state = self._states[id(inner)]
        every = tf.constant(self.sync_every, tf.int64)
        # Keras's own train_step without a collective inside: its apply_gradients deferred,
        # the rest skipped on 0 rows and compiled by XLA under jit_compile (`_compute`).
        apart = _exact_step._is_keras_default_train_step(fn) and _compute.can_skip(model)
        if apart:
            _exact_step.defer_apply(compiled)

        def step(*args, **kwargs):
            _exact_step._step.scaled = False  # set again when Keras scales this step's loss
            if state.anchors:  # a period's first step: the anchors are the weights it starts from
                tf.cond(
                    tf.equal(_local(state.since), 0),
                    lambda: self._rebase(model, state),
                    lambda: tf.constant(0, tf.int64),
                )
            args, kwargs = _compute.unknown_batch((args, kwargs))  # alike on every worker
            rows = _compute.rows_of((args, kwargs))
            # Its optimizer steps locally (`_tfstrat_check_apply`). A count on the strategy, not
            # a thread's flag: a merge_call (a LossScaleOptimizer's) runs in another thread.
            self._tracing_fit_steps += 1
            try:
                logs = self._traced_step(model, fn, apart, args, kwargs, rows)
            finally:
                self._tracing_fit_steps -= 1
            weight = tf.constant(1.0) if rows is None else tf.cast(rows, tf.float32)
            _local(state.rows).assign_add(weight)
            since = _local(state.since)
            count = since.assign_add(1)
            tf.cond(
                count >= every,
                lambda: self._sync(model, inner, state),
                lambda: tf.constant(0, tf.int64),
            )
            return logs

        return step

    @staticmethod
    def _traced_step(model, fn, apart, args, kwargs, rows):
        if apart and not tf.executing_eagerly():
            # A worker with no rows runs no forward pass: its optimizer steps on a zero
            # gradient (outside the tf.cond: Keras's apply merge_calls), and it has no
            # weight in the average.
            jit = getattr(model, "_tfstrat_jit", False)
            pending = _exact_step.computed_apart(fn, args, kwargs, rows, jit)
            for apply_gradients, grads_and_vars in pending:
                apply_gradients(grads_and_vars)
            return model.get_metrics_result()
        return fn(*args, **kwargs)

    _tracing_fit_steps = 0  # fit's local steps being traced now (any replica's thread)

    def _tfstrat_check_apply(self, optimizer, variables) -> None:
        """A custom loop's optimizer step (`_custom_loops`): with `sync_every > 1` refused by
        name, since its gradient would be all-reduced each step (synchronous SGD, not local
        steps). With `sync_every=1` LocalSGD is synchronous SGD anyway: allowed."""
        if self.sync_every <= 1 or self._tracing_fit_steps > 0:
            return
        if getattr(optimizer, "_tfstrat_outer", False):  # the sync's own outer step
            return
        raise UsageError(
            f"Received: {type(optimizer).__name__}.apply_gradients outside model.fit under "
            f"tfstrat.LocalSGD(sync_every={self.sync_every}). Its local steps and periodic "
            "averaging run in fit's step only; in a custom loop every step's gradient would be "
            "all-reduced (synchronous SGD, without a word). Train with model.fit (a custom "
            "train_step is fine), or use LocalSGD(sync_every=1) or "
            "tfstrat.CollectiveAllReduce for the loop."
        )

    def _rebase(self, model, state):
        """Anchors := the weights, at a period's first step. After a sync they are equal
        already (a no-op, bit for bit); after `load_weights` or `set_weights` between two
        `fit`s they are not, and the outer step would pull the weights back towards the
        weights before the load (the pseudo-gradient is anchor - average)."""
        for anchor, v in zip(state.anchors, model.trainable_variables, strict=True):
            _local(anchor).assign(_local(v).read_value())
        return tf.constant(1, tf.int64)

    # -- the sync ----------------------------------------------------------------------------

    def _all_reduce_flat(self, flat):
        """Sum of a flat float32 vector over the workers: one TCP ring call, else one
        TensorFlow collective (called directly: the replica context's all_reduce would
        merge_call, which cannot run inside the sync's tf.cond)."""
        if self.num_workers == 1:
            return flat
        ops = self.extended._cross_device_ops
        if ops.ring is not None:
            summed = lambda x: [ops.ring.exchange(x, [])[0]]  # noqa: E731
            return ops._ring_call(summed, [flat], [flat.shape], "localsgd_sync")[0]
        return ops._launchers[0].all_reduce(flat, options=ops._options)

    def _sync(self, model, inner, state):
        """In replica context: average, apply the outer step, reset the period (one call)."""
        weights = list(model.trainable_variables)
        extras = _batchnorm.statistics(model)
        if self.sync_slots:
            extras += self._slots(inner, state)
        values = [tf.convert_to_tensor(_local(v).read_value()) for v in weights + extras]
        # Weighted by the rows each worker trained on since the last sync (as FedAvg weighs
        # its clients): equal shards give the plain mean; a last batch split 1 and 0 gives
        # one device's step with sync_every=1.
        weight = tf.convert_to_tensor(_local(state.rows).read_value())
        parts = [
            tf.math.multiply_no_nan(tf.reshape(tf.cast(t, tf.float32), [-1]), weight)
            for t in values
        ]
        parts.append(tf.reshape(weight, [1]))
        stop = self._stop
        if stop is not None:
            parts.append(stop.flags(tf.float32))
        summed = self._all_reduce_flat(tf.concat(parts, 0))
        if stop is not None:
            stop.agree(summed[-2:])
            summed = summed[:-2]
        mean = summed[:-1] / summed[-1]
        sizes = [int(t.shape.num_elements()) for t in values]
        averaged = [
            tf.cast(tf.reshape(p, t.shape), t.dtype)
            for p, t in zip(tf.split(mean, sizes), values, strict=True)
        ]
        new_weights, new_extras = averaged[: len(weights)], averaged[len(weights) :]
        if state.outer is not None:
            outer = state.outer
            lr = outer._get_current_learning_rate()
            for anchor, avg in zip(state.anchors, new_weights, strict=True):
                pseudo = tf.convert_to_tensor(_local(anchor).read_value()) - avg
                outer.update_step(pseudo, anchor, lr)
            _local(outer.iterations).assign_add(1)
            new_weights = [tf.convert_to_tensor(_local(a).read_value()) for a in state.anchors]
        for v, x in zip(weights + extras, new_weights + new_extras, strict=True):
            _local(v).assign(x)
        _local(state.since).assign(0)
        _local(state.rows).assign(0.0)
        return tf.constant(1, tf.int64)

    def _sync_at_epoch_end(self, model):
        """Keras 3.15's fit reads `_get_metrics_result_or_logs` right after each epoch's last
        step, before validation and `on_epoch_end` callbacks: the end-of-epoch sync goes
        there (evaluate calls it too, where nothing is left to sync)."""
        if model in self._hooked_models:
            return
        self._hooked_models.add(model)
        keras_logs = model._get_metrics_result_or_logs

        def _get_metrics_result_or_logs(logs):
            self.sync_now(model)
            return keras_logs(logs)

        model._get_metrics_result_or_logs = _get_metrics_result_or_logs

    def sync_now(self, model) -> bool:
        """Syncs `model` now if steps were taken since its last sync (every worker must call
        it at the same point of its program). Returns whether it synced."""
        inner = getattr(model, "optimizer", None)
        state = self._states.get(id(inner))
        if state is None or int(_local(state.since).numpy()) == 0:
            return False
        if state.sync_fn is None:
            state.sync_fn = tf.function(
                lambda: tf.distribute.MultiWorkerMirroredStrategy.run(
                    self, lambda: self._sync(model, inner, state)
                ),
                autograph=False,
            )
        state.sync_fn()
        return True

    def sync_state(self, model) -> dict:
        """LocalSGD's state for `model` (for tests and logs): steps since the last sync and
        the outer optimizer's step count."""
        state = self._states.get(id(getattr(model, "optimizer", None)))
        if state is None:
            return {}
        out = {"since_sync": int(_local(state.since).numpy())}
        if state.outer is not None:
            out["outer_iterations"] = int(_local(state.outer.iterations).numpy())
        return out


# -- the optimizer build hook ------------------------------------------------------------------
# Keras 3.15 builds the optimizer eagerly at the start of fit (`_symbolic_build`) and when
# BackupAndRestore restores before the first step; LocalSGD's state must exist by then so that
# a backup's optimizer variables load. The optimizer object is only reachable at its build.

_hooked = [False]


def _install_build_hook() -> None:
    from tfstrat._compat.keras import BaseOptimizer

    if _hooked[0] and patches.is_patched(BaseOptimizer, "build"):
        return  # (after `patches.remove_all()` it installs again)

    keras_build = BaseOptimizer.build

    def build(self, variables):
        keras_build(self, variables)
        strategy = getattr(self, "_distribution_strategy", None)
        outer = getattr(self, "_tfstrat_outer", False) or hasattr(self, "inner_optimizer")
        if isinstance(strategy, LocalSGD) and not outer:  # (a LossScaleOptimizer: its inner)
            strategy._on_optimizer_build(self, list(variables))

    build._tfstrat_localsgd = True
    patches.patch(
        BaseOptimizer, "build", build, "LocalSGD's outer optimizer state follows the inner's"
    )
    _hooked[0] = True
