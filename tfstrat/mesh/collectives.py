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
cross-replica context). A model group's sum is one NCCL all-reduce when its devices are GPUs
NCCL can join (`strategies.model_parallel.model_exchange`: the rule MirroredNCCL's gradients
follow); elsewhere (logical
CPUs, where a TensorFlow collective costs about 1.4 ms a call) each device adds its group's
copies in a fixed order, and TensorFlow moves the tensors between the devices of this process.
Either way every device of a group gets bit-identical results. Concatenations are copies.
"""

from __future__ import annotations

import tensorflow as tf

from tfstrat._compat.tf import values as tf_values
from tfstrat.errors import UsageError
from tfstrat.mesh.layout import Mesh
from tfstrat.reduce.cross_device import RingCalls, packable


class Traffic:
    """Bytes one device moves in the steps run while counting (`start()`; off by default: no
    op is added to a step), by ring arithmetic: an all-reduce of S bytes over a group of n
    moves 2(n-1)/n x S; an all-gather of n parts of S bytes each (n - 1) x S. Counted as the
    steps run (sizes known then), for the first of this process's replicas, by kind: "model
    axis" (the layers' exchanges) and "batch axis" (the step's sums)."""

    def __init__(self):
        self.counters: dict[str, tf.Variable] | None = None

    def start(self) -> None:
        with tf.init_scope(), tf.device("/device:CPU:0"):
            self.counters = {
                kind: tf.Variable(0.0, dtype=tf.float64, trainable=False)
                for kind in ("model axis", "batch axis")
            }

    def read(self) -> dict[str, float]:
        return {k: float(v.numpy()) for k, v in (self.counters or {}).items()}

    def add(self, kind: str, x, factor: float) -> None:
        if self.counters is None:
            return
        x = x.values if isinstance(x, tf.IndexedSlices) else x
        nbytes = tf.cast(tf.size(x), tf.float64) * (x.dtype.size * factor)
        with tf.device("/device:CPU:0"):
            self.counters[kind].assign_add(nbytes)


def _traffic() -> Traffic | None:
    ops = getattr(tf.distribute.get_strategy().extended, "_cross_device_ops", None)
    return getattr(ops, "traffic", None)


def _mesh() -> Mesh:
    strategy = tf.distribute.get_strategy()
    return strategy.extended._tfstrat_mesh


def _over_model_group(x, combine, data: bool = False):
    """`combine(replica, parts)` on each replica's device, where `parts` are `x` of the
    replicas of its model group, by model coordinate (`data`: of its data group, by batch
    coordinate; one process holds the mesh's devices then); each replica gets its own
    result."""
    context = tf.distribute.get_replica_context()
    mesh = _mesh()
    group_of = mesh.data_group if data else mesh.model_group

    def merge(strategy, value):
        parts = value.values  # this process's replicas'
        out = []
        for k, replica in enumerate(mesh.local):
            with tf.device(mesh.local_devices[k]):
                group = [parts[mesh.position(g)] for g in group_of(replica)]
                out.append(combine(replica, group))
        return tf_values.PerReplica(out)

    return context.merge_call(merge, args=(x,))


def over_model_groups(parts: list, mesh: Mesh, all_sum, group_of=None) -> list:
    """`all_sum(the group's parts)` once per model group of this process's replicas (`parts`
    by position, one per replica); each replica gets its own result, in place. `group_of`:
    another grouping (`Mesh.data_group`)."""
    group_of = group_of or mesh.model_group
    out: list = [None] * len(parts)
    for k, replica in enumerate(mesh.local):
        if out[k] is None:
            members = [mesh.position(g) for g in group_of(replica)]
            for m, total in zip(members, all_sum([parts[m] for m in members])):
                out[m] = total
    return out


# The dtypes `NcclAllReduce` has kernels for (its op definition, TF 2.19-2.21).
NCCL_DTYPES = frozenset({tf.float16, tf.float32, tf.float64, tf.int32, tf.int64})


def nccl_dtype(dtype) -> tf.DType | None:
    """The dtype a tensor of `dtype` crosses NCCL in: its own when NCCL has a kernel for it,
    float32 for other floating dtypes (bfloat16 under `mixed_bfloat16`: exact, as bfloat16
    is float32 with fewer mantissa bits; the sum is rounded back once), None otherwise."""
    dtype = tf.as_dtype(dtype)
    if dtype in NCCL_DTYPES:
        return dtype
    return tf.float32 if dtype.is_floating else None


