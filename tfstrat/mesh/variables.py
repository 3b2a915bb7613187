"""Sharded variables: each device holds its part; Keras sees the whole.

A sharded Keras variable is backed by a `tf.distribute` mirrored variable whose component on
each device is that device's part (`ModelParallel`'s extended object creates it: the whole
initial value is drawn once, as on one device, and each device keeps its slice; optimizer slots,
created beside their variable, are split the same way). Inside a step a device reads its own
part, and the optimizer updates each part with its own gradient.

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
    """A Keras variable whose value is split over the model axis (set by `adopt`)."""

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
        """This device's part (in a step), as a tensor."""
        return tf.convert_to_tensor(self._value)

    def _parts(self) -> list:
        """One component per part, by model coordinate (this process holds every part: its
        devices hold whole model groups)."""
        mesh = self._tfstrat_mesh
        components = self._value.values
        first = mesh.data_index(mesh.local[0])
        group = [k for k, r in enumerate(mesh.local) if mesh.data_index(r) == first]
        return [components[k] for k in sorted(group, key=lambda k: mesh.model_index(mesh.local[k]))]

    def whole(self):
        """The whole value as a tensor, outside a step (the parts concatenated)."""
        return tf.concat([tf.convert_to_tensor(p) for p in self._parts()], self.sharding.dim)

    def numpy(self):
        return np.concatenate([p.numpy() for p in self._parts()], axis=self.sharding.dim)

    def __array__(self, dtype=None, copy=None):
        whole = self.numpy()
        return whole if dtype is None else whole.astype(dtype)

    def _direct_assign(self, value):
        mesh = self._tfstrat_mesh
        value = tf.convert_to_tensor(value, self._value.dtype)
        for k, component in enumerate(self._value.values):
            component.assign(self.sharding.take(value, mesh.model_index(mesh.local[k])))

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
