"""Exact training steps for any global batch, and global per-step logs, in one all-reduce.

Weighting. Keras 3.15 divides each replica's *local mean* loss by the replica count R
(`keras/src/losses/loss.py`, `scale_loss_for_distribution`), so summing the replicas' gradients
gives sum_r g_r / (R n_r) over examples: exact only when every replica holds the same number of
rows n_r. Here each replica multiplies its gradient by R n_r and appends n_r to the step's
gradient all-reduce; after it the sum is divided by N = sum_r n_r, which gives one device's
(1/N) sum_i g_i. Regularization and `add_loss` terms (Keras scales them by 1/R too) come out
as sum_r (n_r/N) reg = reg; `sample_weight` multiplies the per-example losses before Keras's
mean (whose divisor is the element count, as the rows), so it stays exact. A step in which
Keras scaled no loss (a custom train_step dividing by the global batch itself) is not
weighted. A loss term Keras does not scale (reduction="sum", a custom loss returning a scalar)
added to one it does is weighed by R n_r / N: 1 when the batch splits evenly.

Logs. The step's metric states (the loss tracker, compiled metrics, every metric of the model
whose variables sum across replicas) ride in the same all-reduce, and the step's logs are the
metrics' results on the summed states: global, equal on every worker, and equal to one
device's. Keras's default `train_step` updates the compiled metrics *after*
`optimizer.apply_gradients`; for that `train_step` the call is deferred until the step's
metrics are updated (nothing in that step reads the weights after the update). A custom
`train_step` keeps its own order: its gradients are weighted exactly, its logs stay local.

Everything travels in one flat vector appended to the gradients: [stop flags (multi-worker),
n_r, metric states...], so a step still runs one all-reduce (one TCP ring call).
"""

from __future__ import annotations

import functools

import numpy as np
import tensorflow as tf

from tfstrat._compat import patches
from tfstrat.reduce import compression, sparse
from tfstrat.runtime.step import _step
from tfstrat.strategies import _compute


def _is_keras_default_train_step(fn) -> bool:
    from tfstrat._compat.keras import TensorFlowTrainer

    return getattr(fn, "__func__", None) is TensorFlowTrainer.train_step


def defer_apply(optimizer) -> None:
    """`optimizer.apply_gradients` records its arguments while a default train_step runs."""
    if getattr(optimizer, "_tfstrat_deferrable", False):
        return
    keras_apply_gradients = optimizer.apply_gradients

    def apply_gradients(grads_and_vars):
        if _step.pending is not None:
            _step.pending.append((keras_apply_gradients, list(grads_and_vars)))
            return optimizer.iterations
        return keras_apply_gradients(grads_and_vars)

    optimizer.apply_gradients = apply_gradients
    optimizer._tfstrat_deferrable = True


def _watch_keras_scaling() -> None:
    """Notes when Keras divides a loss by the replica count (its mean reductions, regularizers
    and `add_loss`): only then is the gradient weighted by rows. A custom train_step whose loss
    is already divided by the global batch (`tf.nn.compute_average_loss`) is left alone."""
    from tfstrat._compat.keras import loss_module

    keras_scale = loss_module.scale_loss_for_distribution
    if getattr(keras_scale, "_tfstrat", False):
        return

    def scale_loss_for_distribution(value):
        _step.scaled = True
        return keras_scale(value)

    scale_loss_for_distribution._tfstrat = True
    patches.patch(
        loss_module,
        "scale_loss_for_distribution",
        scale_loss_for_distribution,
        "notes that Keras divided a loss by the replica count, so the step weights by rows",
    )


