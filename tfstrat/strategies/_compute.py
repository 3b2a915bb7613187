"""Each replica's own computation in a step (forward, backward, metric updates), apart from
the exchange between replicas: skipped on a replica that has no rows, compiled by XLA under
`jit_compile=True`.

**A replica with no rows runs no forward pass.** When a batch has fewer rows than there are
replicas (the last batch of a dataset whose size is not a multiple of the batch, a small
validation split, an unknown-length TFRecord dataset), some replicas get a slice of 0 rows.
Many models cannot run on 0 rows: TensorFlow 2.21's oneDNN kernels (on by default on CPUs with
AVX-512) give a Conv2D of an empty batch its input's shape, so the next BatchNormalization or
residual `Add` fails ("Incompatible shapes: [0,72,72,3] vs. [32]"), and keras.io's image
classification and TFRecord examples stop at their first small batch, under stock
tf.distribute too. So each replica's step is a `tf.cond` on its rows: with rows, the step as
written; without, no forward pass, and what the step would have given, counted exactly:

- `train_step` (Keras's own, whose `apply_gradients` `_exact_step` defers): zero gradients,
  which the step's all-reduce weighs by 0 rows; no metric update (a metric adds nothing for 0
  rows). The all-reduce stays outside the `cond`, so every replica joins it.
- `test_step`: no metric update; the metrics' current results.
- `predict_step`: outputs of 0 rows, of the dtypes and trailing shapes the replicas with rows
  produce.

**XLA.** Keras compiles its whole step function with `jit_compile=True`, and under a strategy
that function holds every replica and the exchange: XLA cannot compile tfstrat's TCP
all-reduce (a `PyFunc`), nor variables of several devices in one cluster. Under tfstrat, Keras
builds its step without XLA (`tfstrat.keras._xla`), and each replica's computation above is
compiled by XLA on its own device; the all-reduce and the optimizer's update run after it,
outside the compiled part.

Neither applies to models with `BatchNormalization(synchronized=True)` (its all-reduce runs
inside the forward pass, and every replica must join it: their empty replicas run the forward
pass on 0 rows, as before, and their steps are not compiled), to models with a table Hybrid
holds on the ps tasks (the ps applies a step once every replica pushed, an empty push
included), nor to custom `train_step`s (their all-reduce is inside the step; they are not
compiled either).
"""

from __future__ import annotations

import tensorflow as tf

from tfstrat.reduce import sparse


def can_skip(model) -> bool:
    """Whether `model`'s forward pass holds no collective of its own (a replica may skip it):
    no synchronized BatchNormalization, no ps-held table (every replica pushes each step)."""
    from tfstrat.keras._ps_tables import holds_tables

    flatten = getattr(model, "_flatten_layers", None)
    layers = flatten() if flatten else ()
    if any(getattr(layer, "synchronized", False) is True for layer in layers):
        return False
    if any(getattr(layer, "_tfstrat_mesh_call", None) for layer in layers):
        return False  # ModelParallel: the model group's collectives run in the forward pass
    return not holds_tables(model)


def rows_of(args) -> tf.Tensor | None:
    """The batch's rows: the first input's first axis (as Keras's loss tracker counts them)."""
    for t in tf.nest.flatten(args, expand_composites=False):
        if isinstance(t, tf.RaggedTensor):
            return tf.cast(t.nrows(), tf.int32)
        if isinstance(t, tf.SparseTensor):
            return tf.cast(t.dense_shape[0], tf.int32)
        if tf.is_tensor(t) and t.shape.rank:
            return tf.shape(t)[0]
    return None


def unknown_batch(structure):
    """`structure` with a statically empty batch made unknown to the trace. A worker
    whose slice is statically empty (`batch_size=1` on 2 workers) would otherwise trace
    another step than the others: Keras takes other paths for a static 0 (it skips
    `scale_loss_for_distribution`), and the workers' all-reduces would differ in size."""

    if tf.executing_eagerly():  # run_eagerly=True: nothing is traced
        return structure

    def erase(t):
        # Only a static 0: other sizes trace alike, and keep the sparse all-gather's static
        # shape (tests/test_mirrored.py).
        if not isinstance(t, tf.Tensor) or not t.shape.rank or t.shape[0] != 0:
            return t
        return tf.compat.v1.placeholder_with_default(t, [None, *t.shape[1:]])

    return tf.nest.map_structure(erase, structure)


