"""The cross-device all-reduce every tfstrat all-reduce strategy uses.

A subclass of TensorFlow's collective all-reduce (ring on CPUs, NCCL on GPUs) that changes three
things:

- how `IndexedSlices` are reduced (dedup, then one all-gather);
- with a `ring` (`communication="tcp"`), dense floating-point tensors go out packed in one call
  of tfstrat's TCP ring (`tfstrat.reduce.ring`) instead of TensorFlow's gRPC collectives, and
  packed sparse rows in one ring all-gather;
- several devices of one process that NCCL does not join (logical CPUs, virtual GPUs) are
  summed by this process itself: each value's replicas copied to the first device and added in
  replica order (`add_n`), the sum crossing workers on the ring once, then copied back to every
  device. TensorFlow's collectives keep a record of every collective instance they ever ran for
  the life of the process (`CollectiveParamResolverLocal`'s instance table, never erased in TF
  2.21; tensorflow#42616): with them in every step, memory grows with the run.

Otherwise dense tensors keep TensorFlow's packing (one collective per pack of `bytes_per_pack`,
or one for everything by default).
"""

from __future__ import annotations

import logging
import weakref

import tensorflow as tf

from tfstrat._compat.tf import cross_device_ops, in_control_flow, nest
from tfstrat._compat.tf import values as tf_values
from tfstrat.errors import UsageError
from tfstrat.reduce import compression, sparse

logger = logging.getLogger(__name__)


