"""`Throughput`: global examples per second, and bytes per step to the ps, in `fit`'s logs.

The callback adds to the logs of every training step and epoch (so to the progress bar, to
`History` and to a TensorBoard callback's scalars):

- `examples_per_s`: the examples of this epoch so far, divided by the seconds since the epoch
  began, as this task sees them. A step of a tfstrat strategy takes one *global* batch (every
  worker its slice of it), so on the chief this is the whole job's rate. The rows per step are
  the global batch Keras's input adapter knows (`fit(x, y, batch_size=...)`, or a `tf.data`
  dataset with a static batch dimension), the last partial batch counted as its rows. Where
  Keras does not know it, give `Throughput(batch_size=...)`; until then the callback logs
  `steps_per_s` instead, and says so once. The first epoch includes tracing the step.
- `ps_bytes_per_step` (ParameterServer, and Hybrid with ps tasks): bytes this task sent to and
  received from the ps tasks per step in this epoch so far, both directions, gRPC framing
  included. No tfstrat strategy counts its own bytes; this reads the kernel's counters of the
  process's TCP sockets whose peer is a ps task's TF_CONFIG port P or its tfstrat port P +
  `TFSTRAT_PORT_OFFSET` (`tfstrat.runtime.traffic.tcp_bytes`, the measurement `tfstrat bench sparse`
  reports). During an epoch it is read at most once a second (one read walks /proc/self/fd).

Automatically: `install()` (called by the tfstrat strategies) makes every `fit` of a model
under a tfstrat strategy start with a `Throughput()` unless its callbacks hold one already.
`TFSTRAT_THROUGHPUT=0` turns that off; a `Throughput` you pass yourself always runs. The
callback goes first in `fit`'s callback list (yours too: creating one installs the hook), so
the callbacks after it, the progress bar, `History` and TensorBoard among them, see its values.
"""

from __future__ import annotations

import logging
import os
import time
import weakref

import keras

from tfstrat._compat import patches
from tfstrat.errors import UsageError

logger = logging.getLogger(__name__)

ENV = "TFSTRAT_THROUGHPUT"
BYTES_EVERY_S = 1.0  # how often a step re-reads the socket counters (an epoch's end always does)

_installed = False
_latest_iterator = None  # weakref to the EpochIterator Keras made last: `fit`'s, at its start


def enabled() -> bool:
    """Whether tfstrat strategies add a `Throughput` to `fit` (`TFSTRAT_THROUGHPUT`, default on)."""
    text = os.environ.get(ENV, "1").strip().lower()
    if text in ("1", "true", "yes", "on", ""):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise UsageError(
        f"Received: {ENV}={os.environ[ENV]!r}. Use 1 to show examples/s in fit's logs, or 0 to "
        "leave tfstrat's Throughput callback out."
    )


