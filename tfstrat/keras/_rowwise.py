"""Keras's Adagrad applies a sparse gradient to the touched rows only, as its own arithmetic says.

A gradient that reaches Keras 3's `Adagrad.update_step` as `tf.IndexedSlices` (an Embedding's,
or the deduplicated rows tfstrat's strategies reduce) is added to the accumulator row-wise
(`scatter_add`), but the step's divisor `sqrt(accumulator + epsilon)` is computed for the whole
accumulator, then checked for zeros and NaNs over the whole of it, before the touched rows are
gathered from it (Keras 3.15, `backend/tensorflow/sparse.elementwise_division`): about six
passes over the table's size per step, 49 MiB each for a 200,000 x 64 table, whatever the
batch touched. This computes the same values for the touched rows only: the accumulator rows
after the `scatter_add`, their divisor, the same `scatter_sub`. Duplicate ids are handled as
Keras does (each adds its square; each subtracts its own step with the row's final
accumulator). The one difference: Keras's dense check turns a divisor of 0 or NaN anywhere in
the table (an accumulator already NaN) into NaN updates there; here such rows change only
when touched.

Installed once per process when `tfstrat.keras` is imported (by the strategies and by
`tfstrat.keras.layers`). `TFSTRAT_ROWWISE=0` keeps Keras's own update. Optimizers whose dense
update also changes untouched rows (momentum, Adam's moments, RMSprop) are left alone: a
row-wise update would be another algorithm (lazy Adam), not a faster one.
"""

from __future__ import annotations

import logging
import os

from tfstrat.keras import _local

logger = logging.getLogger(__name__)
SWITCH = "TFSTRAT_ROWWISE"
_installed = False
keras_update_step = None  # Keras's own Adagrad.update_step, once install() replaced it


def enabled() -> bool:
    """Whether the row-wise update is on (`TFSTRAT_ROWWISE` unset or not "0"/"false"/"off")."""
    return os.environ.get(SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def install() -> bool:
    """Wraps `keras.optimizers.Adagrad.update_step` (once per process); True when installed."""
    global _installed, keras_update_step
    if _installed or not enabled():
        return _installed
    import keras
    import tensorflow as tf

    keras_update_step = keras.optimizers.Adagrad.update_step
    logger.debug("tfstrat: Adagrad applies sparse gradients row-wise (%s=0 turns it off)", SWITCH)

    def update_step(self, gradient, variable, learning_rate):
        if not isinstance(gradient, tf.IndexedSlices):
            return keras_update_step(self, gradient, variable, learning_rate)
        return _adagrad_rows(self, tf, gradient, variable, learning_rate)

    update_step.__doc__ = keras_update_step.__doc__
    keras.optimizers.Adagrad.update_step = update_step
    _installed = True
    return True


def _adagrad_rows(optimizer, tf, gradient, variable, learning_rate):
    """Keras's Adagrad step for the rows `gradient` touches (see the module docstring)."""
    from keras import ops

    dtype = variable.dtype
    lr = ops.cast(learning_rate, dtype)
    values = ops.cast(gradient.values, dtype)
    indices, shape = gradient.indices, gradient.dense_shape
    accumulator = optimizer._accumulators[optimizer._get_variable_index(variable)]
    optimizer.assign_add(accumulator, tf.IndexedSlices(ops.square(values), indices, shape))
    rows = _local.rows(accumulator.value, indices)  # no read of the whole slot
    step = ops.divide(ops.multiply(lr, values), ops.sqrt(ops.add(rows, optimizer.epsilon)))
    optimizer.assign_sub(variable, tf.IndexedSlices(step, indices, shape))