def replica_step(model, fn):
    """`fn` (a model's bound train_step), exactly weighted and with global logs."""
    _watch_keras_scaling()
    default = _is_keras_default_train_step(fn) and hasattr(model.optimizer, "apply_gradients")
    if default:
        defer_apply(model.optimizer)
    # A replica's computation apart (`_compute`): Keras's own train_step, no collective inside.
    apart = default and _compute.can_skip(model)

    @functools.wraps(fn)
    def step(*args, **kwargs):
        context = tf.distribute.get_replica_context()
        if context is not None and context.num_replicas_in_sync > 1:
            args, kwargs = _compute.unknown_batch((args, kwargs))  # the same trace everywhere
        _step.rows, _step.scaled = _compute.rows_of((args, kwargs)), False
        _step.pending = [] if default else None
        _step.metrics = _step.states = None
        skip = apart and _step.rows is not None and context is not None
        skip = skip and context.num_replicas_in_sync > 1
        jit = apart and getattr(model, "_tfstrat_jit", False)
        try:
            if skip or jit:  # no forward pass on 0 rows; XLA without the exchange
                logs = None
                pending = computed_apart(fn, args, kwargs, _step.rows if skip else None, jit)
            else:
                logs = fn(*args, **kwargs)
                pending, _step.pending = _step.pending, None
            if not pending:  # a custom train_step, or no trainable weights
                return logs if logs is not None else _logs(model, [], [])
            _step.metrics = _foldable(model)
            for apply_gradients, grads_and_vars in pending:
                apply_gradients(grads_and_vars)
            if _step.states is None:  # not reduced (no replica context, no gradient)
                return logs if logs is not None else _logs(model, [], [])
            return _logs(model, _step.metrics, _step.states)
        finally:
            _step.rows = _step.pending = _step.metrics = _step.states = _step.pushes = None
            _step.scaled = False

    return step


def computed_apart(fn, args, kwargs, rows=None, jit: bool = False) -> list:
    """Keras's default `train_step` `fn` on `args`, its `apply_gradients` deferred, traced by
    `_compute.gradients` (skipped where `rows == 0`, compiled by XLA with `jit`): its deferred
    `[(apply_gradients, grads_and_vars), ...]`, for the caller to apply after."""

    def run():
        fn(*args, **kwargs)
        return _step.pending

    _step.pending = []
    try:
        return _compute.gradients(run, rows, jit)
    finally:
        _step.pending = None


def _foldable(model) -> list:
    """The model's metrics whose every state variable sums across replicas."""
    out = []
    for metric in model.metrics:
        variables = metric.variables
        if variables and all(getattr(v, "aggregation", None) == "sum" for v in variables):
            out.append(metric)
    return out


def _logs(model, folded, states):
    """Keras's `get_metrics_result`, with the folded metrics computed on the global states."""
    from tfstrat._compat.keras import pythonify_logs

    by_metric = dict(zip((id(m) for m in folded), states, strict=True))
    logs = {}
    for metric in model.metrics:
        mine = by_metric.get(id(metric))
        result = metric.result() if mine is None else metric.stateless_result(mine)
        if isinstance(result, dict):
            logs.update(result)
        else:
            logs[metric.name] = result
    return pythonify_logs(logs)


def _extras_dtype(grads):
    """The dense gradients' dtype when it holds counts exactly enough, so that the extras
    pack with them (the TCP ring carries one dtype); else float32 (TF's collectives)."""
    dense = [g.dtype for g in grads if not isinstance(g, tf.IndexedSlices)]
    return dense[0] if dense and dense[0] in (tf.float32, tf.float64) else tf.float32


def _with_static_shape(grad, variable):
    if isinstance(grad, tf.IndexedSlices) or grad.shape.is_fully_defined():
        return grad
    shape = getattr(variable, "shape", None)
    if shape is None or not tf.TensorShape(shape).is_fully_defined():
        return grad
    return tf.ensure_shape(grad, shape)


def _keep_lazy_sparse(pairs) -> list:
    """Gradients of tables marked "lazy" are reduced sparsely whatever `sparse_as_dense` says
    (`tfstrat.reduce.sparse.keep_sparse`); returns the marks to forget afterwards."""
    from tfstrat.keras import _rowwise
    from tfstrat.reduce import sparse

    return [
        sparse.keep_sparse(g)
        for g, v in pairs
        if isinstance(g, tf.IndexedSlices) and _rowwise.is_lazy(v)
    ]