class Throughput(keras.callbacks.Callback):
    """Global examples per second (and bytes per step to the ps) in `fit`'s logs.

    Adds `examples_per_s` to the logs of every step and epoch, and under ParameterServer or
    Hybrid with ps tasks `ps_bytes_per_step`: the progress bar shows them, `History` keeps the
    epochs' values, and a TensorBoard callback writes them as scalars (`epoch_examples_per_s`).
    Values are this task's view; a tfstrat step is one global batch, so on the chief
    `examples_per_s` is the whole job's.

    tfstrat strategies add one to every `fit` by themselves; `TFSTRAT_THROUGHPUT=0` stops that.

    Args:
        batch_size: the global batch (rows per step), when Keras's input adapter cannot tell
            (a `tf.data` dataset without a static batch dimension). None: Keras's.
        ps_bytes: measure bytes to the ps tasks when the strategy has some.

    Environment:
        TFSTRAT_THROUGHPUT: 0 leaves the automatic one out (default 1).

    Example:
        >>> import tfstrat
        >>> history = model.fit(  # doctest: +SKIP
        ...     x, y, batch_size=256, callbacks=[tfstrat.keras.callbacks.Throughput()]
        ... )
        >>> history.history["examples_per_s"]  # doctest: +SKIP
        [5120.4, 6210.9]
    """

    def __init__(self, batch_size: int | None = None, ps_bytes: bool = True):
        super().__init__()
        if batch_size is not None and int(batch_size) < 1:
            raise UsageError(
                f"Received: batch_size={batch_size}. Give the global batch (rows per step, >= 1) "
                "or None to take Keras's."
            )
        self.batch_size = None if batch_size is None else int(batch_size)
        self.ps_bytes = ps_bytes
        self._rows = None  # (rows per step, rows of the epoch or None)
        self._ps_ports = None
        self._steps, self._train_end, self._start = 0, None, time.perf_counter()
        self._warned = False
        install()  # moves this callback to the front of fit's list, before TensorBoard

    # -- fit ---------------------------------------------------------------------------------

    def on_train_begin(self, logs=None):
        self._rows = self._rows_per_step()
        self._ps_ports = _ps_ports(self.model) if self.ps_bytes else None
        if self._rows[0] is None and not self._warned:
            self._warned = True
            logger.warning(
                "tfstrat: Throughput shows steps_per_s, not examples_per_s: Keras does not know "
                "the rows per step of this input (a tf.data dataset without a static batch "
                "dimension). Pass Throughput(batch_size=GLOBAL_BATCH) to get examples/s."
            )

    def on_epoch_begin(self, epoch, logs=None):
        self._bytes_start = self._read_bytes()
        self._bytes_last = (None, 0.0)  # (value, when read)
        self._steps, self._train_end = 0, None
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self._steps = batch + 1
        if logs is not None:
            logs.update(self._values(self._steps, time.perf_counter(), final=False))

    def on_test_begin(self, logs=None):
        # Validation inside fit: the epoch's training ended here; its rate leaves this out.
        if self._train_end is None and self._steps:
            self._train_end = (time.perf_counter(), self._read_bytes())

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None and self._steps:
            when, sent = self._train_end or (time.perf_counter(), None)
            logs.update(self._values(self._steps, when, final=True, sent=sent))

    # -- values ------------------------------------------------------------------------------

    def _values(self, steps: int, now: float, final: bool, sent: int | None = None) -> dict:
        seconds = max(now - self._start, 1e-9)
        per_step, epoch_rows = self._rows
        values = {}
        if per_step is None:
            values["steps_per_s"] = steps / seconds
        else:
            rows = steps * per_step if epoch_rows is None else min(steps * per_step, epoch_rows)
            values["examples_per_s"] = rows / seconds
        if self._ps_ports:
            value, when = self._bytes_last
            if final or value is None or now - when >= BYTES_EVERY_S:
                sent = self._read_bytes() if sent is None else sent
                value = (sent - self._bytes_start) / steps
                self._bytes_last = (value, now)
            values["ps_bytes_per_step"] = value
        return values

    def _read_bytes(self) -> int:
        if not self._ps_ports:
            return 0
        from tfstrat.runtime.traffic import tcp_bytes

        return sum(tcp_bytes(self._ps_ports))

    def _rows_per_step(self) -> tuple[int | None, int | None]:
        """(global rows per step, rows of a whole epoch or None) for this `fit`."""
        if self.batch_size is not None:
            return self.batch_size, None
        iterator = _latest_iterator() if _latest_iterator is not None else None
        adapter = getattr(iterator, "data_adapter", None)
        try:
            size = adapter.batch_size if adapter is not None else None
            size = int(size) if size else None
        except (TypeError, ValueError, AttributeError):
            size = None
        if size is None:
            return None, None
        epoch_rows = None
        try:  # Keras takes every batch of array input: the last one may be partial
            batches, partial = adapter.num_batches, adapter.partial_batch_size
            steps = getattr(iterator, "steps_per_epoch", None)
            if batches and partial and (steps is None or steps >= batches):
                epoch_rows = (batches - 1) * size + int(partial)
        except (TypeError, ValueError, AttributeError):
            pass
        return size, epoch_rows


