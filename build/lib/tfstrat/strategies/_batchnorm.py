"""Statistics the replicas keep apart: BatchNormalization's moving mean and variance.

Keras 3.15 creates a layer's non-trainable weights with `aggregation="none"` (`Layer.add_weight`),
and TensorFlow 2.21 updates such a mirrored variable in replica context on that replica's copy
only (`values._on_write_update_replica`): under any strategy every replica and worker ends a step
with its own moving mean and variance, computed from its own slice of the batch, and a model
saved, evaluated or used for `predict` holds one replica's.

tfstrat averages them at the end of every training step, in one small all-reduce of their own
(one more TCP ring call, after the gradients'): each replica sends `rows x value` of every such
variable and its row count, and every replica assigns `sum(rows x value) / sum(rows)`. The
moving averages are linear in the batch statistics and every replica starts the step from the
same value, so the averaged moving *mean* is exactly single-device training's, for any split of
the global batch; the moving *variance* is the rows-weighted mean of the replicas' own
variances, which misses the spread of the replicas' means (smaller than single-device's when
the slices differ). `BatchNormalization(synchronized=True)` computes the moments over the global
batch (Keras all-reduces the sums through the replica context) and is exact for both. A replica
with no rows (a last batch smaller than the replicas) has NaN statistics; it sends zeros and
gets the others' average.

Which variables: the float, `aggregation="none"` non-trainable weights of the model's trainable
layers (`layer._non_trainable_variables`: BatchNormalization's moving statistics, renorm's, a
custom layer's running averages); not frozen layers' weights (they never change), seeds or
metric state. A model without such variables runs no extra collective.
"""

from __future__ import annotations

import tensorflow as tf

from tfstrat.strategies import _compute


def statistics(model) -> list:
    """The variables of `model` whose replicas are averaged after every step."""
    found, seen = [], set()
    flatten = getattr(model, "_flatten_layers", None)
    for layer in flatten() if flatten else ():
        if not layer.trainable:
            continue
        for v in getattr(layer, "_non_trainable_variables", ()):
            if id(v) in seen or getattr(v, "aggregation", None) != "none":
                continue
            if getattr(v, "synchronization", None) == "on_read":
                continue
            if tf.as_dtype(v.dtype).is_floating:
                seen.add(id(v))
                found.append(v)
    return found


def _average(variables, rows) -> None:
    """Every replica's `variables` become their rows-weighted mean over the replicas."""
    values = [tf.convert_to_tensor(v.value) for v in variables]
    dtype = values[0].dtype
    weight = tf.cast(rows, dtype)
    # multiply_no_nan: a replica without rows holds NaN statistics and must add nothing.
    payload = [tf.math.multiply_no_nan(x, tf.cast(weight, x.dtype)) for x in values]
    context = tf.distribute.get_replica_context()
    summed = context.all_reduce(tf.distribute.ReduceOp.SUM, payload + [weight])
    for v, s in zip(variables, summed[:-1], strict=True):
        v.assign(s / tf.cast(summed[-1], s.dtype))


def averaging(strategy, fn, model):
    """`fn` (a model's `train_step`), then the model's statistics averaged over the replicas."""
    if strategy.num_replicas_in_sync < 2:
        return fn

    def step(*args, **kwargs):
        outputs = fn(*args, **kwargs)
        variables = statistics(model)
        if variables and tf.distribute.get_replica_context() is not None:
            rows = _compute.rows_of(args)
            _average(variables, tf.constant(1) if rows is None else rows)
        return outputs

    return step
