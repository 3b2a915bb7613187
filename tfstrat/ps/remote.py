"""The worker's side of ps-held tables (`tfstrat.ps.tables`): lookups and pushes over TCP.

A table of R rows split into P parts lives on the ps tasks part by part ("div" layout, as
`tf.nn.embedding_lookup`). A lookup deduplicates the ids, asks each part's ps for its rows
(all requests go out before the first answer is read) and stitches them back; in a step the
calls are a `tf.numpy_function` over `tfstrat.ps.wire`. Its gradient is never materialised for
the whole table: the rows' gradient is summed per id (local aggregation) and pushed to the
parts, and what the layer hands to Keras is the gradient of a scalar "anchor" variable that
depends on the pushes being sent. That anchor's gradient is all-reduced with the dense
gradients, so when any worker's all-reduce completes, every worker's push of the step is on
its way. The push does not wait for its answer: the ps applies the step while the workers
all-reduce, and the answer is read before the connection's next call. A lookup carries its
step, and the ps answers it once every earlier step pushed there is applied, so the next
step sees the new rows.

Uneven batches. Keras divides each replica's local-mean loss by the replica count R, so the
rows' gradient a replica computes is g_r / R, g_r its local mean over its n_r rows. The push
multiplies it by R n_r and carries n_r; the ps divides the step's sum by N = sum_r n_r, which
gives (1/N) sum_i g_i, one device's gradient of the global batch, for any split (as
`tfstrat.strategies._exact_step` does for the mirrored variables). A step whose loss Keras did
not scale (a custom train_step) pushes weight 0: the ps sums its pushes unweighted.
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import tensorflow as tf

from tfstrat.errors import UsageError
from tfstrat.ps.tables import KINDS, SLOTS, rpc_address
from tfstrat.ps.variables import ps_device


class TableClients:
    """One connection per ps task's table server (`tfstrat.ps.wire`)."""

    def __init__(self, ps_addresses, timeout: float, worker: int):
        from tfstrat.ps import wire

        self.addresses = [rpc_address(a) for a in ps_addresses]
        self.timeout = timeout
        self.connections = [
            wire.Connection(address, timeout, f"ps:{i}") for i, address in enumerate(self.addresses)
        ]
        self._lock = threading.Lock()  # one call (or set of calls) at a time, from any thread
        self._unread: dict[int, list[str]] = {}  # ps -> methods sent whose answers are unread

    def call(self, ps: int, method: str, *arrays) -> list[np.ndarray]:
        """Calls `method` on ps task `ps` (raises `tfstrat.errors.TableServerError` naming it)."""
        return self.call_all([(ps, method, arrays)])[0]

    def call_all(self, calls) -> list[list[np.ndarray]]:
        """`[(ps, method, arrays), ...]`: sends every request, then reads the answers in turn,
        so the ps tasks work at once. Two calls to one ps go one after the other."""
        out, pending = [None] * len(calls), {}
        with self._lock:
            self._read_unread()
            try:
                for i, (ps, method, arrays) in enumerate(calls):
                    if ps in pending:  # one request in flight per connection
                        j = pending.pop(ps)
                        out[j] = self.connections[ps].receive(calls[j][1])
                    self.connections[ps].send(method, *arrays)
                    pending[ps] = i
                while pending:
                    ps, j = pending.popitem()
                    out[j] = self.connections[ps].receive(calls[j][1])
            except BaseException:
                for ps in pending:  # unread answers: those connections start afresh
                    self.connections[ps].close()
                raise
        return out

    def send_all(self, calls) -> None:
        """Sends `[(ps, method, arrays), ...]` without waiting for the answers: they are read
        (and an error in one raised, naming its ps) before the next call."""
        with self._lock:
            for ps, method, arrays in calls:
                try:
                    self.connections[ps].send(method, *arrays)
                except BaseException:
                    self._unread.pop(ps, None)  # the connection is gone, its answers with it
                    raise
                self._unread.setdefault(ps, []).append(method)

    def _read_unread(self) -> None:
        for ps in list(self._unread):
            methods = self._unread[ps]
            while methods:
                method = methods.pop(0)
                if not self.connections[ps].is_open:  # closed by a failure: answers gone
                    methods.clear()
                    break
                self.connections[ps].receive(method)
            del self._unread[ps]

    def put_meta(self, key: int, value: int) -> None:
        self.call(0, "put_meta", np.int64(key), np.int64(value))

    def wait_meta(self, key: int, timeout: float, what: str) -> int:
        """Polls ps 0 for the chief's `key` (e.g. a table's partition count)."""
        deadline, pause = time.monotonic() + timeout, 0.01
        while True:
            value = int(self.call(0, "get_meta", np.int64(key))[0])
            if value >= 0:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"Waited {timeout:g} s for the chief to choose {what}. Is the chief alive "
                    "and running the same model code?"
                )
            time.sleep(pause)
            pause = min(2 * pause, 0.5)


