"""Embedding tables held by ps tasks, served over tfstrat's own TCP calls (`tfstrat.ps.wire`).

Hybrid's workers run collectives, which cannot share a process with remote eager devices
(TensorFlow's eager context refuses both), so its tables live in a table server on each ps task: NumPy arrays in the
ps's memory, updated row by row, reached by a few methods over one TCP connection per worker.
Tables are addressed by number (a ps starts before any model exists):

    create(table, rows, dim, workers, init)    -> 0     (idempotent; `init` is JSON bytes)
    lookup(table, ids, step)                   -> rows, flattened, once steps < step are applied
    push(table, step, ids, grads, hyper, rows, replica) -> the table's version after this push
    read(table, lo, hi[, step]) / write(table, lo, v) -> rows lo..hi, flattened, once steps
                                               < step are applied (no step: all) / 0
    slots(table)                               -> the numbers of its optimizer slots (SLOTS)
    read_slot(table, slot, lo, hi[, step])     -> rows lo..hi of a slot, flattened
    write_slot(table, slot, lo, v)             -> 0     (creates the slot if needed)
    drop(table, droppers)                      -> 0     (once `droppers` calls came: the
                                                        partition search's trial tables, a
                                                        table that went back to the workers)
    put_meta(key, value) / get_meta(key)       -> 0 / value, -1 if unset (the chief's choices)
    stats() / cpu()                            -> this process's peak RSS, MB / CPU seconds
    steps_*                                    -> ParameterServer's synchronous steps (`tfstrat.ps.steps`)

A table collects the pushes of one step from every worker and, on the last, applies their sum
(the workers do not wait for it: their all-reduce runs meanwhile, and the next step's lookups,
and any read, wait here until the step is applied) with a row-wise (lazy) optimizer update: only the pushed rows of the table and of its slots
change. Each push carries its rows' gradient already multiplied by its weight and that weight
(`rows`: the replica's batch rows, `tfstrat.ps.remote`); the sum is divided by the sum of the
weights, so replicas of unequal batches give the global batch's mean gradient (the same
weighting `tfstrat.strategies._exact_step` gives mirrored variables) before any optimizer (SGD,
Adagrad, Adam, RMSprop) or slot sees it. Pushes of weight 0 (a step whose loss Keras did not
scale, a partition trial) are summed as they are. A step whose pushes carry the optimizer kind
-1 was skipped by the loss scaling on every worker (`mixed_float16`, `tfstrat.keras._loss_scale`):
it is counted and nothing is applied, not even weight decay. Each worker pushes once per step (a
worker's replicas push together, `tfstrat.ps.remote`; a second
push is refused, naming the cause). The steps are `tfstrat.ps.rowmath`'s: SGD and Adagrad equal
Keras's dense update on the same gradient; Adam, SGD with momentum and RMSprop are the lazy
variants (rows not in the batch keep their slots and values).

Weight decay (AdamW, or any Keras optimizer's `weight_decay`) multiplies every row of the table
by (1 - weight_decay * learning_rate) each step before the update, as Keras does; here a row
takes the product of the factors since it was last written when it is next read or updated
(`Decay`), so a step still costs only its rows.

Checkpoints read and write the slots with the table (`tfstrat.keras._ps_tables`), so a
run restored from one continues exactly. Adam's bias correction needs no state here: each push
carries the step, which is the worker's `optimizer.iterations` (saved with the optimizer).

The server listens on the ps task's tfstrat port (TF_CONFIG port + 1, `tfstrat.cluster.ports`) on the
ps's own address towards the workers; the TF_CONFIG port itself serves `tf.distribute.Server`.
"""

from __future__ import annotations

import json
import logging
import threading

import numpy as np

from tfstrat.errors import UsageError
from tfstrat.ps import rowmath as _rowmath
from tfstrat.ps import steps as _steps

logger = logging.getLogger(__name__)

# hyper = [kind, learning_rate, beta_1, beta_2, epsilon, initial_accumulator_value,
#          momentum, nesterov, rho, 1 - beta_1, 1 - beta_2, 1 - rho, weight_decay] (the
#          differences computed in float64 on the worker, as Keras; weight_decay 0 when the
#          optimizer does not decay this table); kind numbers the `tfstrat.ps.rowmath` step
KINDS = ("sgd", "adagrad", "adam", "sgd_momentum", "rmsprop", "rmsprop_momentum")
HYPER = 13
SLOTS = ("accumulator", "momentum", "velocity")  # slot numbers in the calls


