"""The collectives of a model-parallel step, between the devices of one mesh.

Inside a step every device of the mesh is one replica of `tf.distribute` and runs the same
program on its own parts (SPMD). Two groups matter:

- the **model group** of a replica: the devices that read the same slice of the batch and hold
  different parts of each sharded variable. A sharded layer's forward and backward passes
  exchange activations within it, with Megatron-LM's operators, each with its gradient:

  | operator | forward | backward |
  |---|---|---|
  | `copy` (Megatron's f) | identity | sum over the group |
  | `reduce` (Megatron's g) | sum over the group | identity |
  | `gather(axis)` | concatenate the parts | this device's part |
  | `split(axis)` | this device's part | concatenate the parts |

  They keep one invariant: a tensor that is whole on every device of a group has the same value
  and the same gradient on each, so a replicated variable's gradient needs no sum over the model
  axis.
- the **data group**: the devices that hold the same parts and read different slices of the
  batch. The step's gradients, its rows and its metric states are summed over it (and only over
  it): `DataAxisReduce`, the strategy's cross-device reduction.

Both are built in the step's graph from `merge_call` (the replicas' values meet in TensorFlow's
cross-replica context): each device sums or concatenates its group's values in a fixed order
(every device of a group gets bit-identical results), and TensorFlow moves the tensors between
the devices of this process.
"""

from __future__ import annotations

import tensorflow as tf

from tfstrat._compat.tf import values as tf_values
from tfstrat.mesh.layout import Mesh


def _mesh() -> Mesh:
    strategy = tf.distribute.get_strategy()
    return strategy.extended._tfstrat_mesh


def _over_model_group(x, combine):
    """`combine(replica, parts)` on each replica's device, where `parts` are `x` of the
    replicas of its model group, by model coordinate; each replica gets its own result."""
    context = tf.distribute.get_replica_context()
    mesh = _mesh()

    def merge(strategy, value):
        parts = value.values
        out = []
        for replica, device in enumerate(mesh.devices):
            with tf.device(device):
                out.append(combine(replica, [parts[g] for g in mesh.model_group(replica)]))
        return tf_values.PerReplica(out)

    return context.merge_call(merge, args=(x,))


def _sum(x):
    return _over_model_group(x, lambda _, parts: tf.add_n([tf.identity(p) for p in parts]))


def model_sum(x):
    """The sum of `x` over the model group (no gradient: for the norms of a step's parts)."""
    return _sum(x)


def _concat(x, axis: int):
    return _over_model_group(x, lambda _, parts: tf.concat(parts, axis))


def replica() -> int:
    """This replica's number in the mesh (known while its step is traced)."""
    context = tf.distribute.get_replica_context()
    return int(tf.get_static_value(context.replica_id_in_sync_group))


def _part(x, axis: int, parts: int):
    index = _mesh().model_index(replica())
    size = x.shape[axis] // parts
    begin = [0] * x.shape.rank
    begin[axis] = index * size
    shape = tf.unstack(tf.shape(x))
    shape[axis] = size
    return tf.slice(x, begin, tf.stack(shape))


def model_size() -> int:
    return _mesh().model_size


@tf.custom_gradient
def reduce(x):
    """Sum over the model group (Megatron's g): a row-parallel layer's partial outputs."""
    return _sum(x), lambda dy: tf.convert_to_tensor(dy)


@tf.custom_gradient
def copy(x):
    """Identity whose gradient is summed over the model group (Megatron's f): the whole input
    of a column-parallel layer."""
    return tf.identity(x), lambda dy: _sum(tf.convert_to_tensor(dy))


def gather(x, axis: int):
    """The parts of `x` along `axis` (each device holds part m), concatenated; the gradient is
    this device's part of the whole's."""
    axis = axis % x.shape.rank
    parts = model_size()

    @tf.custom_gradient
    def run(t):
        return _concat(t, axis), lambda dy: _part(tf.convert_to_tensor(dy), axis, parts)

    return run(x)


def split(x, axis: int):
    """This device's part of a whole `x` along `axis`; the gradient is the parts' gradients
    concatenated (the whole's gradient, the same on every device)."""
    axis = axis % x.shape.rank
    parts = model_size()

    @tf.custom_gradient
    def run(t):
        return _part(t, axis, parts), lambda dy: _concat(tf.convert_to_tensor(dy), axis)

    return run(x)


class DataAxisReduce(tf.distribute.CrossDeviceOps):
    """The strategy's reduction: sums over each data group only.

    A value reduced to every device of the mesh (the step's gradients and extras, a synchronized
    metric's update) gives each device the sum over its data group. Reduced to one device (a
    cross-replica `strategy.reduce`), it is the sum over the replicas of model coordinate 0: each
    slice of the batch counted once.
    """

    def __init__(self, mesh: Mesh):
        super().__init__()
        self.mesh = mesh

    def _parts(self, value):
        if isinstance(value, tf_values.DistributedValues):
            return list(value.values)
        return [value] * len(self.mesh.devices)

    def _reduce(self, reduce_op, value, destinations):
        from tfstrat._compat.tf import cross_device_ops

        parts = self._parts(value)
        mesh = self.mesh
        devices = cross_device_ops.get_devices_from(destinations)
        mean = reduce_op == tf.distribute.ReduceOp.MEAN
        if [_key(d) for d in devices] == [_key(d) for d in mesh.devices]:
            out = []
            for replica, device in enumerate(mesh.devices):
                with tf.device(device):
                    total = _sum_parts([parts[g] for g in mesh.data_group(replica)])
                    out.append(_scale(total, 1.0 / mesh.data_size) if mean else total)
            return tf_values.Mirrored(out)
        firsts = [parts[r] for r in range(len(mesh.devices)) if mesh.model_index(r) == 0]
        out = []
        for device in devices:
            with tf.device(device):
                total = _sum_parts(firsts)
                out.append(_scale(total, 1.0 / len(firsts)) if mean else total)
        return tf_values.Mirrored(out)

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        return self._reduce(reduce_op, per_replica_value, destinations)

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        return [self._reduce(reduce_op, v, d) for v, d in value_destination_pairs]

    def broadcast_implementation(self, tensor, destinations):
        from tfstrat._compat.tf import cross_device_ops

        out = []
        for device in cross_device_ops.get_devices_from(destinations):
            with tf.device(device):
                out.append(tf.identity(tensor))
        return tf_values.Mirrored(out)


def _key(device: str):
    spec = tf.DeviceSpec.from_string(device)
    return spec.device_type, spec.device_index


def _sum_parts(parts):
    """The sum of a data group's parts; row gradients (`IndexedSlices`) are concatenated, as one
    device's gradient of the whole batch holds every looked-up row."""
    if any(isinstance(p, tf.IndexedSlices) for p in parts):
        if not all(isinstance(p, tf.IndexedSlices) for p in parts):
            return tf.add_n([tf.convert_to_tensor(p) for p in parts])
        if len(parts) == 1:
            return tf.IndexedSlices(
                tf.identity(parts[0].values), tf.identity(parts[0].indices), parts[0].dense_shape
            )
        return tf.IndexedSlices(
            tf.concat([p.values for p in parts], 0),
            tf.concat([p.indices for p in parts], 0),
            parts[0].dense_shape,
        )
    return tf.add_n([tf.identity(p) for p in parts])


def _scale(value, factor):
    if isinstance(value, tf.IndexedSlices):
        return tf.IndexedSlices(value.values * factor, value.indices, value.dense_shape)
    return value * tf.cast(factor, value.dtype)