# Bytes per call when a checkpoint reads or writes a table: a 2M-row table moves in pieces, so
# neither side holds a second copy of all of it in flight.
_CHUNK_BYTES = 3 << 20


class RemoteTable:
    """A table on ps tasks: `parts[k] = (ps task, table number, first row, end row)`.

    `workers`: the replicas in sync (R); `local`: how many of them each worker process holds
    (its devices). A worker's replicas fetch their rows in one call and push them summed in
    one (the first replica's): a step costs one round trip per part per worker, whatever R.
    """

    def __init__(self, clients: TableClients, name, rows, dim, parts, workers, init, local=1):
        self.clients, self.name, self.rows, self.dim = clients, name, rows, dim
        self.parts, self.replicas, self.local = parts, workers, max(1, local)
        pushers = max(1, workers // self.local)  # the ps waits for one push per worker a step
        last = {ps: number for ps, number, _, _ in parts}  # each ps's last part of the table
        for ps, number, lo, hi in parts:
            # Each part is rows lo..hi of the table one initializer draws whole, as on one device.
            part = dict(init, first=lo, total=rows, last=last[ps] == number)
            spec = np.frombuffer(json.dumps(part).encode(), np.uint8)
            clients.call(ps, "create", *np.array([number, hi - lo, dim, pushers], np.int64), spec)
        self.calls = {"fetch": 0, "push": 0}  # this process's calls, by kind (tests count them)
        self._counting = threading.Lock()

    def drop(self, droppers: int = 1) -> None:
        """Drops the table on the ps once `droppers` calls (one per worker process) came."""
        for ps, number, _, _ in self.parts:
            self.clients.call(ps, "drop", np.int64(number), np.int64(droppers))

    @property
    def devices(self) -> list[str]:
        return [ps_device(ps) for ps, *_ in self.parts]

    # -- reading and writing whole tables and slots (checkpoints) -----------------------------

    def _chunk_rows(self) -> int:
        return max(1, _CHUNK_BYTES // (4 * self.dim))

    # The reader's step (None: no step): a read waits on the ps only for the steps before it,
    # so a worker that saves while another has pushed its next step reads the state of its own
    # steps (waiting for every pending push would wait for its own, which never comes).
    read_step = None

    def _read_rows(self, ps, method, head, rows) -> np.ndarray:
        chunks, step = [], self._chunk_rows()
        at = (
            []
            if self.read_step is None or self.read_step() is None
            else [np.int64(self.read_step())]
        )
        for a in range(0, rows, step):
            b = min(rows, a + step)
            (flat,) = self.clients.call(ps, method, *head, np.int64(a), np.int64(b), *at)
            chunks.append(flat.reshape(b - a, self.dim))
        return np.concatenate(chunks, axis=0) if chunks else np.zeros((0, self.dim), np.float32)

    def _write_rows(self, ps, method, head, rows: np.ndarray) -> None:
        step = self._chunk_rows()
        for a in range(0, len(rows), step):
            self.clients.call(ps, method, *head, np.int64(a), rows[a : a + step].reshape(-1))

    def numpy(self) -> np.ndarray:
        return np.concatenate(
            [
                self._read_rows(ps, "read", [np.int64(number)], hi - lo)
                for ps, number, lo, hi in self.parts
            ],
            axis=0,
        )

    def assign(self, table: np.ndarray) -> None:
        table = np.asarray(table, np.float32)
        for ps, number, lo, hi in self.parts:
            self._write_rows(ps, "write", [np.int64(number)], table[lo:hi])

    def _slots_present(self) -> list[set[str]]:
        """Per part, the slots its ps has made (a part no push has reached has none)."""
        present = []
        for ps, number, _, _ in self.parts:
            (ids,) = self.clients.call(ps, "slots", np.int64(number))
            present.append({SLOTS[i] for i in ids.tolist()})
        return present

    def _slot(self, name: str, fill: float, present: list[set[str]]) -> np.ndarray:
        rows = []
        for (ps, number, lo, hi), have in zip(self.parts, present):
            if name in have:
                head = [np.int64(number), np.int64(SLOTS.index(name))]
                rows.append(self._read_rows(ps, "read_slot", head, hi - lo))
            else:
                rows.append(np.full((hi - lo, self.dim), fill, np.float32))
        return np.concatenate(rows, axis=0)

    def slot(self, name: str, fill: float) -> np.ndarray:
        """The optimizer slot `name` whole; `fill` in the rows of parts that have none yet
        (the value the slot starts from)."""
        return self._slot(name, fill, self._slots_present())

    def slots(self, fills: dict[str, float]) -> dict[str, np.ndarray]:
        """The optimizer slots the ps tasks hold for this table, each whole (by name): those
        some part has made, `fills[name]` (default 0) in the rows of parts without it."""
        present = self._slots_present()
        return {
            name: self._slot(name, fills.get(name, 0.0), present)
            for name in SLOTS
            if any(name in p for p in present)
        }

    def assign_slots(self, slots: dict[str, np.ndarray]) -> None:
        for name, value in slots.items():
            value = np.asarray(value, np.float32)
            if name not in SLOTS or value.shape != (self.rows, self.dim):
                raise UsageError(
                    f"Table {self.name!r}: the saved slot {name!r} has shape {value.shape}; "
                    f"expected one of {list(SLOTS)} with shape {(self.rows, self.dim)}."
                )
            for ps, number, lo, hi in self.parts:
                head = [np.int64(number), np.int64(SLOTS.index(name))]
                self._write_rows(ps, "write_slot", head, value[lo:hi])

    # -- in the step --------------------------------------------------------------------

    def _split(self, ids: np.ndarray):
        """Per part: (positions in `ids`, ids local to the part)."""
        starts = np.array([lo for _, _, lo, _ in self.parts], np.int64)
        part = np.searchsorted(starts[1:], ids, side="right")
        positions = [np.flatnonzero(part == k) for k in range(len(self.parts))]
        return positions, [ids[p] - starts[k] for k, p in enumerate(positions)]

    def _check(self, ids: np.ndarray) -> None:
        bad = ids[(ids < 0) | (ids >= self.rows)]
        if len(bad):
            raise UsageError(
                f"Table {self.name!r}: id {int(bad[0])} is outside its rows 0..{self.rows - 1}. "
                "Embedding inputs must be in [0, input_dim)."
            )

    def _count(self, kind: str) -> None:
        with self._counting:  # numpy_function calls come from TensorFlow's threads
            self.calls[kind] += 1

    def _fetch(self, unique_ids: np.ndarray, step=-1) -> np.ndarray:
        self._count("fetch")
        self._check(unique_ids)
        positions, local = self._split(unique_ids)
        step = np.int64(step)
        calls = [
            (ps, "lookup", (np.int64(n), ids, step))
            for (ps, n, _, _), ids in zip(self.parts, local)
        ]
        rows = np.empty((len(unique_ids), self.dim), np.float32)
        for pos, (flat,) in zip(positions, self.clients.call_all(calls)):
            rows[pos] = flat.reshape(-1, self.dim)
        return rows

    def _push(self, unique_ids, grads, step, hyper, rows, replica) -> np.int64:
        self._count("push")
        self._check(unique_ids)
        positions, local = self._split(unique_ids)
        calls = [
            (ps, "push", (np.int64(n), step, ids, grads[pos].reshape(-1), hyper, rows, replica))
            for (ps, n, _, _), pos, ids in zip(self.parts, positions, local)
        ]
        self.clients.send_all(calls)  # the answers are read before the next call
        return np.int64(0)

    def fetch(self, unique_ids, step=None):
        """The rows of `unique_ids` (a 1-D int64 tensor), shape [n, dim], as of every step
        before `step` (None: whatever is applied)."""
        step = tf.constant(-1, tf.int64) if step is None else tf.cast(step, tf.int64)
        rows = tf.numpy_function(
            self._fetch, [unique_ids, step], tf.float32, stateful=True, name="fetch"
        )
        return tf.reshape(rows, [-1, self.dim])

    def push(self, unique_ids, grads, step, hyper, rows=None):
        """Sends `grads` (already weighted) and their weight `rows` (None: 0, unweighted) to
        the ps tasks; does not wait for the update (see the module's docstring)."""
        rows = tf.constant(0.0) if rows is None else tf.cast(rows, tf.float32)
        context = tf.distribute.get_replica_context()  # None in cross-replica code: one pusher
        replica = context.replica_id_in_sync_group // self.local if context else 0  # the worker
        replica = tf.cast(replica, tf.int64)
        args = [unique_ids, tf.cast(grads, tf.float32), step, hyper, rows, replica]
        return tf.numpy_function(self._push, args, tf.int64, stateful=True, name="push")

    def lookup(self, ids, anchor, step_fn, hyper_fn, held: bool = False):
        """Rows for `ids` (any shape); the gradient w.r.t. `anchor` pushes the rows' gradient.

        `held` (loss scaling): the gradient does not push; it hands `send(finite, scale)` to
        the step's optimizer (`tfstrat.runtime.step._step.pushes`), which calls it once every
        replica agreed whether the step is applied: the rows' gradient divided by the loss
        scale, or an empty push the ps counts and applies nothing of. The anchor's gradient
        is then NaN when the rows' gradient is not finite, so the step's verdict covers them.
        """
        flat = tf.reshape(tf.cast(ids, tf.int64), [-1])
        unique, index = tf.unique(flat)

        @tf.custom_gradient
        def rows_of(a):
            step = step_fn()
            rows = tf.gather(self._fetch_for_worker(unique, step), index)

            def grad(d_rows):
                summed = tf.math.unsorted_segment_sum(d_rows, index, tf.shape(unique)[0])
                summed, weight = self._weighted(summed)
                finite = tf.reduce_all(tf.math.is_finite(summed))  # this replica's rows
                pusher, (ids, grads, weight) = self._summed_for_worker(unique, summed, weight)
                if held:
                    if pusher:
                        self._hold(ids, grads, weight, step_fn, hyper_fn)
                    return tf.zeros_like(a) + tf.cast(tf.where(finite, 0.0, np.nan), a.dtype)
                if not pusher:  # the worker's first replica pushes for all of them
                    return tf.zeros_like(a)
                sent = self.push(ids, grads, step_fn(), hyper_fn(), weight)
                sent = tf.cast(tf.reshape(sent, []), a.dtype)
                return tf.zeros_like(a) + 0.0 * sent  # 0, once the pushes are sent

            return rows, grad

        rows = rows_of(anchor)
        return tf.reshape(rows, tf.concat([tf.shape(ids), [self.dim]], 0))

    def _fetch_for_worker(self, unique, step):
        """This replica's rows of `unique`, fetched in one call for every replica of the worker."""
        context = tf.distribute.get_replica_context()
        if self.local <= 1 or context is None or tf.distribute.in_cross_replica_context():
            return self.fetch(unique, step)

        def fetch_all(strategy, ids, step):
            ids = strategy.experimental_local_results(ids)
            together, where = tf.unique(tf.concat(ids, 0))
            rows = self.fetch(together, strategy.experimental_local_results(step)[0])
            sizes = tf.stack([tf.shape(i)[0] for i in ids])
            return tuple(tf.gather(rows, w) for w in tf.split(where, sizes, num=len(ids)))

        if not _in_replica_graph():  # a loop's body, a cond: no merge_call; each its own
            return self.fetch(unique, step)
        every = context.merge_call(fetch_all, args=(unique, step))
        return every[self._local_index(context)]

    def _summed_for_worker(self, unique, summed, weight):
        """(whether this replica pushes, (ids, their gradients, weight) summed over the worker's
        replicas, in replica order); one replica a worker: its own."""
        context = tf.distribute.get_replica_context()
        if self.local <= 1 or context is None or tf.distribute.in_cross_replica_context():
            return True, (unique, summed, weight)
        weighted = weight is not None

        def sum_all(strategy, ids, grads, weight):
            ids = tf.concat(strategy.experimental_local_results(ids), 0)
            grads = tf.concat(strategy.experimental_local_results(grads), 0)
            together, where = tf.unique(ids)
            grads = tf.math.unsorted_segment_sum(grads, where, tf.shape(together)[0])
            return together, grads, tf.add_n(strategy.experimental_local_results(weight))

        if not _in_replica_graph():
            raise UsageError(
                f"Table {self.name!r}: trained inside a loop or cond of the step (Keras's "
                f"steps_per_execution > 1, a layer called in a while loop) on a worker of "
                f"{self.local} devices, whose replicas push a step's rows together. Use "
                "steps_per_execution=1, or one device per worker (`tfstrat launch` gives each "
                "worker its own GPU)."
            )
        ids, grads, total = context.merge_call(
            sum_all, args=(unique, summed, weight if weighted else tf.constant(0.0))
        )
        return self._local_index(context) == 0, (ids, grads, total if weighted else None)

    def _local_index(self, context) -> int:
        """The replica's place among its worker's replicas (its devices' order)."""
        return int(tf.get_static_value(context.replica_id_in_sync_group)) % self.local

    def _hold(self, unique, summed, rows, step_fn, hyper_fn) -> None:
        """Hands the step's optimizer `send(finite, scale)` instead of pushing now."""
        from tfstrat.runtime.step import _step

        def send(finite, scale):
            step, hyper = step_fn(), hyper_fn()

            def applied():
                grads = summed / tf.cast(scale, summed.dtype)
                return self.push(unique, grads, step, hyper, rows)

            def skipped():  # kind -1: the ps counts the push and applies nothing
                no_ids, no_rows = tf.zeros([0], tf.int64), tf.zeros([0, self.dim])
                return self.push(no_ids, no_rows, step, tf.concat([[-1.0], hyper[1:]], 0))

            return tf.cond(finite, applied, skipped)

        _step.pushes = (_step.pushes or []) + [send]

    def _weighted(self, grads):
        """(grads * R n_r, n_r) when Keras scaled this step's loss, else (grads, None)."""
        # Read while the backward pass is traced inside the replica's train_step, where
        # `_exact_step` has recorded the replica's rows and whether Keras scaled its loss.
        from tfstrat.runtime.step import _step, row_weight

        weight = row_weight(self.replicas, grads.dtype)
        if weight is None:
            return grads, None
        # multiply_no_nan: a replica without rows pushes no ids; its weight is 0.
        return tf.math.multiply_no_nan(grads, weight), tf.cast(_step.rows, grads.dtype)


def _in_replica_graph() -> bool:
    """Whether ops made now go into the replica function's own graph (`in_control_flow`)."""
    from tfstrat._compat.tf import in_control_flow

    return not in_control_flow()


def optimizer_kind(optimizer) -> str | None:
    """The `tfstrat.ps.rowmath` step a ps applies for a Keras optimizer, or None if it has none."""
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's
    classes = {cls.__name__ for cls in type(optimizer).__mro__}
    if "SGD" in classes:
        return "sgd_momentum" if optimizer.momentum else "sgd"
    if "Adagrad" in classes:
        return "adagrad"
    if "Adam" in classes and not optimizer.amsgrad:
        return "adam"
    if "RMSprop" in classes and not optimizer.centered:
        return "rmsprop_momentum" if optimizer.momentum > 0 else "rmsprop"
    return None


def optimizer_hyper(optimizer, decays: bool = False) -> tf.Tensor:
    """The `tables.HYPER` numbers a push carries (the layout is in `tfstrat.ps.tables`);
    `decays`: whether the optimizer's weight decay reaches the table."""
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's
    kind = optimizer_kind(optimizer)
    if kind is None:
        raise UsageError(
            f"Received: optimizer {type(optimizer).__name__} for a table on ps tasks. Hybrid "
            "updates ps-held tables row by row with SGD (with or without momentum), Adagrad, "
            "Adam (not amsgrad) or RMSprop (not centered); use one of those, or keep the "
            "tables mirrored with Hybrid(sparse=[])."
        )

    def get(attr, default):
        value = getattr(optimizer, attr, None)
        return float(default if value is None else value)

    numbers = [
        float(KINDS.index(kind)),
        get("beta_1", 0.9),
        get("beta_2", 0.999),
        get("epsilon", 1e-7),
        get("initial_accumulator_value", 0.1),
        get("momentum", 0.0),
        float(bool(getattr(optimizer, "nesterov", False))),
        get("rho", 0.9),
        1 - get("beta_1", 0.9),  # in float64, as Keras computes them
        1 - get("beta_2", 0.999),
        1 - get("rho", 0.9),
        get("weight_decay", 0.0) if decays else 0.0,
    ]
    lr = tf.reshape(tf.cast(optimizer.learning_rate, tf.float32), [1])
    numbers = tf.constant(numbers, tf.float32)
    return tf.concat([numbers[:1], lr, numbers[1:]], 0)
