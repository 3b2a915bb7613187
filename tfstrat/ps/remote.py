"""The worker's side of ps-held tables (`tfstrat.ps.tables`): lookups and pushes over RPC.

A table of R rows split into P parts lives on the ps tasks part by part ("div" layout, as
`tf.nn.embedding_lookup`). A lookup deduplicates the ids, asks each part's ps for its rows
(the calls run concurrently) and stitches them back. Its gradient is never materialised for
the whole table: the rows' gradient is summed per id (local aggregation) and pushed to the
parts, and what the layer hands to Keras is the gradient of a scalar "anchor" variable that
depends on the pushes. That anchor's gradient is all-reduced with the dense gradients, so when
any worker's all-reduce completes, every worker's push of the step has been applied on the ps
(the last push of a step applies it before it returns) and the next lookup sees the new rows.

Uneven batches. Keras divides each replica's local-mean loss by the replica count R, so the
rows' gradient a replica computes is g_r / R, g_r its local mean over its n_r rows. The push
multiplies it by R n_r and carries n_r; the ps divides the step's sum by N = sum_r n_r, which
gives (1/N) sum_i g_i, one device's gradient of the global batch, for any split (as
`tfstrat.strategies._exact_step` does for the mirrored variables). A step whose loss Keras did
not scale (a custom train_step) pushes weight 0: the ps sums its pushes unweighted.
"""

from __future__ import annotations

import json
import time

import numpy as np
import tensorflow as tf

from tfstrat.ps.tables import OPTIMIZERS, SLOTS, rpc_address
from tfstrat.ps.variables import ps_device


class TableClients:
    """One RPC client per ps task."""

    def __init__(self, ps_addresses, timeout: float, worker: int):
        self.addresses = [rpc_address(a) for a in ps_addresses]
        self.timeout_ms = int(timeout * 1000)
        self.clients = [
            tf.distribute.experimental.rpc.Client.create(
                "grpc", address, name=f"tfstrat_w{worker}_ps{i}", timeout_in_ms=self.timeout_ms
            )
            for i, address in enumerate(self.addresses)
        ]

    def call(self, ps: int, method: str, args, out: tf.TensorSpec):
        future = self.clients[ps].call(
            method, args, output_specs=out, timeout_in_ms=self.timeout_ms
        )
        return _Named(future, f"{method} on ps:{ps} (table server at {self.addresses[ps]})")

    def put_meta(self, key: int, value: int) -> None:
        args = [tf.constant(key, tf.int64), tf.constant(value, tf.int64)]
        self.call(0, "put_meta", args, _I64).get_value()

    def wait_meta(self, key: int, timeout: float, what: str) -> int:
        """Polls ps 0 for the chief's `key` (e.g. a table's partition count)."""
        deadline, pause = time.monotonic() + timeout, 0.01
        while True:
            value = int(self.call(0, "get_meta", [tf.constant(key, tf.int64)], _I64).get_value())
            if value >= 0:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"Waited {timeout:g} s for the chief to choose {what}. Is the chief alive "
                    "and running the same model code?"
                )
            time.sleep(pause)
            pause = min(2 * pause, 0.5)


class _Named:
    """An RPC's future whose failure names the ps task: TensorFlow's own error says only
    "Connection reset by peer (at emb/RpcGetValue)" or "Deadline Exceeded"."""

    def __init__(self, future, what: str):
        self._future, self._what = future, what

    def get_value(self):
        code, message = self._future.get_error()
        check = tf.debugging.Assert(
            tf.equal(code, 0),
            [f"tfstrat: {self._what} failed (the ps task's TF_CONFIG port is one less):", message],
        )
        with tf.control_dependencies([check]):
            return self._future.get_value()


_I64 = tf.TensorSpec([], tf.int64)
_IDS = tf.TensorSpec([None], tf.int64)
_ROWS = tf.TensorSpec([None], tf.float32)
# Bytes per RPC when a checkpoint reads or writes a table: gRPC refuses messages over 4 MiB
# ("Received message larger than max"), so a chunk holds at most 3 MiB of rows.
_CHUNK_BYTES = 3 << 20