def step_reduce(reduce_sum, stop, replicas: int, iterations=None):
    """Keras's gradient all-reduce (`optimizer._all_reduce_sum_gradients`), carrying the stop
    flags (`_stopping`, multi-worker only), the rows weighting and the metric states.
    `iterations`: the optimizer's step counter, for a compression that counts steps."""

    def reduce(grads_and_vars):
        # A dense gradient can lose its static shape (TF 2.21: Dense on 3-D input gives its
        # kernel a (None, units) gradient); the variable's shape lets the ring carry it.
        pairs = [(g if g is None else _with_static_shape(g, v), v) for g, v in grads_and_vars]
        # ModelParallel's variables sharded over the batch axis (FSDP) arrive summed over it,
        # weighted by rows (`mesh.collectives.gather_batch`): only the division by the rows.
        held = {i: g for i, (g, v) in enumerate(pairs) if g is not None and _summed(v)}
        if not held:
            return reduce_rest(pairs, False)[0]
        rest, rows = reduce_rest([p for i, p in enumerate(pairs) if i not in held], True)
        rest = iter(rest)
        return [
            (held[i] if rows is None else sparse.scale(held[i], 1.0 / rows), v)
            if i in held
            else next(rest)
            for i, (_, v) in enumerate(pairs)
        ]

    def reduce_rest(pairs, need_rows: bool):
        """(`pairs` reduced, the step's rows summed when the gradients were weighted by them;
        `need_rows`: even when no gradient is left to reduce)."""
        have = [i for i, (g, _) in enumerate(pairs) if g is not None]
        context = tf.distribute.get_replica_context()
        rows = _step.rows if _step.scaled else None
        metrics = _step.metrics or []
        if (
            (not have and not need_rows)
            or context is None
            or (stop is None and rows is None and not metrics)
        ):
            if not have and need_rows:
                return pairs, None
            marks = _keep_lazy_sparse(pairs)
            lossy = compression.mark(((g, v) for g, v in pairs if _is_dense(g)), iterations)
            try:
                return reduce_sum(pairs), None
            finally:
                sparse.forget(marks)
                compression.forget(lossy)
        grads = [pairs[i][0] for i in have]
        dtype = _extras_dtype(grads)
        parts = [stop.flags(dtype)] if stop is not None else []
        if rows is not None:
            grads = [sparse.scale(g, rows * replicas) for g in grads]
            parts.append(tf.reshape(tf.cast(rows, dtype), [1]))
        marks = _keep_lazy_sparse([(g, pairs[i][1]) for i, g in zip(have, grads)])
        variables = [v for m in metrics for v in m.variables]
        parts += [tf.reshape(tf.cast(v.value, dtype), [-1]) for v in variables]
        # The extras stay exact.
        lossy = compression.mark(
            ((g, pairs[i][1]) for i, g in zip(have, grads) if _is_dense(g)), iterations
        )
        try:
            reduced = context.all_reduce(tf.distribute.ReduceOp.SUM, grads + [tf.concat(parts, 0)])
        finally:
            sparse.forget(marks)
            compression.forget(lossy)
        extras, at = reduced[-1], 0
        if stop is not None:
            stop.agree(extras[:2])
            at = 2
        grads, total = reduced[:-1], None
        if rows is not None:
            total = extras[at]
            grads = [sparse.scale(g, 1.0 / total) for g in grads]
            at += 1
        states = []
        for v in variables:
            size = int(np.prod(v.shape))
            states.append(tf.cast(tf.reshape(extras[at : at + size], v.shape), v.dtype))
            at += size
        if metrics:
            _step.states = _split_by_metric(metrics, states)
        for i, g in zip(have, grads, strict=True):
            pairs[i] = (g, pairs[i][1])
        return pairs, total

    return reduce


def _summed(variable) -> bool:
    from tfstrat.mesh.collectives import summed_in_backward

    return summed_in_backward(variable)


def _is_dense(g) -> bool:
    """A dense gradient, which `compression=` may compress (rows stay exact)."""
    return g is not None and not isinstance(g, tf.IndexedSlices)


def _split_by_metric(metrics, states):
    out, at = [], 0
    for m in metrics:
        n = len(m.variables)
        out.append(states[at : at + n])
        at += n
    return out
