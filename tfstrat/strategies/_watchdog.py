"""No hang in TensorFlow's collectives, at the cost of one thread per process, not one per op.

`CommunicationOptions(timeout_seconds=T)` makes TensorFlow 2.21 start, for every collective op
it runs, a detached thread that sleeps for the whole timeout (`collective_util.py`: "only for
debugging"): in training steps the threads of the last T seconds are all alive at once, and a
long run aborts ("Resource temporarily unavailable"). So tfstrat's collectives carry no
per-op timeout, and this watchdog bounds them instead:

- A function whose graph holds a tfstrat collective is marked when it is traced (`mark`, from
  the collective launcher); each eager call of a marked function (and each eager collective) is
  a *wait* (`guard`): its start time, kept in a dict, ended when the call returns.
- Every step a strategy runs bumps a counter variable on the host CPU (`tick`, traced into the
  step): a call of many steps (`steps_per_execution`, a `tf.range` loop) makes progress as
  long as new steps begin.
- One thread (started with the first wait) reads the counter every few seconds while a wait is
  open. When a wait has seen no step begin for `timeout` seconds, it asks every peer task's
  gRPC server whether it answers (`check_collective_ops_peer_health`), names the ones that do
  not (dead, stopped, cut off) or, when all answer, the ones that have not joined, logs that
  line and aborts this process's collectives with it
  (`context.context().abort_collective_ops`): the waiting step fails with that message.

A dead task is also noticed by TensorFlow's coordination service (its heartbeats), which
fails the others' collectives on its own. An aborted process cannot run collectives again: the
error ends the program, as a timed-out collective did.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import inspect
import itertools
import logging
import threading
import time

import tensorflow as tf

from tfstrat._compat import patches
from tfstrat._compat.tf import concrete_function, context
from tfstrat.errors import VersionError

logger = logging.getLogger(__name__)

_POLL = 5.0  # at most this many seconds between two reads of the step counter
_PROBE = 5.0  # seconds a peer has to answer the health probe


class _Wait:
    __slots__ = ("start", "timeout", "what")

    def __init__(self, timeout: float, what: str):
        self.start, self.timeout, self.what = time.monotonic(), timeout, what


class Watchdog:
    """This process's watch over its collectives (`WATCHDOG`; strategies `configure` it)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._waits: dict[int, _Wait] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._idle = False  # the thread waits for a first wait (a new one must wake it)
        self._steps: tf.Variable | None = None
        self._seen = (None, 0.0)  # (counter value, monotonic time it was first seen)
        self.me = "this task"
        self.peers: list[tuple[str, str]] = []  # (task name, its device prefix)
        #: The message the watchdog aborted the collectives with, once it has.
        self.fired: str | None = None

    def configure(self, me: str, peers: list[tuple[str, str]]) -> None:
        """Names this task and its peers (`("worker:1", "/job:worker/replica:0/task:1")`),
        and makes the step counter. Call it where no strategy scope is open (a strategy's
        `__init__`): inside one, a variable would be mirrored."""
        self.me, self.peers = me, list(peers)
        if self._steps is None:
            with tf.init_scope(), tf.device("CPU:0"):
                self._steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="tfstrat_steps")
        _install()

    # -- traced into functions ----------------------------------------------------------------

    def tick(self) -> None:
        """While a step is traced: the step bumps the counter when it begins (no data or
        control edge to anything else in it)."""
        if self._steps is not None and not tf.executing_eagerly():
            self._steps.assign_add(1)

    @staticmethod
    def mark(timeout: float | None) -> None:
        """While a collective is traced: every enclosing function's eager calls are waits of
        `timeout` seconds (None: not watched)."""
        if timeout is None or tf.executing_eagerly():
            return
        graph = tf.compat.v1.get_default_graph()
        while graph is not None:
            if getattr(graph, "_tfstrat_watch", 0) < timeout:
                graph._tfstrat_watch = timeout
            graph = getattr(graph, "outer_graph", None)

    # -- around eager calls -------------------------------------------------------------------

    @contextlib.contextmanager
    def guard(self, timeout: float, what: str):
        """The body (an eager call that runs collectives) is a wait of `timeout` seconds."""
        key = next(self._ids)
        with self._cond:
            self._waits[key] = _Wait(timeout, what)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch, name="tfstrat-watchdog", daemon=True
                )
                self._thread.start()
            elif self._idle:
                self._idle = False
                self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                del self._waits[key]

    def _watch(self) -> None:
        while True:
            with self._cond:
                while not self._waits:
                    self._idle = True
                    self._cond.wait()
                oldest = min(self._waits.values(), key=lambda w: w.start)
            since = max(oldest.start, self._progress())
            late = time.monotonic() - since - oldest.timeout
            if late >= 0:
                with self._cond:  # still open (not ended while the counter was read)?
                    if oldest not in self._waits.values():
                        continue
                self._fire(oldest, time.monotonic() - since)
                return
            with self._cond:
                self._cond.wait(min(-late, _POLL, oldest.timeout / 4))

    def _progress(self) -> float:
        """When the step counter last moved (as far as this thread has seen)."""
        if self._steps is None:
            return 0.0
        value = int(self._steps.read_value().numpy())
        if value != self._seen[0]:
            self._seen = (value, time.monotonic())
        return self._seen[1]

    def _fire(self, wait: _Wait, waited: float) -> None:
        message = self.diagnosis(wait, waited, _probe(self.peers))
        self.fired = message
        logger.error("%s", message)
        context.context().abort_collective_ops(tf.errors.DEADLINE_EXCEEDED, message)

    def diagnosis(self, wait: _Wait, waited: float, silent: dict[str, str]) -> str:
        """The line a timed-out wait fails with. `silent`: peer name -> why it did not answer."""
        head = (
            f"tfstrat: {self.me}: {wait.what} waited {waited:.0f} s (timeout={wait.timeout:g}) "
            "in TensorFlow's collectives"
        )
        named = lambda n, d: f"{n} ({d})"  # noqa: E731
        if silent:
            who = ", ".join(f"{named(n, d)}: {silent[n]}" for n, d in self.peers if n in silent)
            return (
                f"{head}; these peers do not answer (dead, stopped or cut off): {who}. "
                "Collectives aborted."
            )
        if self.peers:
            who = ", ".join(named(n, d) for n, d in self.peers)
            return (
                f"{head}; every peer answers, and {who} did not join within the timeout (stuck, "
                "or busy outside the step: a long callback, a slow input pipeline). Collectives "
                "aborted; raise `timeout=` if a step can take longer."
            )
        return (
            f"{head} among this process's own devices (no other task). Collectives aborted; "
            "raise `timeout=` if a step can take longer."
        )