class RemoteTable:
    """A table on ps tasks: `parts[k] = (ps task, table number, first row, end row)`."""

    def __init__(self, clients: TableClients, name, rows, dim, parts, workers, init: dict):
        self.clients, self.name, self.rows, self.dim = clients, name, rows, dim
        self.parts, self.replicas = parts, workers
        for ps, number, lo, hi in parts:
            clients.call(
                ps,
                "create",
                [
                    tf.constant(number, tf.int64),
                    tf.constant(hi - lo, tf.int64),
                    tf.constant(dim, tf.int64),
                    tf.constant(workers, tf.int64),
                    tf.constant(json.dumps(init)),
                ],
                _I64,
            ).get_value()

    def drop(self) -> None:
        for ps, number, _, _ in self.parts:
            self.clients.call(ps, "drop", [tf.constant(number, tf.int64)], _I64).get_value()

    @property
    def devices(self) -> list[str]:
        return [ps_device(ps) for ps, *_ in self.parts]

    # -- reading and writing whole tables and slots (checkpoints) -----------------------------

    def _chunk_rows(self) -> int:
        return max(1, _CHUNK_BYTES // (4 * self.dim))

    def _read_rows(self, ps, method, head, rows) -> np.ndarray:
        chunks, step = [], self._chunk_rows()
        for a in range(0, rows, step):
            b = min(rows, a + step)
            args = [*head, tf.constant(a, tf.int64), tf.constant(b, tf.int64)]
            flat = self.clients.call(ps, method, args, _ROWS).get_value()
            chunks.append(flat.numpy().reshape(b - a, self.dim))
        return np.concatenate(chunks, axis=0) if chunks else np.zeros((0, self.dim), np.float32)

    def _write_rows(self, ps, method, head, rows: np.ndarray) -> None:
        step = self._chunk_rows()
        for a in range(0, len(rows), step):
            flat = rows[a : a + step].reshape(-1)
            args = [*head, tf.constant(a, tf.int64), tf.constant(flat)]
            self.clients.call(ps, method, args, _I64).get_value()

    def numpy(self) -> np.ndarray:
        return np.concatenate(
            [
                self._read_rows(ps, "read", [tf.constant(number, tf.int64)], hi - lo)
                for ps, number, lo, hi in self.parts
            ],
            axis=0,
        )

    def assign(self, table: np.ndarray) -> None:
        table = np.asarray(table, np.float32)
        for ps, number, lo, hi in self.parts:
            self._write_rows(ps, "write", [tf.constant(number, tf.int64)], table[lo:hi])

    def slots(self, fills: dict[str, float]) -> dict[str, np.ndarray]:
        """The optimizer slots the ps tasks hold for this table, each whole (by name).

        A part no push has reached yet has no slots; its rows are `fills[name]`, the value
        the slot would start from.
        """
        present = []
        for ps, number, _, _ in self.parts:
            ids = self.clients.call(ps, "slots", [tf.constant(number, tf.int64)], _IDS)
            present.append({SLOTS[i] for i in ids.get_value().numpy().tolist()})
        out = {}
        for name in SLOTS:
            if not any(name in p for p in present):
                continue
            rows = []
            for (ps, number, lo, hi), have in zip(self.parts, present):
                if name in have:
                    head = [tf.constant(number, tf.int64), tf.constant(SLOTS.index(name), tf.int64)]
                    rows.append(self._read_rows(ps, "read_slot", head, hi - lo))
                else:
                    rows.append(np.full((hi - lo, self.dim), fills.get(name, 0.0), np.float32))
            out[name] = np.concatenate(rows, axis=0)
        return out

    def assign_slots(self, slots: dict[str, np.ndarray]) -> None:
        for name, value in slots.items():
            value = np.asarray(value, np.float32)
            if name not in SLOTS or value.shape != (self.rows, self.dim):
                raise ValueError(
                    f"Table {self.name!r}: the saved slot {name!r} has shape {value.shape}; "
                    f"expected one of {list(SLOTS)} with shape {(self.rows, self.dim)}."
                )
            for ps, number, lo, hi in self.parts:
                head = [tf.constant(number, tf.int64), tf.constant(SLOTS.index(name), tf.int64)]
                self._write_rows(ps, "write_slot", head, value[lo:hi])

    # -- in the step --------------------------------------------------------------------

    def _split(self, ids):
        """Per part: (positions in `ids`, ids local to the part)."""
        bounds = [lo for _, _, lo, _ in self.parts[1:]]
        part = (
            tf.searchsorted(tf.constant(bounds, tf.int64), ids, side="right")
            if bounds
            else tf.zeros_like(ids, tf.int32)
        )
        part = tf.cast(part, tf.int32)
        positions = tf.dynamic_partition(tf.range(tf.size(ids)), part, len(self.parts))
        local = tf.dynamic_partition(ids, part, len(self.parts))
        starts = [lo for _, _, lo, _ in self.parts]
        return positions, [ids_k - starts[k] for k, ids_k in enumerate(local)]

    def fetch(self, unique_ids):
        positions, local = self._split(unique_ids)
        futures = [
            self.clients.call(ps, "lookup", [tf.constant(number, tf.int64), ids_k], _ROWS)
            for (ps, number, _, _), ids_k in zip(self.parts, local)
        ]
        rows = [tf.reshape(f.get_value(), [-1, self.dim]) for f in futures]
        return tf.dynamic_stitch(positions, rows)

    def push(self, unique_ids, grads, step, hyper, rows=None):
        """Pushes `grads` (already weighted) and their weight `rows` (None: 0, unweighted)."""
        rows = tf.constant(0.0) if rows is None else tf.cast(rows, tf.float32)
        positions, local = self._split(unique_ids)
        futures = []
        for (ps, number, _, _), pos, ids_k in zip(self.parts, positions, local):
            g = tf.reshape(tf.gather(grads, pos), [-1])
            args = [tf.constant(number, tf.int64), step, ids_k, g, hyper, rows]
            futures.append(self.clients.call(ps, "push", args, _I64))
        return tf.add_n([f.get_value() for f in futures])

    def lookup(self, ids, anchor, step_fn, hyper_fn):
        """Rows for `ids` (any shape); the gradient w.r.t. `anchor` pushes the rows' gradient."""
        flat = tf.reshape(tf.cast(ids, tf.int64), [-1])
        unique, index = tf.unique(flat)

        @tf.custom_gradient
        def rows_of(a):
            rows = tf.gather(self.fetch(unique), index)

            def grad(d_rows):
                summed = tf.math.unsorted_segment_sum(d_rows, index, tf.shape(unique)[0])
                summed, rows = self._weighted(summed)
                versions = self.push(unique, summed, step_fn(), hyper_fn(), rows)
                done = tf.cast(tf.reshape(versions, []), a.dtype)
                return tf.zeros_like(a) + 0.0 * done  # 0, once the pushes are done

            return rows, grad

        rows = rows_of(anchor)
        return tf.reshape(rows, tf.concat([tf.shape(ids), [self.dim]], 0))

    def _weighted(self, grads):
        """(grads * R n_r, n_r) when Keras scaled this step's loss, else (grads, None)."""
        # Read while the backward pass is traced inside the replica's train_step, where
        # `_exact_step` has recorded the replica's rows and whether Keras scaled its loss.
        from tfstrat.strategies._exact_step import _step

        if _step.rows is None or not _step.scaled:
            return grads, None
        rows = tf.cast(_step.rows, grads.dtype)
        # multiply_no_nan: a replica without rows pushes no ids; its weight is 0.
        return tf.math.multiply_no_nan(grads, rows * self.replicas), rows


def optimizer_hyper(optimizer) -> tf.Tensor:
    """[kind, learning_rate, beta_1, beta_2, epsilon, initial_accumulator] of a Keras optimizer."""
    name = type(optimizer).__name__
    kind = None
    for cls in type(optimizer).__mro__:
        kind = OPTIMIZERS.get(cls.__name__) if kind is None else kind
    if (
        kind is None
        or (name == "SGD" and getattr(optimizer, "momentum", 0))
        or getattr(optimizer, "amsgrad", False)
    ):
        raise ValueError(
            f"Received: optimizer {name}{' with momentum' if getattr(optimizer, 'momentum', 0) else ''}"
            " for a table on ps tasks. Hybrid updates ps-held tables row by row with SGD "
            "(no momentum), Adagrad or Adam; use one of those, or keep the tables mirrored "
            "with Hybrid(sparse=[])."
        )
    lr = tf.cast(optimizer.learning_rate, tf.float32)
    get = lambda attr, default: float(getattr(optimizer, attr, default) or default)  # noqa: E731
    return tf.stack(
        [
            tf.constant(float(kind)),
            lr,
            tf.constant(get("beta_1", 0.9)),
            tf.constant(get("beta_2", 0.999)),
            tf.constant(get("epsilon", 1e-7)),
            tf.constant(get("initial_accumulator_value", 0.1)),
        ]
    )
