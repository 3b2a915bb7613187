"""Sharded variables: each device holds its part; Keras sees the whole.

A sharded Keras variable is backed by a `tf.distribute` mirrored variable whose component on
each device is that device's part (`ModelParallel`'s extended object creates it: the whole
initial value is drawn once, as on one device, and each device keeps its slice; optimizer slots,
created beside their variable, are split the same way). Inside a step a device reads its own
part, and the optimizer updates each part with its own gradient.

A variable sharded over the batch axis too (FSDP) holds one block per device; inside a step
`local()` all-gathers the blocks of the device's model part, and the gradient is
reduce-scattered back to the blocks (`tfstrat.mesh.collectives.gather_batch`).

Outside a step Keras sees the whole (`ShardedVariable`): `numpy()` concatenates the parts and
`assign(whole)` writes each device's part, so `model.save`, `save_weights`, `ModelCheckpoint`,
`BackupAndRestore` and `tf.train.Checkpoint` write plain Keras (TensorFlow) files and load them
back. Its `shape` is the whole's.

A layer whose computation tfstrat does not shard reads the whole value inside its call
(`gathered`): the parts are concatenated for that call, and the gradient of each part is its
slice of the whole's.
"""

from __future__ import annotations

import contextlib
import threading

import keras
import numpy as np
import tensorflow as tf

from tfstrat.mesh.layout import Sharding

_reads = threading.local()  # id(variable) -> the whole value its layer reads in this call


class ShardedVariable(keras.Variable):
    """A Keras variable whose value is split over the model axis, or sharded over the batch
    axis, or both (set by `adopt`)."""

    _tfstrat_sharding: Sharding

    @property
    def sharding(self) -> Sharding:
        return self._tfstrat_sharding

    @property
    def shape(self):
        return tf.TensorShape(self._tfstrat_sharding.shape)  # the whole's

    @property
    def value(self):
        whole = (getattr(_reads, "whole", None) or {}).get(id(self))
        if whole is not None:
            return self._maybe_autocast(whole)
        return super().value

    def local(self):
        """This device's model part, in a step, as a tensor: the device's own value, or, for a
        variable sharded over the batch axis too, its blocks all-gathered over that axis."""
        value = tf.convert_to_tensor(self._value)
        if self._tfstrat_sharding.fsdp:
            from tfstrat.mesh import collectives

            return collectives.gather_batch(value, self._tfstrat_sharding.batch_dim)
        return value

    def _blocks(self) -> dict:
        """(model part, batch part) -> this process's component holding that block (one
        process holds every block of a variable it shards over the batch axis, and every
        model part of the others)."""
        mesh, sharding = self._tfstrat_mesh, self._tfstrat_sharding
        first = mesh.data_index(mesh.local[0])
        blocks = {}
        for k, r in enumerate(mesh.local):
            b = mesh.data_index(r)
            if sharding.fsdp or b == first:
                blocks[(mesh.model_index(r) if sharding.dim is not None else 0,
                        b if sharding.fsdp else 0)] = self._value.values[k]  # fmt: skip
        return blocks

    def whole(self):
        """The whole value as a tensor, outside a step (the blocks joined)."""
        blocks = {k: tf.convert_to_tensor(v) for k, v in self._blocks().items()}
        return self.sharding.assemble(blocks, lambda xs, axis: tf.concat(xs, axis))

    def numpy(self):
        blocks = {k: v.numpy() for k, v in self._blocks().items()}
        return self.sharding.assemble(blocks, lambda xs, axis: np.concatenate(xs, axis=axis))

    def __array__(self, dtype=None, copy=None):
        whole = self.numpy()
        return whole if dtype is None else whole.astype(dtype)

    def _direct_assign(self, value):
        mesh, sharding = self._tfstrat_mesh, self.sharding
        value = tf.convert_to_tensor(value, self._value.dtype)
        for k, component in enumerate(self._value.values):
            r = mesh.local[k]
            component.assign(sharding.take(value, mesh.model_index(r), mesh.data_index(r)))

    # tf.train.Checkpoint (custom loops) saves the whole value under a plain variable's key,
    # so its checkpoints restore on one device, or on another mesh, and back.

    def _serialize_to_tensors(self):
        return {"VARIABLE_VALUE": self.whole()}

    def _restore_from_tensors(self, restored_tensors):
        self._direct_assign(restored_tensors["VARIABLE_VALUE"])
        return tf.no_op()


def adopt(variable, mesh) -> None:
    """Makes `variable` (a Keras variable just created on sharded parts) a `ShardedVariable`."""
    variable._tfstrat_sharding = variable._value._tfstrat_sharding
    variable._tfstrat_mesh = mesh
    variable.__class__ = ShardedVariable


def is_sharded(variable) -> bool:
    return isinstance(variable, ShardedVariable)


@contextlib.contextmanager
def whole_reads(wholes: dict):
    """Within: the variables (by id) in `wholes` read as the given whole tensors."""
    previous = getattr(_reads, "whole", None)
    _reads.whole = {**(previous or {}), **wholes}
    try:
        yield
    finally:
        _reads.whole = previous
