"""Stopping together: every worker of a multi-worker strategy stops after the same step.

A callback that sets `model.stop_training` from local logs (`TerminateOnNaN`, a batch-level
`EarlyStopping`) would stop one worker while the others wait for it in the next collective;
SIGTERM (a scheduler's `scancel`, `docker stop`, a pod deleted, `tfstrat launch` stopping a
run) would hit some workers before others. So a stop is a *request*, carried in the next step's
gradient all-reduce as two more numbers (no extra collective): once any worker asked, every
worker stops after that step. Requests made at an epoch's end are agreed with one small
all-reduce at the end of every epoch.

How it reaches into Keras 3.15 `fit` (trainer.py): `model.train_function` is wrapped when the
strategy first traces `model.train_step`, and each fit's `History` callback (always the last
user-visible callback Keras adds, so it runs after every user callback) is wrapped: its
`on_train_batch_end` turns a local `stop_training = True` back into a request before Keras's
loop checks it, its `on_epoch_end` agrees on epoch-end requests, and its `on_train_end` exits
the process with 143 after a SIGTERM, once every other callback has run (so tfstrat's
`BackupAndRestore` saves first). While a stop is agreed, `model._tfstrat_stop` says why:
"sigterm" or "requested".

SIGTERM: the first one is a request (handled at the next step boundary); a second one ends the
process at once (exit 143). Outside `fit`, SIGTERM ends the process at once. TensorFlow's own
C++ SIGTERM handler (installed with its coordination service) is replaced: it only logs.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading

import numpy as np
import tensorflow as tf

logger = logging.getLogger(__name__)

EXIT_SIGTERM = 128 + signal.SIGTERM
_REQUESTED, _SIGTERM = 0, 1


class StopAgreement:
    """One per multi-worker strategy.

    Args:
        epoch_all_reduce: `f(np.ndarray) -> np.ndarray`, an eager sum over every worker (run
            at every epoch's end, by every worker, in the same place of its program).
        name: this task, for log lines ("worker:1").
    """

    def __init__(self, epoch_all_reduce, name: str):
        self._epoch_all_reduce = epoch_all_reduce
        self.name = name
        with tf.init_scope():  # plain local variables, never mirrored
            self._local = tf.Variable(tf.zeros([2]), trainable=False, name="tfstrat_stop_ask")
            self._agreed = tf.Variable(tf.zeros([2]), trainable=False, name="tfstrat_stop")
        self._asked = np.zeros(2, np.float32)  # what _local holds
        self.sigterms = 0
        self.in_fit = False
        self._history = None
        #: Called once before the next step (the model agreement without tfstrat's ring).
        self.before_next_step = None
        _SigtermWatch.install(self)

    # -- in the step ----------------------------------------------------------------------

    def flags(self, dtype) -> tf.Tensor:
        """This worker's requests, to append to the step's all-reduce."""
        return tf.cast(self._local.read_value(), dtype)

    def agree(self, summed: tf.Tensor):
        """Records the all-reduced requests (any worker's request stops everyone)."""
        self._agreed.assign(tf.cast(summed, tf.float32))

    # -- around the step --------------------------------------------------------------------

    def attach(self, model):
        """Wraps `model.train_function` (once per traced function)."""
        inner = model.train_function
        if inner is None or getattr(inner, "_tfstrat_stop", None) is self:
            return

        def train_function(iterator):
            self._before_step(model)
            logs = inner(iterator)
            self._after_step(model)
            return logs

        train_function._tfstrat_stop = self
        model.train_function = train_function

    def _ask(self, which: int):
        if not self._asked[which]:
            self._asked[which] = 1.0
            self._local.assign(self._asked)

    def _before_step(self, model):
        if model.history is not self._history:  # a new fit: a new History callback
            self._new_fit(model)
        if self.before_next_step is not None:
            call, self.before_next_step = self.before_next_step, None
            call()
        if self.sigterms:
            self._ask(_SIGTERM)

    def _after_step(self, model):
        agreed = self._agreed.numpy()
        if agreed.any():
            self._stop(model, agreed)

    def _stop(self, model, agreed):
        reason = "sigterm" if agreed[_SIGTERM] else "requested"
        if getattr(model, "_tfstrat_stop", None) is None:
            logger.info(
                "tfstrat: %s: every worker stops after this step (%s)",
                self.name,
                "SIGTERM" if reason == "sigterm" else "a callback set stop_training",
            )
        model._tfstrat_stop = reason
        model.stop_training = True

    def _new_fit(self, model):
        self._history = history = model.history
        self._asked[:] = 0
        self._local.assign(self._asked)
        self._agreed.assign(self._asked)
        model._tfstrat_stop = None
        self.in_fit = True
        on_batch_end, on_epoch_end = history.on_train_batch_end, history.on_epoch_end
        on_train_end = history.on_train_end

        def batch_end(batch, logs=None):
            on_batch_end(batch, logs)
            if model.stop_training and model._tfstrat_stop is None:
                model.stop_training = False  # a local request: carried by the next step
                self._ask(_REQUESTED)

        def epoch_end(epoch, logs=None):
            on_epoch_end(epoch, logs)
            if model.stop_training and model._tfstrat_stop is None:
                self._asked[_REQUESTED] = 1.0
            if self.sigterms:
                self._asked[_SIGTERM] = 1.0
            agreed = self._epoch_all_reduce(self._asked.copy())
            model.stop_training = False
            if np.asarray(agreed).any():
                self._stop(model, np.asarray(agreed))
            elif model._tfstrat_stop is not None:  # agreed in a step; a local epoch agreement
                model.stop_training = True  # (ParameterServer's) knows only its own requests

        def train_end(logs=None):
            on_train_end(logs)
            self.in_fit = False
            if model._tfstrat_stop == "sigterm":
                logger.info("tfstrat: %s: stopped on SIGTERM; exiting with %d", self.name, 143)
                sys.stdout.flush()
                raise SystemExit(EXIT_SIGTERM)

        history.on_train_batch_end, history.on_epoch_end = batch_end, epoch_end
        history.on_train_end = train_end


class _SigtermWatch:
    """SIGTERM, seen at once by a thread (Python's C-level handler writes each signal to a
    wakeup fd even while the main thread is inside TensorFlow), acted on at step boundaries."""

    _agreements: list[StopAgreement] = []
    _installed = False

    @classmethod
    def install(cls, agreement: StopAgreement):
        cls._agreements.append(agreement)
        if cls._installed or threading.current_thread() is not threading.main_thread():
            return
        cls._installed = True
        read, write = socket.socketpair()
        write.setblocking(False)
        signal.signal(signal.SIGTERM, cls._handler)
        signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
        cls._keep = (read, write)
        threading.Thread(
            target=cls._watch, args=(read,), name="tfstrat-sigterm", daemon=True
        ).start()

    @staticmethod
    def _handler(signum, frame):
        """Main thread, between bytecodes (so before the next step when the signal came
        between steps); outside `fit` nothing else would stop us. It never counts: the
        thread sees every signal exactly once."""
        for a in _SigtermWatch._agreements:
            a.sigterms = max(a.sigterms, 1)
        if not any(a.in_fit for a in _SigtermWatch._agreements):
            raise SystemExit(EXIT_SIGTERM)

    @classmethod
    def _watch(cls, read: socket.socket):
        received = 0
        while True:
            data = read.recv(64)
            if not data:
                return
            for signum in data:
                if signum != signal.SIGTERM:
                    continue
                received += 1
                for a in cls._agreements:
                    a.sigterms = max(a.sigterms, 1)
                if received == 1:
                    print(
                        "tfstrat: SIGTERM: stopping every worker after the current step "
                        "(a second SIGTERM exits at once)",
                        file=sys.stderr,
                        flush=True,
                    )
                else:
                    print("tfstrat: second SIGTERM: exiting now", file=sys.stderr, flush=True)
                    os._exit(EXIT_SIGTERM)
