"""ParameterServer's waits (tfstrat/ps/sync.py's poll_until) block on ps 0's table server until
the state they wait on was signalled (tfstrat/ps/signals.py), instead of reading it in a loop:
a real table server on loopback, real TensorFlow graphs, one process."""

import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from tfstrat.cluster.ports import free_port
from tfstrat.errors import UsageError
from tfstrat.ps import signals, tables
from tfstrat.ps.sync import poll_until


def test_a_wait_ends_when_the_count_moves_or_after_its_pause():
    s = signals.Signals()
    assert s.count(0) == 0 and s.signal(0) == 1 and s.count(1) == 0
    assert s.wait(0, 0, 1000) == 1  # moved since 0: at once
    started = time.monotonic()
    assert s.wait(1, 0, 50) == 0  # nothing signalled: the pause, then the same count
    assert 0.04 < time.monotonic() - started < 0.5
    later = threading.Timer(0.1, s.signal, args=(1,))
    later.start()
    started = time.monotonic()
    assert s.wait(1, 0, 1000) == 1
    assert time.monotonic() - started < 0.9  # woken by the signal, not the pause
    assert s.wait(1, 5, 10) == 1  # a restarted ps (counts back at 0): any difference ends it
    with pytest.raises(UsageError, match=r"no signal 7; this ps knows 2 \(mailed, applied\)"):
        s.signal(7)


@pytest.mark.timeout(120)
def test_a_wait_in_a_step_reads_the_state_once_per_signal_not_in_a_spin():
    port = free_port()
    server, _ = tables.serve_tables("127.0.0.1", port, "ps:0")
    try:
        client = signals.Client(f"127.0.0.1:{port}", 30, "/CPU:0")
        state = tf.Variable(0, dtype=tf.int64)
        reads = tf.Variable(0, dtype=tf.int64)

        def ready():
            with tf.control_dependencies([reads.assign_add(1)]):
                return state.read_value() >= 3

        waited = tf.function(
            lambda: poll_until(ready, 30.0, ["never ready"], wake=(client, "applied"))
        )

        def writer():  # another task: changes the state, then signals it; one change a tick
            for _ in range(3):
                time.sleep(0.15)
                state.assign_add(1)
                client.signal_now("applied")

        thread = threading.Thread(target=writer)
        thread.start()
        tries = int(waited())
        thread.join()
        # One read before the loop and one per wake-up: at most one per signal (a signal may
        # land before the read it would wake, so fewer), never the thousands of a spin.
        assert 1 <= tries <= 3 and int(reads.numpy()) == tries + 1, (tries, reads.numpy())

        # The deadline still holds while nothing is signalled: a wait pauses at most 1 s, so
        # the error comes within a second or two of it.
        state.assign(0)
        started = time.monotonic()
        never = tf.function(
            lambda: poll_until(ready, 1.5, ["waited for", state], wake=(client, "mailed"))
        )
        with pytest.raises(tf.errors.InvalidArgumentError, match="waited for"):
            never()
        assert 1.5 <= time.monotonic() - started < 10
        np.testing.assert_equal(int(state.numpy()), 0)
    finally:
        server.close()