def rpc_address(ps_address: str) -> str:
    """Where workers reach a ps task's table server: its TF_CONFIG host, its tfstrat port."""
    from tfstrat.cluster import ports as _ports

    return _ports.join(_ports.split(ps_address)[0], _ports.tfstrat_port(ps_address))


class Decay:
    """Weight decay of every row, applied lazily: the log of each decayed step's factor
    (1 - weight_decay * learning_rate) is summed in `log`, and `seen[row]` is the entry of
    `log` the row's stored value already includes. A row's value is its stored value times
    exp(log[-1] - log[seen[row]])."""

    def __init__(self, rows: int):
        self.log = np.zeros(1024, np.float64)
        self.steps = 0  # entries of `log` in use, after the first (0)
        self.seen = np.zeros(rows, np.int64)

    def step(self, weight_decay: float, learning_rate: float) -> None:
        if self.steps + 1 == len(self.log):
            self.log = np.concatenate([self.log, np.zeros_like(self.log)])
        factor = 1.0 - float(weight_decay) * float(learning_rate)
        self.log[self.steps + 1] = self.log[self.steps] + np.log(factor)
        self.steps += 1

    def factors(self, rows) -> np.ndarray:
        """The pending factor of each of `rows` (an index array or a slice), shape [n, 1]."""
        pending = self.log[self.steps] - self.log[self.seen[rows]]
        return np.exp(pending).astype(np.float32)[:, None]

    def settle(self, value: np.ndarray, rows) -> None:
        """Applies the pending decay of `rows` to `value` (the table) in place."""
        value[rows] *= self.factors(rows)
        self.seen[rows] = self.steps

    def written(self, rows) -> None:
        """`rows` were just written whole (a restore): nothing is pending for them."""
        self.seen[rows] = self.steps


