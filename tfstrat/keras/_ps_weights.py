"""What Keras's weight APIs see of a ps-held table under Hybrid: the table, not its stand-in.

A layer whose table Hybrid holds on the ps tasks trains through a scalar stand-in variable (the
"anchor", `tfstrat.keras._ps_tables`): the gradient Keras's train step takes of it is what
pushes the rows' gradient to the ps, and the optimizer updates it like any weight (its value
stays 0). `TableWeight` is that variable with the table's face on Keras's weight APIs: its
path (`<layer>/embeddings`), `shape`, `numpy()`, `np.asarray()` and `assign()` of a
table-shaped value are the whole table's, read from or written to the ps. So
`model.get_weights()`, `set_weights()`, `weights`, `count_params()` and `summary()` see the
model as they would on one device. Inside a step (as a tensor, `.value`, the optimizer's
arithmetic) it is the scalar, which is why it cannot simply be the table.

The optimizer's slots for it are `SlotWeight`s, made by `slot_for` (the optimizers'
`add_variable_from_reference`, patched by `_ps_tables.install`): scalars in the step, the
table's slot on the ps (Adagrad's accumulator, Adam's momentum and velocity, ...) in
`optimizer.variables`, so Keras's own optimizer saving writes and reads them whole.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tfstrat.errors import UsageError


class _TableFace(keras.Variable):
    """A scalar variable that shows a ps-held array (the table or one of its slots)."""

    def _whole(self) -> np.ndarray:
        raise NotImplementedError

    def _write_whole(self, value: np.ndarray) -> None:
        raise NotImplementedError

    @property
    def shape(self):
        return tf.TensorShape(self._held.shape)

    @property
    def ndim(self):
        return 2

    def numpy(self):
        return self._whole()

    def __array__(self, dtype=None, copy=None):
        whole = self._whole()
        return whole if dtype is None else whole.astype(dtype)

    def assign(self, value):
        if not tf.executing_eagerly() or np.ndim(value) == 0:
            return self.value.assign(value)  # the stand-in, inside a step
        value = np.asarray(value, np.float32)
        if value.shape != tuple(self._held.shape):
            raise UsageError(
                f"Received: a value of shape {value.shape} for {self.path}, of shape "
                f"{tuple(self._held.shape)} (held on the ps tasks). Assign an array of that shape."
            )
        self._write_whole(value)
        return value

    def assign_add(self, value):
        return self.assign(self._whole() + np.asarray(value, np.float32))

    def assign_sub(self, value):
        return self.assign(self._whole() - np.asarray(value, np.float32))

    # tf.train.Checkpoint (a custom loop's `Checkpoint(model=..., optimizer=...)`) saves and
    # restores the whole array under the key a plain variable of its shape uses, so a
    # checkpoint of a Hybrid model restores into the model on one device and back. Every
    # worker restores (the same values), each before its own first lookup.

    def _serialize_to_tensors(self):
        shape = tuple(self._held.shape)
        value = tf.py_function(lambda: self._whole().astype(np.float32), [], tf.float32)
        value.set_shape(shape)
        return {"VARIABLE_VALUE": value}

    def _restore_from_tensors(self, restored_tensors):
        value = restored_tensors["VARIABLE_VALUE"]
        if tf.executing_eagerly():
            self.assign(value.numpy())
            return tf.no_op()

        def write(v):
            self.assign(v.numpy())
            return np.float32(0)

        return tf.py_function(write, [value], tf.float32)

    def __repr__(self):
        return (
            f"<Variable path={self.path}, shape={tuple(self._held.shape)}, dtype={self.dtype}, "
            f"on the ps tasks: {', '.join(sorted(set(self._held.remote.devices)))}>"
        )


class TableWeight(_TableFace):
    """The layer's trainable weight for a ps-held table (`held`: its `_ps_tables.PsTable`)."""

    def __init__(self, held, **kwargs):
        self._held = held
        super().__init__(initializer="zeros", shape=(), dtype="float32", **kwargs)

    def _whole(self):
        return self._held.numpy()

    def _write_whole(self, value):
        self._held.assign(value)


class SlotWeight(_TableFace):
    """An optimizer slot (`slot`: "accumulator", "momentum" or "velocity") of a ps-held table."""

    def __init__(self, held, slot: str, fill: float, **kwargs):
        self._held, self._slot, self._fill = held, slot, fill
        super().__init__(shape=(), trainable=False, **kwargs)

    def _whole(self):
        return self._held.remote.slot(self._slot, self._fill)

    def _write_whole(self, value):
        self._held.remote.assign_slots({self._slot: value})


def slot_for(optimizer, reference, name: str, initializer) -> SlotWeight | None:
    """The slot `name` of `reference` when it is a `TableWeight`, tracked by `optimizer` as
    Keras's `add_variable_from_reference` tracks a slot; None for any other variable."""
    from tfstrat.ps.tables import SLOTS

    if not isinstance(reference, TableWeight):
        return None
    if name not in SLOTS:  # else Keras would make a whole table's slot on every worker
        layer = reference._held.layer.name
        raise UsageError(
            f"Received: {type(optimizer).__name__}, which keeps a {name!r} slot for "
            f"{reference.path}, a table Hybrid holds on the ps tasks. The ps updates its rows "
            "with SGD (with or without momentum), Adagrad, Adam (not amsgrad) or RMSprop (not "
            "centered), without EMA or gradient accumulation: use one of those, or keep this "
            f"table mirrored: Hybrid(sparse=['!{layer}'])."
        )
    initializer = keras.initializers.get(initializer)
    fill = float(np.asarray(initializer((), dtype="float32")))
    with keras.name_scope(optimizer.name, caller=optimizer):
        slot = SlotWeight(
            reference._held,
            name,
            fill,
            initializer=initializer,
            dtype=reference.dtype,
            name=f"{reference.path.replace('/', '_')}_{name}",
        )
    optimizer._track_variable(slot)
    return slot