def _probe(peers: list[tuple[str, str]]) -> dict[str, str]:
    """{peer name: why} for each peer whose gRPC server does not answer within `_PROBE` s."""
    if not peers:
        return {}

    def ask(device: str):
        try:
            context.context().check_collective_ops_peer_health(
                device, timeout_in_ms=int(_PROBE * 1000)
            )
        except tf.errors.OpError as e:
            return f"{type(e).__name__}: {e.message.splitlines()[0] if e.message else ''}"
        return None

    with concurrent.futures.ThreadPoolExecutor(min(8, len(peers))) as pool:
        answers = list(pool.map(ask, [d for _, d in peers]))
    return {name: why for (name, _), why in zip(peers, answers) if why is not None}


WATCHDOG = Watchdog()


def _install() -> None:
    """Eager calls of marked functions become waits (`ConcreteFunction._call_flat`: every
    eager call of a `tf.function` goes through it in TF 2.19-2.21)."""
    owner = concrete_function.ConcreteFunction
    if patches.is_patched(owner, "_call_flat"):
        return
    original = owner._call_flat
    if list(inspect.signature(original).parameters) != ["self", "tensor_inputs", "captured_inputs"]:
        raise VersionError(
            f"tfstrat: TensorFlow {tf.__version__}'s ConcreteFunction._call_flat has the "
            f"signature {inspect.signature(original)}, not (self, tensor_inputs, "
            "captured_inputs) as in TF 2.19-2.21: tfstrat's collectives watchdog cannot time "
            "function calls there. Use a tested TensorFlow release (`tfstrat doctor` lists them)."
        )

    def _call_flat(self, tensor_inputs, captured_inputs):
        timeout = getattr(self._func_graph, "_tfstrat_watch", None)
        if timeout is None or not context.executing_eagerly():
            return original(self, tensor_inputs, captured_inputs)
        with WATCHDOG.guard(timeout, "a step"):
            return original(self, tensor_inputs, captured_inputs)

    patches.patch(
        owner,
        "_call_flat",
        _call_flat,
        "a call of a function that runs tfstrat's collectives is watched (`_watchdog`)",
    )
