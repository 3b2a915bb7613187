"""Wake-ups for ParameterServer's synchronous waits, through ps 0's table server.

A synchronous step waits twice (`tfstrat.ps.sync`): the chief until enough workers handed in
their gradients, every worker until the chief applied the step. The state waited on lives in
TensorFlow variables on ps 0; reading it in a loop would spin, hundreds of reads a step that
take the cores the workers and the ps compute on. Instead, whoever changes that state then
signals its key here, and a waiter blocks on ps 0 until the key's count moves past the count
it saw before its last read of the state:

    count(key)            -> the key's count now
    signal(key)           -> the count after adding 1 (the caller's change is in: its write is
                             ordered before this call)
    wait(key, seen, ms)   -> the count, once it differs from `seen`, or after `ms` milliseconds

A waiter reads the count, then the state; while the state is not ready it waits for the count
to move and reads the state again. A change signalled after the count was read is never
missed (the count moved); a wait also ends after `ms`, so the waiter checks its own deadline
and a restarted ps (its counts at 0 again) costs at most that pause.
"""

from __future__ import annotations

import threading

import numpy as np

from tfstrat.errors import UsageError

KEYS = ("mailed", "applied")  # a worker handed in its gradients / the chief applied a step
WAIT_MS = 1000  # the longest a wait blocks before the waiter checks its deadline


class Signals:
    """The counts on the ps (`tfstrat.ps.tables.Registry` serves them)."""

    def __init__(self):
        self.counts = dict.fromkeys(range(len(KEYS)), 0)
        self.changed = threading.Condition()

    def _key(self, key) -> int:
        k = int(key)
        if k not in self.counts:
            raise UsageError(f"no signal {k}; this ps knows {len(KEYS)} ({', '.join(KEYS)})")
        return k

    def count(self, key):
        with self.changed:
            return np.int64(self.counts[self._key(key)])

    def signal(self, key):
        k = self._key(key)
        with self.changed:
            self.counts[k] += 1
            self.changed.notify_all()
            return np.int64(self.counts[k])

    def wait(self, key, seen, ms):
        k, seen = self._key(key), int(seen)
        seconds = min(max(int(ms), 0), WAIT_MS) / 1000
        with self.changed:
            self.changed.wait_for(lambda: self.counts[k] != seen, seconds)
            return np.int64(self.counts[k])


class Client:
    """A worker's side: graph ops that count, signal and wait on ps 0, over its own
    connection (the calls of one step come one at a time; the lock guards the rest)."""

    def __init__(self, address: str, timeout: float, device: str):
        """`address`: ps 0's table server (`tfstrat.ps.tables.rpc_address`)."""
        from tfstrat.ps import wire

        self.connection = wire.Connection(address, timeout, "ps:0")
        self.device = device
        self.lock = threading.Lock()

    def _call(self, method: str, *args) -> np.int64:
        with self.lock:
            self.connection.send(method, *(np.int64(a) for a in args))
            return np.int64(self.connection.receive(method)[0])

    def _op(self, method: str, *args):
        import tensorflow as tf

        with tf.device(self.device):  # runs in this worker's process
            out = tf.numpy_function(
                lambda *a: self._call(method, *a), list(args), tf.int64, stateful=True
            )
        return tf.reshape(out, [])

    def count(self, key: str):
        return self._op("signal_count", KEYS.index(key))

    def signal(self, key: str):
        return self._op("signal", KEYS.index(key))

    def signal_now(self, key: str) -> None:
        """Eager, outside any step (a worker finished its fit)."""
        self._call("signal", KEYS.index(key))

    def wait(self, key: str, seen):
        return self._op("signal_wait", KEYS.index(key), seen, WAIT_MS)

    def close(self) -> None:
        self.connection.close()
