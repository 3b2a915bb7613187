"""Keras optimizers apply a sparse gradient to the touched rows only (`tfstrat.ps.rowmath`).

**Adagrad, always (exact).** A gradient that reaches Keras 3's `Adagrad.update_step` as
`tf.IndexedSlices` (an Embedding's, or the deduplicated rows tfstrat's strategies reduce) is
added to the accumulator row-wise (`scatter_add`), but the step's divisor
`sqrt(accumulator + epsilon)` is computed for the whole accumulator, then checked for zeros and
NaNs over the whole of it, before the touched rows are gathered from it (Keras 3.15,
`backend/tensorflow/sparse.elementwise_division`): about six passes over the table's size per
step, 49 MiB each for a 200,000 x 64 table, whatever the batch touched. This computes the same
values for the touched rows only. Duplicate ids are handled as Keras does (each adds its
square; each subtracts its own step with the row's final accumulator). The one difference:
Keras's dense check turns a divisor of 0 or NaN anywhere in the table (an accumulator already
NaN) into NaN updates there; here such rows change only when touched.

**Adam, SGD with momentum and RMSprop, lazily, for tables that ask for it.** Their dense update
also changes rows outside the batch (moments decay, momentum keeps moving them), so a row-wise
update is another algorithm: lazy Adam (tf-keras's and TF1's sparse behaviour). It applies to
variables marked with `mark(variable, "lazy")`, which `tfstrat.keras.layers.Embedding` does for
its table unless built with `sparse_updates="exact"`; every other variable, and these
optimizers' other settings (amsgrad, centered RMSprop), keep Keras's own update. The repeats
of an id are summed before the step (the table's true gradient for that row).

Installed once per process when `tfstrat.keras` is imported (by the strategies and by
`tfstrat.keras.layers`). `TFSTRAT_ROWWISE=0` keeps Keras's own updates everywhere.
"""

from __future__ import annotations

import logging
import os

from tfstrat._compat import patches
from tfstrat.errors import UsageError
from tfstrat.keras import _local
from tfstrat.ps import rowmath as _rowmath

logger = logging.getLogger(__name__)
SWITCH = "TFSTRAT_ROWWISE"
MODES = ("lazy", "exact")
_installed = False
keras_update_step = None  # Keras's own Adagrad.update_step, once install() replaced it
keras_update_steps: dict = {}  # optimizer class -> its own update_step, once replaced
_announced: set = set()  # paths of the variables whose lazy update was logged