def _ps_ports(model) -> set[int] | None:
    """The ports of the ps tasks this task talks to: TF_CONFIG port P and P + offset."""
    strategy = getattr(model, "distribute_strategy", None)
    addresses = getattr(strategy, "ps_addresses", None)  # Hybrid
    if addresses is None:  # ParameterServer
        tf_config = getattr(getattr(strategy, "extended", None), "tf_config", None)
        addresses = tf_config.addresses("ps") if hasattr(tf_config, "addresses") else ()
    if not addresses:
        return None
    from tfstrat.cluster import ports as _ports

    ports = set()
    for address in addresses:
        port = _ports.split(address)[1]
        ports.update((port, port + _ports.offset()))
    return ports


# -- the automatic one ------------------------------------------------------------------------


def _watch_epoch_iterators() -> None:
    """Keeps a weak reference to the EpochIterator Keras makes last (once per process).

    Keras 3.15's `fit` makes its training EpochIterator (which holds the input adapter and so
    the batch size) just before its CallbackList, and no other before `on_train_begin`; the
    callbacks are never given the batch size.
    """
    global _latest_iterator
    from tfstrat._compat.keras import EpochIterator

    if getattr(EpochIterator.__init__, "_tfstrat_throughput", False):
        return
    keras_init = EpochIterator.__init__

    def __init__(self, *args, **kwargs):
        global _latest_iterator
        keras_init(self, *args, **kwargs)
        _latest_iterator = weakref.ref(self)

    __init__._tfstrat_throughput = True
    patches.patch(EpochIterator, "__init__", __init__, "the Throughput callback's batch size")


def _is_tfstrat(strategy) -> bool:
    return strategy is not None and type(strategy).__module__.startswith("tfstrat.")


def _with_throughput(callbacks, model):
    """`fit`'s callbacks with a Throughput first: the one given, else a new one when the model
    trains under a tfstrat strategy and `TFSTRAT_THROUGHPUT` allows it."""
    from tfstrat._compat.keras import tree

    given = tree.flatten(callbacks) if callbacks else []
    ours = [c for c in given if isinstance(c, Throughput)]
    if not ours:
        strategy = getattr(model, "_distribute_strategy", None)
        if not (_is_tfstrat(strategy) and enabled()):
            return callbacks
        ours = [Throughput()]
    # First, so that the progress bar, History and TensorBoard (wherever they are) see it.
    return ours + [c for c in given if not isinstance(c, Throughput)]


def install() -> None:
    """Makes `fit` under a tfstrat strategy start with a `Throughput` (once per process).

    Wraps Keras 3.15's `CallbackList.__init__`; only the lists `fit` makes (with `History`)
    change. `TFSTRAT_THROUGHPUT=0`, read at every `fit`, leaves the automatic one out.
    """
    global _installed
    from tfstrat._compat.keras import CallbackList

    if _installed and patches.is_patched(CallbackList, "__init__"):
        return  # (after `patches.remove_all()` it installs again)

    keras_init = CallbackList.__init__

    def __init__(self, callbacks=None, add_history=False, add_progbar=False, model=None, **params):
        if add_history and model is not None:  # fit's list; evaluate's and predict's have none
            from tfstrat.keras import _fit_scope

            _fit_scope.warn_fit_outside_scope(model)  # not this module's matter: fit's one hook
            callbacks = _with_throughput(callbacks, model)
        keras_init(self, callbacks, add_history, add_progbar, model, **params)

    patches.patch(
        CallbackList,
        "__init__",
        __init__,
        "fit under a tfstrat strategy starts with a Throughput; warns of a model outside scope",
    )
    _watch_epoch_iterators()
    _installed = True
