"""The state of ParameterServer's synchronous steps, held by ps 0's table server.

A synchronous step (`tfstrat.ps.sync`) needs a little shared state: the global step, which
step each worker last handed gradients in for and with how many rows, which workers the chief
took, how many fits each worker finished. It lives here, in ps 0's process, next to the table
server that serves it (`tfstrat.ps.tables.Registry`), so every check is one call and every
wait blocks on ps 0 until the state it waits for changes: no task reads TensorFlow variables
in a loop, and no step graph holds a loop across devices.

    open(group, workers, required)     -> the global step (creates the group's state once)
    mail(group, worker, step, rows, asks)
                                       -> 1 if recorded (the global step is still `step`), 0 if
                                          stale (a backup that came too late); `asks`: the
                                          worker's two stop requests (`_stopping`)
    wait_mailed(group, step, ms)       -> [ready, count, stop x2, mask...]: ready once
                                          `required` workers (or every running one, if fewer)
                                          mailed `step`; then `included` is recorded, and the
                                          step's stop: any request of the workers taken
    publish(group, step)               -> the global step, now step + 1
    wait_applied(group, worker, step, ms)
                                       -> [ready, left out, stop x2]: ready once the global
                                          step passed `step` or the chief finished the fit this
                                          worker is in; left out: it mailed `step` and was not
                                          taken; the step's stop, as the chief got it
    fit_done(group, worker)            -> 0 (the others stop waiting for it)
    exchange(group, worker, workers, call, values, ms)
                                       -> [ready, each worker's value count..., every
                                          worker's values, in worker order]: ready once all
                                          `workers` handed in their values of `call` (the
                                          caller's count of its exchanges): a custom loop's
                                          `strategy.reduce` and `gather` across workers;
                                          not ready: [0, whether each worker handed in...]
    begin_run(group, run, workers, ms) -> [ready, joined mask...]: the chief, as its strategy
                                          starts: a new `run` (16 random bytes) drops the
                                          group's step state; ready once every other
                                          worker joined after that. [-1, worker, its
                                          count]: a worker counts other workers
    join_run(group, worker, nonce, workers, ms)
                                       -> [ready, run...]: another worker, as its strategy
                                          starts; ready once the chief's run counted this
                                          call's `nonce`, with that run's id. [-1, the
                                          chief's count]: `workers` differs

A wait answers after at most `WAIT_MS` even when not ready, so the worker checks its own
deadline between calls (`Client` raises, naming the step and the workers). A group is one
ParameterServer strategy of the training processes (a second one in the same process gets
its own).

Runs. A ps can outlive its workers (started by hand, or relaunched workers against a ps that
stayed up): its variables stay, as TF1's did, and a relaunched chief continues from them (or
from its backup), but the step state of the failed run (who mailed what, fits finished) must
not: a stale mail would count as a new worker's, and a stale fit count would let the chief
step without a worker. So every run starts with a rendezvous on ps 0: the chief's
`begin_run` with a new id drops the group's state and waits for every other worker's
`join_run` made after that; a worker that joined earlier (before the new chief began) joins
again on its next call. The run's id, handed to every worker, keys what the workers publish
on ps 0 (`tfstrat.ps.variables.publish`), so nobody reads an earlier run's description.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from tfstrat.errors import UsageError

logger = logging.getLogger(__name__)

WAIT_MS = 1000  # the longest one wait blocks on the ps before the worker checks its deadline
MAX_WORKERS = 1 << 16  # a frame naming more workers is refused (no list of its length is made)


class _Group:
    def __init__(self, workers: int, required: int):
        self.workers, self.required = workers, required
        self.step = 0
        self.mailed = [-1] * workers  # the step each worker last mailed
        self.rows = [0.0] * workers  # that mail's weight
        self.included = [-1] * workers  # the last step the chief took each worker's mail in
        self.fits = [0] * workers  # fits each worker finished
        self.asks = [(0.0, 0.0)] * workers  # each worker's stop requests, with its last mail
        self.stops: dict[int, tuple[float, float]] = {}  # the last steps' agreed stops


class _Run:
    def __init__(self):
        self.run = b""  # the chief's current run, or b"" before its first
        self.joined: dict[int, bytes] = {}  # worker -> the nonce of its join, since `run` began
        self.members: dict[int, bytes] | None = None  # the joins the chief's run counted
        self.workers = 0  # the chief's count of workers
        self.counts: dict[int, int] = {}  # each joiner's count, since `run` began
        self.refused: set[int] = set()  # joiners whose count is not the chief's


class Steps:
    """Every group's state, behind one lock and condition (`Registry` serves the methods)."""

    METHODS = (
        "open", "mail", "wait_mailed", "publish", "wait_applied", "fit_done", "begin_run",
        "join_run", "exchange",
    )  # fmt: skip

    def __init__(self):
        self.groups: dict[int, _Group] = {}
        self.runs: dict[int, _Run] = {}
        # (group, call) -> ({worker: its values}, the workers that read the result)
        self.exchanges: dict[tuple[int, int], tuple[dict, set]] = {}
        self.changed = threading.Condition()

    def exchange(self, group, worker, workers, call, values, ms):
        w, n, key = int(worker), _check_workers(workers), (int(group), int(call))
        if not 0 <= w < n:
            raise UsageError(f"worker {w} is not one of the group's {n}")
        with self.changed:
            given, read = self.exchanges.setdefault(key, ({}, set()))
            if w not in given:
                given[w] = np.asarray(values, np.float64).reshape(-1)
                self.changed.notify_all()
            if not self.changed.wait_for(lambda: len(given) >= n, _seconds(ms)):
                return np.array([0, *(k in given for k in range(n))], np.float64)
            read.add(w)
            if len(read) >= n:  # everyone has it: forgotten
                self.exchanges.pop(key, None)
            parts = [given[k] for k in range(n)]
            return np.concatenate([[1.0], [float(len(p)) for p in parts], *parts])

    def begin_run(self, group, run, workers, ms):
        run, workers = _id(run), _check_workers(workers)
        with self.changed:
            r = self.runs.setdefault(int(group), _Run())
            if r.run != run:  # the chief's first call of this run
                old = self.groups.pop(int(group), None)  # `open` starts it afresh
                if old is not None:
                    logger.info(
                        "tfstrat server: a new run of ParameterServer group %d began; the "
                        "earlier run's step state dropped (global step %d, the step each "
                        "worker last mailed: %s, fits finished: %s)",
                        int(group),
                        old.step,
                        old.mailed,
                        old.fits,
                    )
                for key in [k for k in self.exchanges if k[0] == int(group)]:
                    del self.exchanges[key]  # an earlier run's half-done exchanges
                r.run, r.joined, r.members, r.workers = run, {}, None, workers
                r.counts, r.refused = {}, set()
                self.changed.notify_all()
            others = range(1, workers)
            other = lambda: [(w, c) for w, c in r.counts.items() if c != workers]  # noqa: E731
            joined = lambda: other() or all(w in r.joined for w in others)  # noqa: E731
            ready = self.changed.wait_for(joined, _seconds(ms))
            if other():  # a worker given another cluster: named at once, not timed out
                r.refused |= {w for w, _ in other()}
                self.changed.notify_all()
                return np.array([-1, *other()[0], *[0] * max(0, workers - 3)], np.int64)
            if ready and r.members is None:
                r.members = dict(r.joined)
                self.changed.notify_all()
            return np.array([ready, *(w in r.joined for w in others)], np.int64)

    def join_run(self, group, worker, nonce, workers, ms):
        w, nonce = int(worker), _id(nonce)
        _check_workers(workers)
        with self.changed:
            r = self.runs.setdefault(int(group), _Run())
            counted = lambda: r.members is not None and r.members.get(w) == nonce  # noqa: E731
            if not counted() and (r.joined.get(w) != nonce or r.counts.get(w) != int(workers)):
                r.joined[w], r.counts[w] = nonce, int(workers)
                r.refused.discard(w)
                self.changed.notify_all()
            self.changed.wait_for(lambda: counted() or w in r.refused, _seconds(ms))
            if w in r.refused:
                return np.array([-1, r.workers, *[0] * 15], np.int64)
            ready = counted()
            return np.array([ready, *(r.run if ready else bytes(16))], np.int64)

    def _group(self, group) -> _Group:
        try:
            return self.groups[int(group)]
        except KeyError:
            raise UsageError(
                f"no synchronous training group {int(group)} on this ps: was it restarted? "
                "Restart the training tasks too."
            ) from None

    def _worker(self, g: _Group, worker) -> int:
        w = int(worker)
        if not 0 <= w < g.workers:
            raise UsageError(f"worker {w} is not one of the group's {g.workers}")
        return w

    def open(self, group, workers, required):
        _check_workers(workers)
        if not 1 <= int(required) <= int(workers):
            raise UsageError(f"{int(required)} gradients per step of {int(workers)} worker(s)")
        with self.changed:
            g = self.groups.setdefault(int(group), _Group(int(workers), int(required)))
            if (g.workers, g.required) != (int(workers), int(required)):
                raise UsageError(
                    f"this ps runs group {int(group)} with {g.workers} worker(s), "
                    f"{g.required} per step; a task asked for {int(workers)}, {int(required)}"
                )
            return np.int64(g.step)

    def mail(self, group, worker, step, rows, asks):
        with self.changed:
            g = self._group(group)
            w = self._worker(g, worker)
            if g.step != int(step):
                return np.int64(0)
            g.mailed[w], g.rows[w] = int(step), float(rows)
            g.asks[w] = tuple(float(a) for a in np.reshape(asks, [2]))
            self.changed.notify_all()
            return np.int64(1)

    def wait_mailed(self, group, step, ms):
        s = int(step)
        with self.changed:
            g = self._group(group)

            def ready():
                running = sum(f <= g.fits[0] for f in g.fits)  # finished workers mail no more
                need = max(1, min(g.required, running))
                return sum(m == s for m in g.mailed) >= need

            if not self.changed.wait_for(ready, _seconds(ms)):
                return np.array([0, 0, 0, 0, *g.mailed], np.float64)
            mask = [m == s for m in g.mailed]
            for w, taken in enumerate(mask):
                if taken:
                    g.included[w] = s
            count = sum(r for r, taken in zip(g.rows, mask) if taken)
            taken = [a for a, t in zip(g.asks, mask) if t]
            g.stops[s] = stop = tuple(float(any(a[k] for a in taken)) for k in range(2))
            for old in [k for k in g.stops if k < s - 16]:  # a late worker asks a few back
                del g.stops[old]
            return np.array([1, count, *stop, *mask], np.float64)

    def publish(self, group, step):
        with self.changed:
            g = self._group(group)
            g.step = int(step) + 1
            self.changed.notify_all()
            return np.int64(g.step)

    def wait_applied(self, group, worker, step, ms):
        s = int(step)
        with self.changed:
            g = self._group(group)
            w = self._worker(g, worker)
            # Once the chief finished the fit this worker is in, no step is applied: the
            # worker's remaining gradients are dropped.
            done = lambda: g.step > s or g.fits[0] > g.fits[w]  # noqa: E731
            if not self.changed.wait_for(done, _seconds(ms)):
                return np.array([0, 0, 0, 0], np.float64)
            left_out = g.mailed[w] == s and g.included[w] != s
            return np.array([1, left_out, *g.stops.get(s, (0.0, 0.0))], np.float64)

    def fit_done(self, group, worker):
        with self.changed:
            g = self._group(group)
            g.fits[self._worker(g, worker)] += 1
            self.changed.notify_all()
            return np.int64(0)