def gradients(run, rows=None, jit: bool = False) -> list:
    """`run()` traces a step and returns its deferred `apply_gradients` calls,
    `[(apply, [(grad, var), ...]), ...]`; returns the same calls with each gradient computed
    by XLA (`jit`) and, when `rows` is given, zero gradients without running the step where
    `rows == 0`."""
    if tf.executing_eagerly():  # run_eagerly=True: tf.cond would trace one branch only
        return run()
    box: dict = {}

    def compute():
        pending = run()
        box["pending"] = pending
        return [g for _, pairs in pending for g, _ in pairs if g is not None] or [tf.zeros([])]

    def skip():  # traced after `compute` (cond_v2 traces the true branch first)
        grads = [(g, v) for _, pairs in box["pending"] for g, v in pairs if g is not None]
        return [_zeros_like(g, v) for g, v in grads] or [tf.zeros([])]

    computed = tf.function(compute, jit_compile=True, autograph=False) if jit else compute
    flat = iter(tf.cond(rows > 0, computed, skip) if rows is not None else computed())
    out = []
    for apply, pairs in box["pending"]:
        out.append((apply, [(g if g is None else _static(next(flat), v), v) for g, v in pairs]))
    return out


def _static(grad, variable):
    """A cond's sparse output with the variable's shape as a constant `dense_shape` (the
    cond makes it a tensor of unknown value, and a densified gradient of unknown shape
    cannot ride in the packed dense all-reduce)."""
    if not isinstance(grad, tf.IndexedSlices) or grad.dense_shape is None:
        return grad
    if not tf.TensorShape(variable.shape).is_fully_defined():
        return grad
    return tf.IndexedSlices(grad.values, grad.indices, _dense_shape(grad, variable))


def _dense_shape(grad: tf.IndexedSlices, variable):
    return tf.constant(tf.TensorShape(variable.shape).as_list(), grad.dense_shape.dtype)


def _zeros_like(grad, variable):
    if isinstance(grad, tf.IndexedSlices):
        row = grad.values.shape[1:]
        if not row.is_fully_defined():
            row = tf.TensorShape(variable.shape)[1:]
        # As many rows as the other branch's, zero, at index 0 (the padding of
        # `tfstrat.reduce.sparse.pack_rows`, which adds nothing): the cond's output keeps its
        # static row count, which the packed sparse all-gather needs.
        n = sparse.static_rows(grad) or 0
        return tf.IndexedSlices(
            tf.zeros([n, *row], grad.values.dtype),
            tf.zeros([n], grad.indices.dtype),
            None if grad.dense_shape is None else _dense_shape(grad, variable),
        )
    shape = grad.shape if grad.shape.is_fully_defined() else tf.TensorShape(variable.shape)
    return tf.zeros(shape, grad.dtype)


def keras_predict_model(fn):
    """The model whose `predict` runs `fn`, or None: Keras 3.15's `make_predict_function`
    gives `strategy.run` a closure over the model (`one_step_on_data`), not `predict_step`."""
    import inspect

    if "make_predict_function" not in getattr(fn, "__qualname__", ""):
        return None
    inner = inspect.unwrap(fn)  # Keras's _autoconvert_optionals and do_not_convert wrappers
    if not inspect.isfunction(inner):  # a tf.function (jit_compile=True): left to Keras
        return None
    return inspect.getclosurevars(inner).nonlocals.get("self")


def replica_fn(fn, model, skip: bool, jit: bool, predict: bool):
    """`fn` (a model's `test_step` or `predict_step`), compiled by XLA (`jit`) and, when
    `skip`, in a `tf.cond` on the rows."""
    computed = tf.function(fn, jit_compile=True, autograph=False) if jit else fn

    def step(*args, **kwargs):
        if tf.executing_eagerly():
            return fn(*args, **kwargs)
        if skip:
            args, kwargs = unknown_batch((args, kwargs))
        rows = rows_of((args, kwargs)) if skip else None
        if rows is None:
            return computed(*args, **kwargs)
        box: dict = {}

        def compute():
            outputs = computed(*args, **kwargs)
            box["outputs"] = outputs
            return outputs

        def nothing():  # traced after `compute`
            if not predict:
                return model.get_metrics_result()
            # An unknown trailing size (a sequence's length) becomes 0.
            zeros = [
                tf.zeros([0, *(d or 0 for d in t.shape[1:])], t.dtype)
                for t in tf.nest.flatten(box["outputs"])
            ]
            return tf.nest.pack_sequence_as(box["outputs"], zeros)

        return tf.cond(rows > 0, compute, nothing)

    return step