def enabled() -> bool:
    """Whether the row-wise update is on (`TFSTRAT_ROWWISE` unset or not "0"/"false"/"off")."""
    return os.environ.get(SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def check(mode) -> str:
    if mode not in MODES:
        raise UsageError(
            f"Received: sparse_updates={mode!r}. Use 'lazy' (momentum, Adam and RMSprop update "
            "only the batch's rows and their slots) or 'exact' (Keras's dense update)."
        )
    return mode


def mark(variable, mode: str) -> None:
    """Marks a Keras variable's sparse updates "lazy" (row-wise) or "exact" (Keras's own), and
    its TensorFlow variable's, which is what Keras hands its gradient reduction."""
    variable._tfstrat_sparse_updates = check(mode)
    inner = getattr(variable, "value", None)
    if inner is not None and not callable(inner):
        inner._tfstrat_sparse_updates = mode


def is_lazy(variable) -> bool:
    """Whether a Keras variable or its TensorFlow variable was marked "lazy"."""
    return getattr(variable, "_tfstrat_sparse_updates", None) == "lazy"


def _lazy(optimizer, variable) -> bool:
    """Whether `variable` (the tf.Variable or component Keras passes) is marked lazy."""
    try:
        keras_variable = optimizer._trainable_variables[optimizer._get_variable_index(variable)]
    except (KeyError, IndexError, AttributeError):
        return False
    return is_lazy(keras_variable)


def install() -> bool:
    """Wraps the `update_step` of Keras's Adagrad, Adam, SGD and RMSprop (once per process);
    True when installed."""
    global _installed, keras_update_step
    import keras
    import tensorflow as tf

    if not enabled() or (_installed and patches.is_patched(keras.optimizers.Adam, "update_step")):
        return _installed  # (after `patches.remove_all()` it installs again)

    def wrap(cls, rows_fn, always: bool):
        own = cls.update_step
        keras_update_steps[cls] = own

        def update_step(self, gradient, variable, learning_rate):
            if isinstance(gradient, tf.IndexedSlices) and (always or _lazy(self, variable)):
                kind = rows_fn(self)
                if kind is not None:
                    return _update_rows(self, tf, kind, gradient, variable, learning_rate)
            return own(self, gradient, variable, learning_rate)

        update_step.__doc__ = own.__doc__
        patches.patch(
            cls, "update_step", update_step, "a sparse gradient updates only the touched rows"
        )

    opt = keras.optimizers
    wrap(opt.Adagrad, lambda o: "adagrad", always=True)
    wrap(opt.Adam, lambda o: None if o.amsgrad else "adam", always=False)
    wrap(opt.SGD, lambda o: "sgd_momentum" if o.momentum else None, always=False)
    wrap(
        opt.RMSprop,
        lambda o: None if o.centered else ("rmsprop_momentum" if o.momentum > 0 else "rmsprop"),
        always=False,
    )
    keras_update_step = keras_update_steps[opt.Adagrad]
    logger.debug("tfstrat: sparse gradients update their rows only (%s=0 turns it off)", SWITCH)
    _installed = True
    return True


_SLOT_LISTS = {  # where each Keras optimizer keeps the slots `tfstrat.ps.rowmath` names
    "accumulator": "_accumulators",
    "momentum": "_momentums",
    "velocity": "_velocities",
}


def _slot_list(optimizer, name):
    if name == "momentum" and hasattr(optimizer, "momentums"):  # SGD's public list
        return optimizer.momentums
    return getattr(optimizer, _SLOT_LISTS[name])


def _update_rows(optimizer, tf, kind, gradient, variable, learning_rate):
    """`kind`'s step (`tfstrat.ps.rowmath`) for the rows `gradient` touches."""
    from keras import ops

    dtype = variable.dtype
    values = ops.cast(gradient.values, dtype)
    indices, shape = gradient.indices, gradient.dense_shape
    index = optimizer._get_variable_index(variable)
    slots = {name: _slot_list(optimizer, name)[index] for name in _rowmath.SLOTS[kind]}
    if kind == "adagrad":
        # Keras's arithmetic exactly, repeats included: each repeat adds its square, then every
        # repeat steps with the row's final accumulator.
        accumulator = slots["accumulator"]
        optimizer.assign_add(accumulator, tf.IndexedSlices(ops.square(values), indices, shape))
        rows = _local.rows(accumulator.value, indices)  # no read of the whole slot
        lr = ops.cast(learning_rate, dtype)
        step = ops.divide(ops.multiply(lr, values), ops.sqrt(ops.add(rows, optimizer.epsilon)))
        optimizer.assign_sub(variable, tf.IndexedSlices(step, indices, shape))
        return
    path = optimizer._trainable_variables[index].path
    if path not in _announced:  # once per table, when the step is traced
        _announced.add(path)
        logger.info(
            "tfstrat: %s: %s updates only the batch's rows and their slots (lazy; "
            "tfstrat.keras.layers.Embedding(sparse_updates='exact') for Keras's dense update)",
            path,
            type(optimizer).__name__,
        )
    unique, position = tf.unique(indices)
    g = tf.math.unsorted_segment_sum(values, position, tf.shape(unique)[0])
    cast = lambda x: ops.cast(x, dtype)  # noqa: E731
    hyper = {"lr": cast(learning_rate), "sqrt": ops.sqrt}
    if kind == "adam":
        t = cast(optimizer.iterations + 1)
        hyper.update(
            one_minus_beta_1=1 - optimizer.beta_1,
            one_minus_beta_2=1 - optimizer.beta_2,
            epsilon=optimizer.epsilon,
            beta_1_power=ops.power(cast(optimizer.beta_1), t),
            beta_2_power=ops.power(cast(optimizer.beta_2), t),
        )
    elif kind == "sgd_momentum":
        hyper.update(momentum=cast(optimizer.momentum), nesterov=optimizer.nesterov)
    else:  # rmsprop
        hyper.update(
            rho=optimizer.rho,
            one_minus_rho=1 - optimizer.rho,
            epsilon=optimizer.epsilon,
            momentum=optimizer.momentum,
        )
    rows = {name: _local.rows(slot.value, unique) for name, slot in slots.items()}
    new_rows, step = _rowmath.STEPS[kind](rows, g, **hyper)
    for name, value in new_rows.items():
        optimizer.assign(slots[name], tf.IndexedSlices(value, unique, shape))
    optimizer.assign_sub(variable, tf.IndexedSlices(step, unique, shape))