def nccl_all_sum(parts: list) -> list:
    """`nccl_ops.all_sum` of `parts` (one per device), cast to `nccl_dtype` and back."""
    from tfstrat._compat.tf import nccl_ops

    dtype = tf.as_dtype(parts[0].dtype)
    wire = nccl_dtype(dtype)
    if wire is None:
        raise TypeError(
            f"NCCL cannot sum {dtype.name} tensors (only {sorted(d.name for d in NCCL_DTYPES)})"
        )
    if wire == dtype:
        return nccl_ops.all_sum(parts)
    cast = lambda t, to: tf.cast(t, to) if not t.device else _on(t.device, tf.cast, t, to)  # noqa: E731
    sums = nccl_ops.all_sum([cast(p, wire) for p in parts])  # each on its part's device
    return [cast(t, dtype) for t in sums]


def _on(device: str, fn, *args):
    with tf.device(device):
        return fn(*args)


def _nccl_sum(x):
    """The sum over each model group, one NCCL all-reduce per group."""
    mesh = _mesh()

    def merge(strategy, value):
        return tf_values.PerReplica(over_model_groups(list(value.values), mesh, nccl_all_sum))

    return tf.distribute.get_replica_context().merge_call(merge, args=(x,))


def _record(x, factor: float) -> None:
    traffic, mesh = _traffic(), _mesh()
    context = tf.distribute.get_replica_context()
    if traffic is not None and context is not None and replica() == mesh.local[0]:
        traffic.add("model axis", x, factor)


def _sum(x):
    n = model_size()
    _record(x, 2 * (n - 1) / n)
    if n > 1 and getattr(_extended(), "_tfstrat_model_exchange", "copies") == "nccl":
        return _nccl_sum(x)
    return _over_model_group(x, lambda _, parts: tf.add_n([tf.identity(p) for p in parts]))


def _extended():
    return tf.distribute.get_strategy().extended


def model_sum(x):
    """The sum of `x` over the model group, outside any gradient (a step's norms)."""
    return _sum(x)


def _concat(x, axis: int):
    _record(x, model_size() - 1)  # this device's part to every other device
    return _over_model_group(x, lambda _, parts: tf.concat(parts, axis))


def replica() -> int:
    """This replica's number in the mesh (known while its step is traced)."""
    context = tf.distribute.get_replica_context()
    return int(tf.get_static_value(context.replica_id_in_sync_group))


def _part(x, axis: int, parts: int):
    index = _mesh().model_index(replica())
    whole = x.shape[axis]
    if whole is None:
        whole = tf.shape(x)[axis]
    elif whole % parts:
        raise UsageError(
            f"tfstrat ModelParallel: a tensor of shape {tuple(x.shape)} splits over the model "
            f"axis ({parts} devices) along axis {axis}, whose size does not divide."
        )
    size = whole // parts
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


# --- the batch axis inside a step: FSDP's all-gather and reduce-scatter --------------------


def data_sum(x):
    """The sum of `x` over the data group, outside any gradient (a step's norms)."""
    return _over_model_group(x, lambda _, parts: tf.add_n([tf.identity(p) for p in parts]), True)


def _weighted(dy):
    """`dy` weighted as the step's exact rule weighs a replica's gradient before the step's
    sum (`tfstrat.strategies._exact_step`): by R n_r when Keras scaled this step's loss."""
    from tfstrat.runtime.step import row_weight

    weight = row_weight(tf.distribute.get_strategy().num_replicas_in_sync, dy.dtype)
    # a replica without rows: weight 0
    return dy if weight is None else tf.math.multiply_no_nan(dy, weight)