def _check_workers(workers) -> int:
    """A frame's worker count, refused past `MAX_WORKERS` (state is kept per worker)."""
    n = int(workers)
    if not 1 <= n <= MAX_WORKERS:
        raise UsageError(f"{n} workers: a group has 1 to {MAX_WORKERS:,}")
    return n


def _other_cluster(worker: str, count: int, chief: str, chief_count: int):
    from tfstrat.errors import AgreementError

    return AgreementError(
        f"tfstrat: {worker} has {count} chief and worker task(s) in its TF_CONFIG cluster; "
        f"{chief} has {chief_count}. Give every task the same TF_CONFIG cluster "
        "(only 'task' differs)."
    )


def _id(value) -> bytes:
    value = np.asarray(value)
    if value.dtype != np.uint8 or value.shape != (16,):
        raise UsageError(f"a run id is 16 bytes (uint8), not {value.dtype} {value.shape}")
    return value.tobytes()


def _seconds(ms) -> float:
    return min(max(int(ms), 0), WAIT_MS) / 1000


class Client:
    """A worker's calls, as graph ops run in its own process (`tf.numpy_function`), over its
    own connection to ps 0's table server (a lock keeps them one at a time)."""

    def __init__(self, address: str, timeout: float, device: str, group: int, worker: int):
        """`address`: ps 0's table server (`tfstrat.ps.tables.rpc_address`)."""
        from tfstrat.ps import wire

        self.connection = wire.Connection(address, timeout, "ps:0")
        self.timeout, self.device, self.group, self.worker = timeout, device, group, worker
        self.lock = threading.Lock()
        self.calls = 0  # exchanges made, the next one's number

    def call(self, method: str, *args) -> np.ndarray:
        with self.lock:
            name = f"steps_{method}"
            self.connection.send(name, np.int64(self.group), *map(np.asarray, args))
            return self.connection.receive(name)[0]

    def _op(self, fn, inputs, dtype):
        import tensorflow as tf

        with tf.device(self.device):  # runs in this worker's process
            return tf.numpy_function(fn, list(inputs), tf.as_dtype(dtype), stateful=True)

    # -- graph ops ----------------------------------------------------------------------

    def begin(self, workers: int, required: int):
        out = self._op(lambda: self.call("open", workers, required), [], "int64")
        return _scalar(out)

    def mail(self, step, rows, asks):
        """1 if recorded, 0 if stale; `asks`: this worker's two stop requests (float32)."""
        fn = lambda s, r, a: self.call("mail", self.worker, s, r, a)  # noqa: E731
        return _scalar(self._op(fn, [step, rows, asks], "int64"))

    def wait_mailed(self, step, why):
        """(the workers taken as a bool vector, the sum of their rows, the step's stop
        requests); raises after the timeout with `why(step, the step each worker last
        mailed)`."""

        def wait(s):
            out = self._until(lambda ms: self.call("wait_mailed", s, ms), why, s, skip=4)
            return out[1:].astype(np.float32)

        out = self._op(wait, [step], "float32")
        return out[3:] > 0, out[0], out[1:3]

    def wait_applied(self, step, why):
        """(1 if this worker mailed `step` and the chief left it out, else 0; the step's stop
        requests), once the step was applied (or the chief finished its fit); raises after the
        timeout with `why(step, [])`."""

        def wait(s):
            out = self._until(lambda ms: self.call("wait_applied", self.worker, s, ms), why, s)
            return out[1:].astype(np.float32)

        import tensorflow as tf

        out = self._op(wait, [step], "float32")
        return tf.cast(out[0], tf.int64), out[1:3]

    def publish(self, step):
        return _scalar(self._op(lambda s: self.call("publish", s), [step], "int64"))

    def fit_done(self) -> None:
        """Eager, at the end of each of this worker's fits."""
        self.call("fit_done", self.worker)

    def exchange(self, values, workers: int, what: str, names: list[str]):
        """Every worker's `values` (a float64 vector) as a graph op: [each worker's count,
        their values in worker order]. Every worker must make the same exchanges in the same
        order (they are matched by count); raises after the timeout naming who did not come."""
        import tensorflow as tf

        def run(v):
            with self.lock:
                call, self.calls = self.calls, self.calls + 1

            def why(_, given):
                missing = [names[k] for k, g in enumerate(given) if not g]
                return (
                    f"tfstrat ParameterServer: {names[self.worker]} waited {self.timeout:g} s "
                    f"on ps:0 in {what} (its call {call} across workers) for "
                    f"{', '.join(missing)}. Every worker must make the same strategy.reduce "
                    "and strategy.gather calls, in the same order; see their logs."
                )

            ask = lambda ms: self.call("exchange", self.worker, workers, call, v, ms)  # noqa: E731
            return self._until(ask, why, call, skip=1)[1:]

        with tf.device(self.device):
            return tf.numpy_function(run, [values], tf.float64, stateful=True)

    def start_run(self, workers: int, names: list[str]) -> bytes:
        """Eager, as the strategy starts: the run's id (the chief's new random bytes), once
        the chief and every other worker met on ps 0; raises after the timeout naming who
        did not come."""
        import os

        mine = np.frombuffer(os.urandom(16), np.uint8)
        named = lambda w: names[w] if w < len(names) else f"worker:{w}"  # noqa: E731
        if self.worker == 0:
            out = self._until(lambda ms: self.call("begin_run", mine, workers, ms), None, 0)
            if out[0] == -1:
                raise _other_cluster(named(int(out[1])), int(out[2]), names[0], workers)
            if out[0]:
                return mine.tobytes()
            missing = [names[w] for w, joined in enumerate(out[1:], 1) if not joined]
            raise TimeoutError(
                f"tfstrat ParameterServer: {names[0]} waited {self.timeout:g} s on ps:0 for "
                f"{', '.join(missing)} to start (a run begins when every worker has). Start "
                "every worker of TF_CONFIG's cluster; see their logs."
            )
        call = lambda ms: self.call("join_run", self.worker, mine, workers, ms)  # noqa: E731
        out = self._until(call, None, 0)
        if out[0] == -1:
            raise _other_cluster(named(self.worker), workers, names[0], int(out[1]))
        if out[0]:
            return out[1:].astype(np.uint8).tobytes()
        raise TimeoutError(
            f"tfstrat ParameterServer: {names[self.worker]} waited {self.timeout:g} s on ps:0 "
            f"for {names[0]} to start the run. Start it; see its log."
        )

    def _until(self, call, why, step, skip: int = 2):
        """`call(ms)` until its answer's first number says ready; after the timeout raises
        `why(step, the answer's numbers from `skip` on)`."""
        deadline = time.monotonic() + self.timeout
        # Each wait well inside the connection's own timeout (the strategy's): a late answer
        # must not end the connection before this names what it waited for.
        ms = max(1, min(WAIT_MS, int(self.timeout * 500)))
        while True:
            out = call(ms)
            if out[0]:
                return out
            if time.monotonic() > deadline:
                if why is None:  # the caller names what it waited for
                    return out
                raise TimeoutError(why(int(step), out[skip:].astype(np.int64).tolist()))


def _scalar(t):
    import tensorflow as tf

    return tf.reshape(t, [])