class Table:
    """One table (or one part of a partitioned table) and its optimizer slots, in NumPy."""

    def __init__(self, rows: int, dim: int, workers: int, init: dict):
        self.rows, self.dim, self.workers = rows, dim, workers
        self.value = _initial(rows, dim, init)
        self.decay: Decay | None = None  # made at the first step with weight decay
        self.drops = 0  # workers that dropped it (`Registry.drop`)
        self.slots: dict[str, np.ndarray] = {}
        self.pending: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # replica -> its push
        self.pending_rows = 0.0  # the sum of the pending pushes' weights
        self.pending_step = None
        self.version = 0
        self.lock = threading.Lock()
        self.applied = threading.Condition(self.lock)  # notified when pushes are applied
        # How long a lookup or read waits for a step's missing pushes: under the workers'
        # own timeout, so the error naming the missing replicas reaches them first.
        self.wait_s = 0.75 * float(init.get("timeout", 400.0))

    def check(self, ids: np.ndarray) -> np.ndarray:
        """`ids` as int64, or a ValueError naming the first outside 0..rows-1 (NumPy would
        count a negative id from the end)."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        bad = ids[(ids < 0) | (ids >= self.rows)]
        if len(bad):
            raise UsageError(
                f"id {int(bad[0])} is outside this table part's rows 0..{self.rows - 1}. "
                "Embedding inputs must be in [0, input_dim)."
            )
        return ids

    def lookup(self, ids, step=-1):
        """The rows of `ids`, once every earlier step (< `step`) pushed here is applied."""
        ids = self.check(ids)
        with self.lock:  # never half-way through a step's update
            self.wait_applied(int(step))
            return self.rows_of(ids).reshape(-1)

    def rows_of(self, rows) -> np.ndarray:
        """The values of `rows` (an index array or a slice), decay applied (hold `lock`)."""
        if self.decay is None:
            return self.value[rows]
        return self.value[rows] * self.decay.factors(rows)

    def wait_applied(self, step: int | None = None):
        """Waits (holding `lock`) until no step before `step` (None: no step at all) has
        pushes pending. Workers push without waiting for the update (it overlaps their
        all-reduce), so the next step's lookups and a checkpoint's reads wait here instead."""

        def ready():
            return not self.pending or (step is not None and self.pending_step >= step)

        if not self.applied.wait_for(ready, self.wait_s):
            missing = sorted(set(range(self.workers)) - set(self.pending))
            raise UsageError(
                f"tfstrat table: waited {self.wait_s:g} s for step {self.pending_step}'s "
                f"pushes; worker(s) {missing} never pushed (of {self.workers}). A worker "
                "failed or stopped early; its own output says why."
            )

    def push(self, step, ids, grads, hyper, rows, replica=0):
        ids = self.check(ids)
        grads = np.asarray(grads, np.float32).reshape(-1, self.dim)
        if len(grads) != len(ids):
            raise UsageError(f"a push of {len(ids)} ids carried {len(grads)} gradient rows")
        step, replica = int(step), int(replica)
        with self.lock:
            if self.pending and step != self.pending_step:
                raise UsageError(
                    f"tfstrat table: a push for step {step} while step "
                    f"{self.pending_step} has {len(self.pending)} of {self.workers} pushes. "
                    "Every worker must run the same steps (after a failed step, restart the ps "
                    "tasks with the workers, or restore a checkpoint: that clears them)."
                )
            if replica in self.pending:
                raise UsageError(
                    f"tfstrat table: worker {replica} pushed step {step} twice. Is the "
                    "Embedding layer called twice in one step? Call each layer once per step "
                    "(reuse its output), or keep the table mirrored: Hybrid(sparse=[...])."
                )
            self.pending[replica] = (ids, grads)
            self.pending_rows += float(rows)
            self.pending_step = step
            if len(self.pending) == self.workers:
                # In replica order, so every run sums the same way; the step's pushes are
                # dropped before the update, so a failed update cannot wedge the next step.
                pushes = [self.pending[r] for r in sorted(self.pending)]
                weight, self.pending, self.pending_rows = self.pending_rows, {}, 0.0
                unique, summed = _sum_rows(pushes, self.dim)
                if weight > 0:  # the global batch's mean, as one device computes it
                    summed /= np.float32(weight)
                hyper = np.asarray(hyper, np.float32)
                try:
                    if hyper[0] >= 0:  # kind -1: a step the loss scaling skipped everywhere
                        self._apply(unique, summed, hyper, step)
                finally:
                    self.applied.notify_all()
                self.version += 1
            return self.version

    def slot(self, name: str, fill: float) -> np.ndarray:
        if name not in self.slots:
            self.slots[name] = np.full((self.rows, self.dim), fill, np.float32)
        return self.slots[name]

    def _apply(self, ids, grads, hyper, step):
        """The optimizer step for the rows `ids` (unique), float32 as Keras (`tfstrat.ps.rowmath`)."""
        kind, lr, beta_1, beta_2, epsilon, initial_accumulator, momentum, nesterov, rho = hyper[:9]
        one_minus_beta_1, one_minus_beta_2, one_minus_rho, weight_decay = hyper[9:]
        if not 0 <= int(kind) < len(KINDS):
            raise UsageError(f"tfstrat table: unknown optimizer kind {kind}")
        name = KINDS[int(kind)]
        fills = {"accumulator": float(initial_accumulator)}
        slots = {n: self.slot(n, fills.get(n, 0.0)) for n in _rowmath.SLOTS[name]}
        if weight_decay > 0 and self.decay is None:
            self.decay = Decay(self.rows)
        if self.decay is not None:  # Keras decays every row, then updates (a 0 keeps the rows)
            self.decay.step(weight_decay, lr)
            self.decay.settle(self.value, ids)
        t = np.float32(step + 1)
        new_rows, delta = _rowmath.STEPS[name](
            {n: slot[ids] for n, slot in slots.items()},
            grads,
            lr=lr,
            one_minus_beta_1=one_minus_beta_1,
            one_minus_beta_2=one_minus_beta_2,
            one_minus_rho=one_minus_rho,
            epsilon=epsilon,
            beta_1_power=np.power(beta_1, t),
            beta_2_power=np.power(beta_2, t),
            momentum=momentum,
            nesterov=bool(nesterov),
            rho=rho,
            sqrt=np.sqrt,
        )
        for n, rows in new_rows.items():
            slots[n][ids] = rows
        self.value[ids] -= delta


def _sum_rows(pushes, dim: int):
    """(unique ids, each id's summed gradient) over `[(ids, grads), ...]`, summed in order.

    A worker pushes each id once (it sums its repeats first), so each push adds its rows with
    one indexed `+=`; `np.add.at`, which allows repeats, is ~10x slower (0.5 ms for 1,400 x 64
    rows) and is left for a push that repeats an id.
    """
    unique = np.unique(np.concatenate([ids for ids, _ in pushes]))
    summed = np.zeros((len(unique), dim), np.float32)
    for ids, grads in pushes:
        positions = np.searchsorted(unique, ids)
        if len(np.unique(positions)) == len(positions):
            summed[positions] += grads
        else:
            np.add.at(summed, positions, grads)
    return unique, summed


# A table in parts is drawn whole (then sliced) up to this size, so it starts as on one device;
# a larger one is drawn part by part (another draw: a ps then never holds the whole table).
WHOLE_DRAW_BYTES = 256 << 20


def _initial(rows: int, dim: int, init: dict) -> np.ndarray:
    """The initial rows: from a Keras initializer's config and seed, computed on the ps. A part
    of a table (`init["first"]`, `init["total"]` rows in all) is its rows of the whole table's
    draw, so a table split into parts starts as the same table on one device does (up to
    `WHOLE_DRAW_BYTES`; a larger table's parts are drawn each on its own)."""
    if init.get("zeros", False):
        return np.zeros((rows, dim), np.float32)
    first, total = int(init.get("first", 0)), int(init.get("total", rows))
    if total != rows and total * dim * 4 > WHOLE_DRAW_BYTES:
        logger.info(
            "tfstrat server: a part of a %d x %d table drawn on its own (over %d MiB): its "
            "initial values differ from one device's draw of the whole table",
            total, dim, WHOLE_DRAW_BYTES >> 20,
        )  # fmt: skip
        if isinstance(init.get("seed"), int):  # parts of one shape must not repeat each other
            init = dict(init, seed=init["seed"] + first)
        first, total = 0, rows
    spec = json.dumps({k: v for k, v in init.items() if k not in ("first", "last", "total")})
    whole = _drawn(spec, total, dim)
    part = whole if rows == total else np.array(whole[first : first + rows], np.float32)
    if init.get("last", True) or rows == total:  # this ps's last part: the draw is not kept
        _last_draw.clear()
    return part


_last_draw: dict = {}  # the whole table drawn for a part: this ps's next part of it reuses it


def _drawn(spec: str, rows: int, dim: int) -> np.ndarray:
    key = (spec, rows, dim)
    if key not in _last_draw:
        import keras

        init = json.loads(spec)
        initializer = keras.initializers.deserialize(init["initializer"])
        if init.get("seed") is not None and hasattr(initializer, "seed"):
            initializer.seed = init["seed"]
        _last_draw.clear()
        _last_draw[key] = np.array(initializer((rows, dim), dtype="float32"), np.float32)
    return _last_draw[key]


class Registry:
    """The tables of one ps task, by number: the methods the workers call (`wire.Server`)."""

    METHODS = frozenset(
        "begin create drop put_meta get_meta lookup push read write slots read_slot write_slot "
        "stats cpu".split()
    ) | {f"steps_{name}" for name in _steps.Steps.METHODS}

    def __init__(self):
        self.tables: dict[int, Table] = {}
        self.meta: dict[int, int] = {}
        self.lock = threading.Lock()
        self.run: bytes | None = None  # the run the tables belong to (`begin`)
        self.steps = _steps.Steps()  # ParameterServer's synchronous steps (ps 0's)
        for name in _steps.Steps.METHODS:
            setattr(self, f"steps_{name}", getattr(self.steps, name))

    def get(self, table) -> Table:
        try:
            return self.tables[int(table)]
        except KeyError:
            raise UsageError(f"tfstrat table {int(table)} does not exist on this ps") from None

    def begin(self, run):
        """A run of the job starts (every worker says so before its first table call, with the
        id its workers agreed on): a new run finds this ps as a fresh one would be, every table,
        its pending pushes and meta of an earlier run dropped (a relaunch against a ps that
        survived its workers: the failed step's pushes must not block the new run's first).
        Returns 1 if this call cleared the ps, else 0."""
        run = np.asarray(run)
        if run.dtype != np.uint8 or run.shape != (16,):
            raise UsageError(f"a run id is 16 bytes (uint8), not {run.dtype} {run.shape}")
        run = run.tobytes()
        with self.lock:
            if run == self.run:
                return _ZERO
            dropped = len(self.tables)
            pending = sum(len(t.pending) for t in self.tables.values())
            for t in self.tables.values():
                with t.lock:  # a straggler of the old run waiting on a step is woken
                    t.pending, t.pending_rows = {}, 0.0
                    t.applied.notify_all()
            first = self.run is None
            self.tables, self.meta, self.run = {}, {}, run
        if not first:
            logger.info(
                "tfstrat server: a new run of the job began; %d table(s) and %d pending push(es) "
                "of the earlier run dropped",
                dropped,
                pending,
            )
        return np.int64(0 if first else 1)

    def create(self, table, rows, dim, workers, init):
        with self.lock:
            key = int(table)
            if key not in self.tables:
                spec = json.loads(bytes(init).decode())
                self.tables[key] = Table(int(rows), int(dim), int(workers), spec)
                logger.info("tfstrat server: table %d, %d x %d", key, int(rows), int(dim))
            return _ZERO

    def drop(self, table, droppers=1):
        with self.lock:
            found = self.tables.get(int(table))
            if found is not None:  # a worker may still read it until every one dropped it
                found.drops += 1
                if found.drops >= int(droppers):
                    del self.tables[int(table)]
        return _ZERO

    def put_meta(self, key, value):
        self.meta[int(key)] = int(value)
        return _ZERO

    def get_meta(self, key):
        return np.int64(self.meta.get(int(key), -1))

    def stats(self):
        """This ps process's peak resident memory, MB (for `tfstrat bench sparse`)."""
        import resource

        return np.float64(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)

    def cpu(self):
        """This ps process's CPU seconds so far, user and system (for `tfstrat bench
        cluster`'s ps rows)."""
        import resource

        usage = resource.getrusage(resource.RUSAGE_SELF)
        return np.float64(usage.ru_utime + usage.ru_stime)

    def lookup(self, table, ids, step=-1):
        return self.get(table).lookup(ids, step)

    def push(self, table, step, ids, grads, hyper, rows, replica=0):
        if np.size(hyper) != HYPER:
            raise UsageError(
                f"a push carried {np.size(hyper)} optimizer numbers; this ps expects {HYPER}. "
                "Do the workers and the ps run the same tfstrat version?"
            )
        return np.int64(self.get(table).push(step, ids, grads, hyper, rows, replica))

    def read(self, table, lo, hi, step=None):
        """Rows lo..hi once every step before `step` (None: every step pushed) is applied."""
        t = self.get(table)
        lo, hi = _rows(table, t, lo, hi)
        with t.lock:
            t.wait_applied(None if step is None else int(step))
            return np.array(t.rows_of(slice(lo, hi)), copy=True).reshape(-1)

    def write(self, table, lo, values):
        t = self.get(table)
        rows = _values(t, values)
        lo, hi = _rows(table, t, lo, int(lo) + len(rows))
        with t.lock:
            t.value[lo:hi] = rows
            if t.decay is not None:
                t.decay.written(slice(lo, hi))
            if t.pending:  # a restore starts afresh: a failed step's pushes are void
                logger.info("tfstrat server: table %d restored; %d pushes of step %s dropped",
                            int(table), len(t.pending), t.pending_step)  # fmt: skip
                t.pending, t.pending_rows = {}, 0.0
                t.applied.notify_all()
        return _ZERO

    def slots(self, table):
        names = self.get(table).slots
        return np.array([i for i, name in enumerate(SLOTS) if name in names], np.int64)

    def read_slot(self, table, slot, lo, hi, step=None):
        t = self.get(table)
        name = _slot(slot)
        lo, hi = _rows(table, t, lo, hi)
        if name not in t.slots:
            raise UsageError(f"tfstrat table {int(table)} has no slot {name!r}")
        with t.lock:
            t.wait_applied(None if step is None else int(step))
            return t.slots[name][lo:hi].reshape(-1).copy()

    def write_slot(self, table, slot, lo, values):
        t = self.get(table)
        name, rows = _slot(slot), _values(t, values)
        lo, hi = _rows(table, t, lo, int(lo) + len(rows))
        with t.lock:  # never between a step's update of the table and of its slots
            t.slot(name, 0.0)[lo:hi] = rows
        return _ZERO


_ZERO = np.int64(0)


def _rows(table, t: Table, lo, hi) -> tuple[int, int]:
    """Row bounds a read or write names, refused unless 0 <= lo <= hi <= the table's rows."""
    lo, hi = int(lo), int(hi)
    if not 0 <= lo <= hi <= t.rows:
        raise UsageError(f"rows {lo}..{hi} of tfstrat table {int(table)}, which has {t.rows}")
    return lo, hi


def _values(t: Table, values) -> np.ndarray:
    """A write's values as rows of the table's width, refused if they do not make whole rows."""
    flat = np.asarray(values, np.float32).reshape(-1)
    if flat.size % t.dim:
        raise UsageError(f"{flat.size} values are not whole rows of {t.dim}")
    return flat.reshape(-1, t.dim)


def _slot(slot) -> str:
    if not 0 <= int(slot) < len(SLOTS):
        raise UsageError(f"slot {int(slot)}: the slots are 0..{len(SLOTS) - 1} {SLOTS}")
    return SLOTS[int(slot)]


def serve_tables(host: str, port: int, task: str, what: str = "table server"):
    """Starts the table server of `task` on `host`:`port`; returns (server, registry).
    Raises `tfstrat.errors.ListenError` naming the task and `what` if it cannot listen."""
    from tfstrat.ps import wire

    registry = Registry()
    return wire.serve(host, port, registry, task, what), registry