def gather_batch(x, axis: int):
    """This device's block `x` of a variable sharded over the batch axis, all-gathered along
    `axis` over the data group (FSDP's forward read). The gradient is reduce-scattered: the
    data group's gradients, weighted by rows as the step's sum weighs them, summed, and each
    device keeps its block's rows. The step's reduction leaves such a gradient as it is
    (already summed over the batch axis) and divides it by the step's rows like the others."""
    axis = axis % x.shape.rank
    mesh = _mesh()
    parts = mesh.data_size

    @tf.custom_gradient
    def run(t):
        traffic = _traffic()
        if traffic is not None and replica() == mesh.local[0]:
            traffic.add("batch axis", t, parts - 1)
        whole = _over_model_group(t, lambda _, group: tf.concat(group, axis), data=True)

        def grad(dy):
            if isinstance(dy, tf.IndexedSlices):  # a table's rows: kept as rows
                dy = tf.IndexedSlices(_weighted(dy.values), dy.indices, dy.dense_shape)
                if traffic is not None and replica() == mesh.local[0]:
                    traffic.add("batch axis", dy, parts - 1)
                return _over_model_group(
                    dy, lambda r, group: _rows_block(group, r, t, axis), data=True
                )
            # the gradient can lose its static shape (a Dense kernel's on 3-D inputs)
            dy = _weighted(tf.ensure_shape(tf.convert_to_tensor(dy), whole.shape))
            if traffic is not None and replica() == mesh.local[0]:
                traffic.add("batch axis", dy, (parts - 1) / parts)

            def block(r, total):
                begin = [0] * total.shape.rank
                begin[axis] = mesh.data_index(r) * t.shape[axis]
                return tf.slice(total, begin, t.shape)

            if _data_exchange() == "nccl":  # GPUs: one NCCL all-reduce per data group
                return block(replica(), _nccl_data_sum(dy))
            return _over_model_group(
                dy, lambda r, group: block(r, tf.add_n([tf.identity(g) for g in group])), True
            )

        return whole, grad

    return run(x)


def _data_exchange() -> str:
    """How the batch axis sums in this process: "nccl" or "copies" (`DataAxisReduce`)."""
    return getattr(getattr(_extended(), "_cross_device_ops", None), "exchange", "copies")


def _nccl_data_sum(x):
    """The sum over each data group, one NCCL all-reduce per group."""
    mesh = _mesh()

    def merge(strategy, value):
        sums = over_model_groups(list(value.values), mesh, nccl_all_sum, mesh.data_group)
        return tf_values.PerReplica(sums)

    return tf.distribute.get_replica_context().merge_call(merge, args=(x,))


def _rows_block(group, replica: int, block, axis: int):
    """The data group's row gradients (`IndexedSlices` of the model part) concatenated, as one
    device's gradient of the whole batch holds every looked-up row, cut to `replica`'s block
    (`block`: its value): its columns (`axis` 1+), or its rows (`axis` 0: the rows it holds,
    renumbered from its first)."""
    values = tf.concat([tf.identity(g.values) for g in group], 0)
    indices = tf.concat([tf.identity(g.indices) for g in group], 0)
    shape = tf.constant(block.shape.as_list(), dtype=tf.int64)
    size = block.shape[axis]
    lo = _mesh().data_index(replica) * size
    if axis == 0:
        inside = tf.logical_and(indices >= lo, indices < lo + size)
        values = tf.boolean_mask(values, inside)
        indices = tf.boolean_mask(indices, inside) - tf.cast(lo, indices.dtype)
        return tf.IndexedSlices(values, indices, tf.cast(shape, indices.dtype))
    begin = [0] * values.shape.rank
    begin[axis] = lo
    sizes = [-1] * values.shape.rank
    sizes[axis] = size
    return tf.IndexedSlices(tf.slice(values, begin, sizes), indices, shape)


def summed_in_backward(variable) -> bool:
    """Whether `variable`'s gradient arrives summed over the batch axis (FSDP)."""
    sharding = getattr(variable, "_tfstrat_sharding", None)
    return sharding is not None and sharding.fsdp