_STATES_KEPT = 4  # PowerSGD states kept for earlier sets of variables (models)


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
        self._ring_calls = RingCalls()
        self._summing = False  # in `_local_sums`: the worker's sum goes to the ring
        #: None, "fp16", "bf16" or a `compression.PowerSGD`: how the step's dense gradients
        #: travel on the ring (set by the strategy; `tfstrat.reduce.compression`).
        self.compression = None
        # PowerSGD's state (error feedback, Q, steps) per set of variables, newest last: a new
        # model starts afresh, even with the same shapes.
        self._compressed: dict[tuple, compression.PowerSGDState] = {}
        #: A list (tests set one before the step is traced): every compressed exchange appends
        #: {"raw": this worker's gradients before compression, "reduced": the sum after},
        #: flat float32. None: nothing is recorded.
        self.trace: list | None = None
        #: What replica 0 sent, recorded at trace time: `("all_reduce", [shapes])` for a dense
        #: pack, `("all_gather", shape)` for a packed sparse gradient; a worker's sums of its
        #: devices (`sums_locally`): `("local_sum", [shapes])` for one call's dense values and
        #: `("local_rows", [rows, width])` for each sparse gradient kept as rows (one
        #: replica's rows before dedup). For tests and debugging.
        self.traced: list[tuple] = []
        #: `(kind, bytes this worker hands to the collective)` for the last traced call
        #: (a training step's gradients, when the last function traced was a train step).
        self.last_call: list[tuple[str, int]] = []

    def _record(self, replica_id, kind, shapes, nbytes):
        if replica_id != 0 or tf.executing_eagerly():  # traced steps only, not metric reads
            return
        self.traced.append((kind, shapes))
        self.last_call.append((kind, nbytes))

    def bytes_sent_per_worker(self) -> int:
        """Bytes one worker sends for the last traced call, by ring-collective arithmetic:
        an all-reduce of S bytes sends 2(n-1)/n x S; an all-gather of S sends (n-1) x S."""
        n = self._group_size
        total = 0
        for kind, nbytes in self.last_call:
            total += nbytes * (2 * (n - 1) / n if kind == "all_reduce" else n - 1)
        return int(total)

    def sums_locally(self) -> bool:
        """Whether this process adds its replicas' values itself (`_local_sums`): several
        devices that NCCL does not join, and either the whole group in this process or
        tfstrat's ring between the workers."""
        n = len(self._devices)
        nccl = (
            self._options.implementation
            == tf.distribute.experimental.CommunicationImplementation.NCCL
        )
        return n > 1 and not nccl and (self._group_size == n or self.ring is not None)

    def _all_reduce_per_replica_values(self, reduce_op, per_replica_values, options):
        n = len(self._devices)
        if not self.sums_locally() or any(len(v.values) != n for v in per_replica_values):
            return super()._all_reduce_per_replica_values(reduce_op, per_replica_values, options)
        return self._local_sums(reduce_op, per_replica_values, options)

    def _local_sums(self, reduce_op, per_replica_values, options):
        """Each value's replicas summed on the first device in replica order, the sums across
        workers in one ring exchange, and every device a copy: bit-identical on every replica.
        A sparse gradient stays rows or is densified as `density` decides from one replica's
        static rows (as when each replica sent its own); kept rows are deduplicated (across
        workers, by the ring's gather)."""
        hosts = self._group_size > len(self._devices)
        sums, marks, summed = [], [], []
        with tf.device(self._devices[0]):
            for value in per_replica_values:
                parts = list(value.values)
                rows = all(isinstance(p, tf.IndexedSlices) for p in parts)
                dense = not rows or self.density.densify(parts[0], self._group_size)
                sums.append(_sum_replicas(parts, dense, dedup=not hosts))
                if dense:
                    shape = parts[0].dense_shape if rows else parts[0].shape
                    summed.append(_shape_list(shape))
                else:
                    width = parts[0].values.shape[1:].num_elements()
                    self._record_local("local_rows", [sparse.static_rows(parts[0]), width])
                if hosts and not dense:  # decided: the ring's gather must not densify it
                    marks.append(sparse.keep_sparse(sums[-1]))
            if summed:
                self._record_local("local_sum", summed)
            if hosts:
                self._summing = True
                try:
                    sums = self._all_reduce(tf.distribute.ReduceOp.SUM, sums, 0, options)
                finally:
                    self._summing = False
                    sparse.forget(marks)
            if reduce_op == tf.distribute.ReduceOp.MEAN:
                sums = [_divide(s, self._group_size) for s in sums]
        out = []
        for total in sums:
            copies = []
            for device in self._devices:
                with tf.device(device):
                    copies.append(_copy(total))
            out.append(tf_values.Mirrored(copies))
        return out

    def _record_local(self, kind, shapes):
        if not tf.executing_eagerly():  # traced steps only, not metric reads
            self.traced.append((kind, shapes))

    def _all_reduce(self, reduce_op, value, replica_id, options):
        # With the ring, only the ring crosses workers: what the packed float exchange does
        # not carry goes in float64 (`_ring_sum64`), rows it cannot pack are densified.
        ring_only = self.ring is not None
        if ring_only and len(self._devices) > 1 and not self._summing:
            raise AssertionError(  # each replica's value alone would cross: a partial sum
                "tfstrat: a replica's all-reduce reached the ring on its own; a worker of "
                "several devices sums them first (`_local_sums`)"
            )
        flat = nest.flatten(value)
        if replica_id == 0 and not tf.executing_eagerly():
            self.last_call = []
        rows = {}  # position -> static row count before dedup (dedup's count is dynamic)
        for i, v in enumerate(flat):
            if isinstance(v, tf.IndexedSlices):
                densify = self.density.densify(v, self._group_size)
                rows[i] = sparse.static_rows(v)
                # TensorFlow's gather of an unknown row count is a cond of collectives whose
                # calls interleave across a loop's iterations (a custom loop's `tf.range`):
                # there, such a gradient is all-reduced densely.
                densify = densify or (rows[i] is None and in_control_flow())
                densify = densify or (ring_only and not packable(v))
                with tf.device(self._devices[replica_id]):
                    v = sparse.dedup(v)
                    flat[i] = sparse.densify(v) if densify else v
                if densify:
                    del rows[i]
        dense_at = [i for i in range(len(flat)) if i not in rows]
        dense = [flat[i] for i in dense_at]
        # Everything the TCP ring can carry goes in one exchange: the step waits once.
        by_ring = dense_at if dense and self._ring_carries(dense) else []
        if ring_only and dense and not by_ring:  # carry what the ring can; the rest in float64
            by_ring = _one_floating_dtype(dense_at, flat)
        lossy = self.compression is not None and any(compression.marked(t) for t in dense)
        if lossy and not by_ring:
            _warn_once(
                "tfstrat: compression is set, but this step's gradients go uncompressed over "
                "TensorFlow's collectives: the TCP ring carries one floating dtype of static "
                f"shapes, and these are {sorted({t.dtype.name for t in dense})} (a shape "
                "unknown until run time, or float16/bfloat16 variables, keep them off it)"
            )
        if dense and not (by_ring and lossy):  # compressed: `_ring_exchange` records it
            # A tensor of unknown static size counts 0: a lower bound, never a crash.
            nbytes = sum((t.shape.num_elements() or 0) * t.dtype.size for t in dense)
            shapes = [tuple(t.shape) if t.shape.rank is not None else None for t in dense]
            self._record(replica_id, "all_reduce", shapes, nbytes)
        packed = {i: n for i, n in rows.items() if self.ring is not None and packable(flat[i])}
        if by_ring or packed:
            summed, gathered = self._ring_exchange(
                reduce_op,
                [flat[i] for i in by_ring],
                {i: (flat[i], packed[i]) for i in packed},
                replica_id,
            )
            for i, r in zip(by_ring, summed):
                flat[i] = r
            for i, g in gathered.items():
                flat[i] = g
        rest = [i for i in dense_at if i not in by_ring]
        if rest and ring_only:
            for i, r in zip(rest, self._ring_sum64(reduce_op, [flat[i] for i in rest])):
                flat[i] = r
        elif rest:
            reduced = super()._all_reduce(reduce_op, [flat[i] for i in rest], replica_id, options)
            for i, r in zip(rest, reduced):
                flat[i] = r
        for i, n in rows.items():
            if i not in packed:
                flat[i] = self._gather_slices(reduce_op, flat[i], n, replica_id, options)
        return nest.pack_sequence_as(value, flat)

    def _ring_carries(self, dense) -> bool:
        dtypes = {t.dtype for t in dense}
        static = all(t.shape.is_fully_defined() for t in dense)
        return self.ring is not None and static and len(dtypes) == 1 and dtypes.pop().is_floating

    def _ring_call(self, fn, inputs, shapes, name):
        return self._ring_calls.call(fn, inputs, shapes, name)

    def _ring_sum64(self, reduce_op, dense):
        """Dense tensors the packed float exchange does not carry (integers, counts, shapes
        known only at run time), summed over the workers on the ring in float64 (exact for
        integers below 2**53) and cast back."""
        ring = self.ring
        with tf.device(self._devices[0]):
            flat = tf.concat([tf.reshape(tf.cast(t, tf.float64), [-1]) for t in dense], 0)
            summed = self._ring_call(
                lambda x: [ring.exchange(x, [])[0].copy()], [flat], [flat.shape], "tcp_sum64"
            )[0]
            if reduce_op == tf.distribute.ReduceOp.MEAN:
                summed = summed / self._group_size
            pieces = tf.split(summed, [tf.size(t) for t in dense])
            return [tf.cast(tf.reshape(p, tf.shape(t)), t.dtype) for p, t in zip(pieces, dense)]

    def _ring_exchange(self, reduce_op, dense, slices, replica_id):
        """One TCP ring exchange for a step: every dense tensor packed into one flat vector
        and summed, and every sparse gradient's deduplicated rows gathered (of any count:
        no padding). `slices`: `{position: (IndexedSlices, static rows before dedup)}`.
        With `compression`, the step's dense gradients (`compression.mark`) travel compressed
        and the rest exactly. Returns the reduced dense tensors and `{position: IndexedSlices}`."""
        ring, method = self.ring, self.compression
        lossy = [j for j, t in enumerate(dense) if method is not None and compression.marked(t)]
        exact = [j for j in range(len(dense)) if j not in lossy]
        with tf.device(self._devices[replica_id]):
            inputs, shapes = [], []
            if exact:
                flat = tf.concat([tf.reshape(dense[j], [-1]) for j in exact], 0)
                inputs.append(flat)
                shapes.append(flat.shape)
            if lossy:
                flat = tf.concat([tf.reshape(dense[j], [-1]) for j in lossy], 0)
                extras = dense[exact[0]].dtype if exact else tf.float32
                encoded, shape = self._encode(flat, extras)
                inputs.append(encoded)
                shapes.append(shape)
            self._record_compressed(
                replica_id, [dense[j] for j in exact], [dense[j] for j in lossy]
            )
            for v, rows in slices.values():
                packed = sparse.pack_rows(v, None)
                if rows is not None:  # an upper bound: the ring sends the deduplicated rows
                    self._record(
                        replica_id,
                        "all_gather",
                        (rows, packed.shape[1]),
                        rows * packed.shape[1] * 4,
                    )
                inputs.append(packed)
                shapes.append([None, packed.shape[1]])
            # Slots of `inputs` (and of the outputs): [exact vector], [lossy part], blocks...,
            # [PowerSGD's optimizer step]
            at_lossy = 1 if exact else 0
            at_blocks = at_lossy + (1 if lossy else 0)
            state = self._powersgd([dense[j] for j in lossy]) if lossy else None
            step = compression.step_of(dense[lossy[0]]) if state is not None else None
            if step is not None:
                inputs.append(tf.reshape(tf.cast(tf.convert_to_tensor(step), tf.int64), []))
                shapes.append([])
            at_step = len(inputs) - 1 if step is not None else None

            def exchange(*arrays):
                mine = arrays[0] if exact else None
                blocks = list(arrays[at_blocks:at_step])
                if state is not None:  # PowerSGD: its own two exchanges
                    done = None if at_step is None else arrays[at_step]
                    approx, summed, gathered = state.exchange(
                        ring, arrays[at_lossy], mine, blocks, step=done
                    )
                    extra = [] if at_step is None else [done]
                    return ([summed] if exact else []) + [approx] + gathered + extra
                # Rounded 16-bit gradients are all-gathered as one more block.
                rounded = [arrays[at_lossy]] if lossy else []
                summed, gathered = ring.exchange(mine, rounded + blocks)
                return ([summed] if exact else []) + gathered

            outs = self._ring_call(exchange, inputs, shapes, "tcp_exchange")
            reduced = [None] * len(dense)
            if exact:
                summed = outs[0]
                if reduce_op == tf.distribute.ReduceOp.MEAN:
                    summed = summed / self._group_size
                for j, t in zip(
                    exact, tf.split(summed, [dense[j].shape.num_elements() for j in exact])
                ):
                    reduced[j] = tf.reshape(t, dense[j].shape)
            if lossy:
                summed = self._decode(outs[at_lossy])
                if self.trace is not None:
                    summed = self._traced(dense, lossy, summed)
                if reduce_op == tf.distribute.ReduceOp.MEAN:
                    summed = summed / self._group_size
                for j, t in zip(
                    lossy, tf.split(summed, [dense[j].shape.num_elements() for j in lossy])
                ):
                    reduced[j] = tf.cast(tf.reshape(t, dense[j].shape), dense[j].dtype)
            gathered = {}
            for (i, (v, _)), everyone in zip(slices.items(), outs[at_blocks:at_step]):
                g = sparse.unpack_rows(everyone, v)
                if reduce_op == tf.distribute.ReduceOp.MEAN:
                    g = tf.IndexedSlices(g.values / self._group_size, g.indices, g.dense_shape)
                gathered[i] = g
        return reduced, gathered

    def _encode(self, flat, extras_dtype):
        """The step's lossy gradients (one flat vector) as they enter the ring call: a row of
        16-bit words to all-gather (fp16/bf16), or float32 for PowerSGD. Returns (tensor, its
        static shape in the call's output)."""
        method = self.compression
        if method in compression.ROUNDING:
            wire = tf.as_dtype(compression.ROUNDING[method])
            words = tf.bitcast(tf.cast(flat, wire), tf.uint16)[None]
            return words, [self._group_size, words.shape[1]]
        if extras_dtype != tf.float32:  # the extras ride with PowerSGD's float32 factors
            raise UsageError(
                f"compression={compression.describe(method)!r} takes float32 gradients; this "
                f"model's are {extras_dtype.name}. Use float32 variables, compression='bf16', "
                "or no compression."
            )
        flat = tf.cast(flat, tf.float32)
        return flat, flat.shape

    def _decode(self, out):
        """The lossy gradients' sum from the ring call's output: for fp16/bf16, every worker's
        rounded vector summed in float32 in rank order (the same bits on every worker)."""
        method = self.compression
        if method not in compression.ROUNDING:
            return out  # PowerSGD's approximation of the sum
        wire = tf.as_dtype(compression.ROUNDING[method])
        rows = tf.unstack(tf.bitcast(out, wire), self._group_size)
        summed = tf.cast(rows[0], tf.float32)
        for row in rows[1:]:
            summed += tf.cast(row, tf.float32)
        return summed

    def _traced(self, dense, lossy, summed):
        """`summed`, after recording it and the gradients it came from in `trace`."""
        trace = self.trace
        raw = tf.cast(tf.concat([tf.reshape(dense[j], [-1]) for j in lossy], 0), tf.float32)

        def record(mine, reduced):
            trace.append({"raw": mine.copy(), "reduced": reduced.copy()})
            return [mine, reduced]

        return self._ring_call(record, [raw, summed], [raw.shape, summed.shape], "trace")[1]

    def _powersgd(self, grads) -> compression.PowerSGDState | None:
        """The PowerSGD state of these gradients' variables (kept across traces: a step traced
        again goes on from it), or None when the compression rounds. The last few sets of
        variables keep theirs."""
        if not isinstance(self.compression, compression.PowerSGD):
            return None
        shapes = tuple(tuple(g.shape) for g in grads)
        key = (tuple(compression.owner(g) for g in grads), shapes)
        state = self._compressed.pop(key, None)
        if state is None:
            state = compression.PowerSGDState(self.compression, list(shapes))
        self._compressed[key] = state  # the newest last
        while len(self._compressed) > _STATES_KEPT:
            del self._compressed[next(iter(self._compressed))]
        return state

    def _record_compressed(self, replica_id, exact, lossy):
        """The dense part of a ring exchange, by what it sends (`bytes_sent_per_worker`)."""
        size = lambda ts: sum((t.shape.num_elements() or 0) * t.dtype.size for t in ts)  # noqa: E731
        if not lossy:
            return  # recorded by `_all_reduce`
        if exact:
            self._record(replica_id, "all_reduce", [tuple(t.shape) for t in exact], size(exact))
        if self.compression in compression.ROUNDING:
            floats = sum(t.shape.num_elements() for t in lossy)
            self._record(replica_id, "all_gather", (1, floats), 2 * floats)
        else:
            state = self._powersgd(lossy)
            nbytes = 4 * (state.factor_floats + state.exact_floats)
            self._record(replica_id, "all_reduce", [("powersgd", nbytes // 4)], nbytes)

    def _gather_slices(self, reduce_op, slices, rows, replica_id, options):
        """A sparse gradient over TensorFlow's collectives (no TCP ring)."""
        launcher = self._launchers[replica_id]
        with tf.device(self._devices[replica_id]):
            if rows is None or not packable(slices):
                # Row count unknown or not float32: TensorFlow's 3-collective padded gather.
                gathered = sparse.dedup(launcher.all_reduce_indexed_slices(slices, options))
            else:
                packed = sparse.pack_rows(slices, rows)
                nbytes = packed.shape.num_elements() * 4
                self._record(replica_id, "all_gather", tuple(packed.shape), nbytes)
                gathered = sparse.unpack_rows(launcher.all_gather(packed, 0, options), slices)
            if reduce_op == tf.distribute.ReduceOp.MEAN:
                gathered = tf.IndexedSlices(
                    gathered.values / self._group_size, gathered.indices, gathered.dense_shape
                )
        return gathered


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


class RingCalls:
    """Ring calls in a graph, in order: `call(fn, inputs, shapes, name)` runs `fn(*inputs)`
    (NumPy arrays in, a list of arrays out) after the graph's previous ring call, and returns
    the outputs with `shapes`.

    Ring calls must run in the same order on every worker: within a graph each one waits for
    the previous (control dependency); graphs and eager calls run one at a time. A call inside
    a branch of a `tf.cond` (or a loop's body) also waits for the enclosing graph's previous
    call, and the enclosing graph's next call waits for the control-flow ops made since its
    previous one (such as `LossScaleOptimizer`'s cond, whose branch all-reduces the
    gradients while a loss is reduced after it).
    """

    _CONTROL_FLOW = {"If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase"}

    def __init__(self):
        self._last = weakref.WeakKeyDictionary()  # graph -> its last ring op
        self._seen = weakref.WeakKeyDictionary()  # graph -> its op count at its last ring op
        self._nested = weakref.WeakKeyDictionary()  # graph -> a nested graph made ring calls

    def _waits(self, graph) -> list:
        """What a ring call made now in `graph` waits for."""
        last = self._last.get(graph)
        deps = [last] if last is not None else []
        if self._nested.pop(graph, False):
            made = graph.get_operations()[self._seen.get(graph, 0) :]
            deps += [op for op in made if op.type in self._CONTROL_FLOW]
        outer = getattr(graph, "outer_graph", None)
        while last is None and outer is not None:  # a branch's first call: after the nearest
            last = self._last.get(outer)  # enclosing graph's last one
            if last is not None:
                deps.append(last)
            outer = getattr(outer, "outer_graph", None)
        return deps

    def call(self, fn, inputs, shapes, name):
        graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        with tf.control_dependencies(self._waits(graph) if graph is not None else []):
            outs = tf.numpy_function(
                fn, inputs, [t.dtype for t in inputs], stateful=True, name=name
            )
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]  # one: not a list
        if graph is not None:
            self._last[graph] = outs[0].op
            self._seen[graph] = len(graph.get_operations())
            outer = getattr(graph, "outer_graph", None)
            while outer is not None:
                self._nested[outer] = True
                outer = getattr(outer, "outer_graph", None)
        for out, shape in zip(outs, shapes):
            out.set_shape(shape)
        return outs


def packable(slices: tf.IndexedSlices) -> bool:
    """Whether `sparse.pack_rows` can carry the gradient: float32 rows of a static width."""
    return slices.values.dtype == tf.float32 and slices.values.shape[1:].is_fully_defined()


def _one_floating_dtype(at: list[int], flat: list) -> list[int]:
    """The positions in `at` of statically shaped tensors of the commonest floating dtype."""
    floats = [i for i in at if flat[i].dtype.is_floating and flat[i].shape.is_fully_defined()]
    if not floats:
        return []
    dtypes = [flat[i].dtype for i in floats]
    common = max(set(dtypes), key=dtypes.count)
    return [i for i in floats if flat[i].dtype == common]


def _sum_replicas(parts: list, dense: bool, dedup: bool):
    """One value's replicas summed in replica order on the current device: by `add_n` when
    `dense` (rows densified first), else rows (`IndexedSlices`) concatenated; with `dedup`,
    each replica's rows deduplicated, then the concatenation's (an all-gather's result)."""
    if not dense:
        parts = [sparse.dedup(p) for p in parts] if dedup else parts
        rows = tf.IndexedSlices(
            tf.concat([p.values for p in parts], 0),
            tf.concat([p.indices for p in parts], 0),
            parts[0].dense_shape,
        )
        return sparse.dedup(rows) if dedup else rows
    parts = [sparse.densify(p) if isinstance(p, tf.IndexedSlices) else p for p in parts]
    return tf.add_n([tf.identity(p) for p in parts])


def _divide(value, count: int):
    """`value` / `count` (a MEAN; integer division for integers)."""
    if isinstance(value, tf.IndexedSlices):
        return tf.IndexedSlices(_divide(value.values, count), value.indices, value.dense_shape)
    if value.dtype.is_integer:
        return value // count
    return value / tf.cast(count, value.dtype)


def _copy(value):
    if isinstance(value, tf.IndexedSlices):
        return tf.IndexedSlices(
            tf.identity(value.values), tf.identity(value.indices), value.dense_shape
        )
    return tf.identity(value)


def _shape_list(shape) -> list | None:
    """A static shape as a list (None for an unknown dimension), or None when unknown."""
    static = tf.get_static_value(shape) if isinstance(shape, tf.Tensor) else shape
    if static is None:
        return None
    shape = tf.TensorShape(static)
    return shape.as_list() if shape.rank is not None else None
