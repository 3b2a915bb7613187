"""The cross-device all-reduce every tfstrat all-reduce strategy uses.

A subclass of TensorFlow's collective all-reduce (ring on CPUs, NCCL on GPUs) that changes two
things: how `IndexedSlices` are reduced (dedup, then one all-gather), and, with a `ring`
(`communication="tcp"`, one device per worker), dense floating-point tensors go out packed in
one call of tfstrat's TCP ring (`tfstrat.reduce.ring`) instead of TensorFlow's gRPC
collectives, and packed sparse rows in one ring all-gather. Otherwise dense tensors keep TensorFlow's packing (one collective per pack of
`bytes_per_pack`, or one for everything by default).
"""

from __future__ import annotations

import weakref

import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops
from tensorflow.python.util import nest

from tfstrat.reduce import sparse


class SparseAwareAllReduce(cross_device_ops.CollectiveAllReduce):
    """Collective all-reduce whose sparse path is dedup -> one all-gather, or densify.

    Args:
        devices: this process's replica devices.
        group_size: replicas across all workers.
        options: `tf.distribute.experimental.CommunicationOptions` (timeout, implementation).
        density: the `sparse.DensityPolicy` deciding sparse vs dense per gradient.
        collective_keys: shared with the strategy's other collectives.
    """

    def __init__(self, devices, group_size, options, density, collective_keys=None):
        super().__init__(devices, group_size, options, collective_keys)
        self.density = density
        #: A `tfstrat.reduce.ring.Ring` when dense all-reduces go over tfstrat's TCP ring
        #: (one device per worker); None: TensorFlow's collectives.
        self.ring = None
        self._last_ring_op = weakref.WeakKeyDictionary()  # graph -> its last ring op
        #: What replica 0 sent, recorded at trace time: `("all_reduce", [shapes])` for a dense
        #: pack, `("all_gather", shape)` for a packed sparse gradient. For tests and debugging.
        self.traced: list[tuple] = []
        #: `(kind, bytes this worker hands to the collective)` for the last traced call
        #: (a training step's gradients, when the last function traced was a train step).
        self.last_call: list[tuple[str, int]] = []

    def _record(self, replica_id, kind, shapes, tensors):
        if replica_id != 0 or tf.executing_eagerly():  # traced steps only, not metric reads
            return
        self.traced.append((kind, shapes))
        # A tensor of unknown static size counts 0: a lower bound, never a crash.
        nbytes = sum((t.shape.num_elements() or 0) * t.dtype.size for t in tensors)
        self.last_call.append((kind, nbytes))

    def bytes_sent_per_worker(self) -> int:
        """Bytes one worker sends for the last traced call, by ring-collective arithmetic:
        an all-reduce of S bytes sends 2(n-1)/n x S; an all-gather of S sends (n-1) x S."""
        n = self._group_size
        total = 0
        for kind, nbytes in self.last_call:
            total += nbytes * (2 * (n - 1) / n if kind == "all_reduce" else n - 1)
        return int(total)

    def _all_reduce(self, reduce_op, value, replica_id, options):
        flat = nest.flatten(value)
        if replica_id == 0 and not tf.executing_eagerly():
            self.last_call = []
        rows = {}  # position -> static row count before dedup (dedup's count is dynamic)
        for i, v in enumerate(flat):
            if isinstance(v, tf.IndexedSlices):
                densify = self.density.densify(v, self._group_size)
                rows[i] = sparse.static_rows(v)
                with tf.device(self._devices[replica_id]):
                    v = sparse.dedup(v)
                    flat[i] = tf.convert_to_tensor(v) if densify else v
                if densify:
                    del rows[i]
        dense_at = [i for i in range(len(flat)) if i not in rows]
        if dense_at:
            dense = [flat[i] for i in dense_at]
            self._record(replica_id, "all_reduce", [tuple(t.shape) for t in dense], dense)
            if self._ring_carries(dense):
                reduced = self._ring_all_reduce(reduce_op, dense)
            else:
                reduced = super()._all_reduce(reduce_op, dense, replica_id, options)
            for i, r in zip(dense_at, reduced):
                flat[i] = r
        for i, n in rows.items():
            flat[i] = self._gather_slices(reduce_op, flat[i], n, replica_id, options)
        return nest.pack_sequence_as(value, flat)

    def _ring_carries(self, dense) -> bool:
        dtypes = {t.dtype for t in dense}
        static = all(t.shape.is_fully_defined() for t in dense)
        return self.ring is not None and static and len(dtypes) == 1 and dtypes.pop().is_floating

    def _ring_call(self, fn, tensor, shape, name):
        """`fn(tensor)` (a ring method) in the graph, after the graph's previous ring call.

        Ring calls must run in the same order on every worker: within a graph each one waits
        for the previous (control dependency); graphs and eager calls run one at a time.
        """
        graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        last = self._last_ring_op.get(graph) if graph is not None else None
        with tf.control_dependencies([last] if last is not None else []):
            out = tf.numpy_function(fn, [tensor], tensor.dtype, stateful=True, name=name)
        if graph is not None:
            self._last_ring_op[graph] = out.op
        out.set_shape(shape)
        return out

    def _ring_all_reduce(self, reduce_op, dense):
        """One TCP ring all-reduce for every dense tensor: packed into one flat vector."""
        with tf.device(self._devices[0]):
            flat = tf.concat([tf.reshape(t, [-1]) for t in dense], 0)
            summed = self._ring_call(self.ring.all_reduce, flat, flat.shape, "tcp_all_reduce")
            if reduce_op == tf.distribute.ReduceOp.MEAN:
                summed = summed / self._group_size
            parts = tf.split(summed, [t.shape.num_elements() for t in dense])
            return [tf.reshape(p, t.shape) for p, t in zip(parts, dense)]

    def _gather_slices(self, reduce_op, slices, rows, replica_id, options):
        launcher = self._launchers[replica_id]
        row_shape = slices.values.shape[1:]
        packable = slices.values.dtype == tf.float32 and row_shape.is_fully_defined()
        with tf.device(self._devices[replica_id]):
            if packable and self.ring is not None:
                # The TCP ring takes blocks of any row count (a dataset's last batch, say).
                packed = sparse.pack_rows(slices, rows)
                if rows is not None:
                    self._record(replica_id, "all_gather", tuple(packed.shape), [packed])
                shape = [None if rows is None else self._group_size * rows, packed.shape[1]]
                everyone = self._ring_call(self.ring.all_gather, packed, shape, "tcp_all_gather")
                gathered = sparse.unpack_rows(everyone, slices)
            elif rows is None or not packable:
                # Row count unknown or not float32: TensorFlow's 3-collective padded gather.
                gathered = sparse.dedup(launcher.all_reduce_indexed_slices(slices, options))
            else:
                packed = sparse.pack_rows(slices, rows)
                self._record(replica_id, "all_gather", tuple(packed.shape), [packed])
                gathered = sparse.unpack_rows(launcher.all_gather(packed, 0, options), slices)
            if reduce_op == tf.distribute.ReduceOp.MEAN:
                gathered = tf.IndexedSlices(
                    gathered.values / self._group_size, gathered.indices, gathered.dense_shape
                )
        return gathered