class DataAxisReduce(tf.distribute.CrossDeviceOps):
    """The strategy's reduction: sums over each data group only.

    A value reduced to every device of this process (the step's gradients and extras, a
    synchronized metric's update) gives each device the sum over its data group: this
    process's members first, then, across workers, one exchange of tfstrat's ring for every
    model coordinate at once (`ring`; None in one process). Reduced to one device (a
    cross-replica `strategy.reduce`), it is the sum over the replicas of model coordinate 0:
    each slice of the batch counted once.
    """

    def __init__(self, mesh: Mesh, ring=None):
        super().__init__()
        self.mesh = mesh
        self.ring = ring
        self.traffic = Traffic()
        self._ring_calls = RingCalls()
        # "nccl": in one process, a data group of GPUs sums dense values in one NCCL
        # all-reduce (set by the strategy from a data group's devices).
        self.exchange = "copies"

    @property
    def _num_between_graph_workers(self):
        # More than one: TensorFlow's shortcuts that return a one-device value unreduced
        # (cross_device_ops.py) must not apply to one device per worker.
        return self.ring.size if self.ring is not None else 1

    def _parts(self, value):
        """One value per device of this process (a value given once: the same on each)."""
        parts = list(value.values) if isinstance(value, tf_values.DistributedValues) else [value]
        return parts if len(parts) == len(self.mesh.local) else parts[:1] * len(self.mesh.local)

    def _to_every_device(self, destinations) -> bool:
        from tfstrat._compat.tf import cross_device_ops

        devices = cross_device_ops.get_devices_from(destinations)
        return [_key(d) for d in devices] == [_key(d) for d in self.mesh.local_devices]

    def _local_sums(self, value) -> tuple[list[int], list]:
        """(the model coordinates of this process, the sum of each one's local members)."""
        parts, mesh = self._parts(value), self.mesh
        model_of = [mesh.model_index(r) for r in mesh.local]
        coordinates, sums = sorted(set(model_of)), []
        n, first = mesh.data_size, parts[0]
        gathers = isinstance(first, tf.IndexedSlices)  # rows: all-gathered
        if n > 1:
            self.traffic.add("batch axis", first, (n - 1) * (1 if gathers else 2 / n))
        for m in coordinates:
            members = [k for k in range(len(parts)) if model_of[k] == m]
            with tf.device(mesh.local_devices[members[0]]):
                sums.append(_sum_parts([parts[k] for k in members]))
        return coordinates, sums

    def _spread(self, reduce_op, coordinates, sums):
        """Each device its model coordinate's sum (over the batch axis: divided for MEAN)."""
        mesh, out = self.mesh, []
        for k, device in enumerate(mesh.local_devices):
            with tf.device(device):
                total = _copy(sums[coordinates.index(mesh.model_index(mesh.local[k]))])
                mean = reduce_op == tf.distribute.ReduceOp.MEAN
                out.append(_scale(total, mesh.data_size) if mean else total)
        return tf_values.PerReplica(out)  # one value per model coordinate

    def _nccl_sums(self, reduce_op, value):
        """Each device its data group's sum, one NCCL all-reduce per group (one process)."""
        parts, mesh = self._parts(value), self.mesh
        n = mesh.data_size
        if n > 1:
            self.traffic.add("batch axis", parts[0], 2 * (n - 1) / n)
        out: list = [None] * len(parts)
        for m in sorted({mesh.model_index(r) for r in mesh.local}):
            members = [k for k, r in enumerate(mesh.local) if mesh.model_index(r) == m]
            for k, total in zip(members, nccl_all_sum([parts[k] for k in members])):
                mean = reduce_op == tf.distribute.ReduceOp.MEAN
                out[k] = _scale(total, n) if mean else total
        return tf_values.PerReplica(out)

    def _reduce(self, reduce_op, value, destinations):
        if self._to_every_device(destinations):
            parts = self._parts(value)
            floats = all(  # NCCL's kind of value: dense, floating point (`nccl_dtype`)
                not isinstance(p, tf.IndexedSlices) and tf.as_dtype(p.dtype).is_floating
                for p in parts
            )
            if self.exchange == "nccl" and self.ring is None and floats and len(parts) > 1:
                return self._nccl_sums(reduce_op, value)
            coordinates, sums = self._local_sums(value)
            return self._spread(reduce_op, coordinates, self._across_workers(sums))
        from tfstrat._compat.tf import cross_device_ops

        mesh = self.mesh
        firsts = [p for p, r in zip(self._parts(value), mesh.local) if mesh.model_index(r) == 0]
        with tf.device(mesh.local_devices[0]):
            total = self._across_workers([_sum_parts(firsts)])[0]
        out = []
        for device in cross_device_ops.get_devices_from(destinations):
            with tf.device(device):
                total = _copy(total)
                mean = reduce_op == tf.distribute.ReduceOp.MEAN
                out.append(_scale(total, mesh.data_size) if mean else total)
        return tf_values.Mirrored(out)

    def _batch(self, reduce_op, pairs):
        """Several values in one ring exchange (a step's gradients and extras)."""
        if not all(self._to_every_device(d) for _, d in pairs):
            return [self._reduce(reduce_op, v, d) for v, d in pairs]
        plans, flat = [], []
        for value, _ in pairs:
            coordinates, sums = self._local_sums(value)
            plans.append((coordinates, len(flat), len(sums)))
            flat += sums
        flat = self._across_workers(flat)
        return [self._spread(reduce_op, c, flat[at : at + n]) for c, at, n in plans]

    def _across_workers(self, values: list) -> list:
        """`values` summed over the workers in one ring exchange (dense ones summed, row
        gradients' rows gathered); unchanged in one process."""
        if self.ring is None:
            return values
        from tfstrat.reduce import sparse

        dense = [i for i, v in enumerate(values) if not isinstance(v, tf.IndexedSlices)]
        rows = [i for i in range(len(values)) if i not in dense]
        inputs, shapes = [], []
        if dense:
            # float32 when every value is (the ring's bytes); else float64, exact for the
            # counts and float32 sums it carries.
            same = all(values[i].dtype == tf.float32 for i in dense)
            dtype = tf.float32 if same else tf.float64
            flat = tf.concat([tf.reshape(tf.cast(values[i], dtype), [-1]) for i in dense], 0)
            inputs.append(flat)
            shapes.append(flat.shape)
        for i in rows:
            if not packable(values[i]):
                raise UsageError(
                    f"tfstrat ModelParallel: a row gradient of dtype {values[i].values.dtype.name}"
                    f" and rows {values[i].values.shape[1:]} cannot cross workers: tables "
                    "across workers need float32 rows of a static width."
                )
            packed = sparse.pack_rows(values[i], None)
            inputs.append(packed)
            shapes.append([None, packed.shape[1]])
        ring = self.ring

        def exchange(*arrays):
            summed, gathered = ring.exchange(
                arrays[0] if dense else None, list(arrays[1 if dense else 0 :])
            )
            return ([summed.copy()] if dense else []) + gathered

        with tf.device("/device:CPU:0"):
            outs = self._ring_calls.call(exchange, inputs, shapes, "mesh_batch_axis")
        out = list(values)
        if dense:
            sizes = [values[i].shape.num_elements() for i in dense]
            if None in sizes:
                raise UsageError(
                    "tfstrat ModelParallel: a value summed across workers has an unknown shape "
                    f"({[tuple(values[i].shape) for i in dense]}); give it a static one."
                )
            for i, piece in zip(dense, tf.split(outs[0], sizes)):
                out[i] = tf.cast(tf.reshape(piece, values[i].shape), values[i].dtype)
        for i, everyone in zip(rows, outs[1 if dense else 0 :]):
            like = values[i]
            index = tf.cast(tf.bitcast(everyone[:, 0], tf.int32), like.indices.dtype)
            shape = tf.concat([[-1], tf.shape(like.values)[1:]], 0)
            out[i] = tf.IndexedSlices(tf.reshape(everyone[:, 1:], shape), index, like.dense_shape)
        return out

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        return self._reduce(reduce_op, per_replica_value, destinations)

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        if self.ring is None or len(value_destination_pairs) < 2:
            return [self._reduce(reduce_op, v, d) for v, d in value_destination_pairs]
        # Several values: one ring exchange for all of them (the step's gradients and extras).
        return self._batch(reduce_op, value_destination_pairs)

    def _gather_implementation(self, per_replica_value, destinations, axis, options):
        """Every replica's value concatenated along `axis` in replica order (this process's,
        then across workers by rank): what Keras's multi-worker `predict` gathers."""
        from tfstrat._compat.tf import cross_device_ops

        value = per_replica_value  # a one-value PerReplica: this worker's own tensor, once
        parts = list(value.values) if isinstance(value, tf_values.DistributedValues) else [value]
        with tf.device(self.mesh.local_devices[0]):
            local = tf.concat([tf.convert_to_tensor(p) for p in parts], axis)
        with tf.device("/device:CPU:0"):
            if self.ring is not None:
                if axis != 0:
                    raise NotImplementedError("tfstrat ModelParallel gathers along axis 0 only")
                ring = self.ring
                shape = [None, *local.shape[1:]]
                local = self._ring_calls.call(
                    lambda x: [ring.all_gather(x)], [local], [shape], "mesh_gather"
                )[0]
        out = []
        for device in cross_device_ops.get_devices_from(destinations):
            with tf.device(device):
                out.append(tf.identity(local))
        return tf_values.Mirrored(out)

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


def _copy(value):
    if isinstance(value, tf.IndexedSlices):
        return tf.IndexedSlices(
            tf.identity(value.values), tf.identity(value.indices), value.dense_shape
        )
    return tf.identity(value)


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


def _scale(value, count: int):
    """`value` divided by `count` (a MEAN; integer division for integers)."""
    if isinstance(value, tf.IndexedSlices):
        return tf.IndexedSlices(_scale(value.values, count), value.indices, value.dense_shape)
    if value.dtype.is_integer:
        return value // count
    return value / tf.cast(count, value.dtype)
