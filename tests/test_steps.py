"""The shared state of ParameterServer's synchronous steps on ps 0 (tfstrat/ps/steps.py): its
rules in one process, and its waits over a real table server on loopback."""

import threading
import time

import numpy as np
import pytest

from tfstrat.cluster.ports import free_port
from tfstrat.errors import UsageError
from tfstrat.ps import steps, tables

NO_STOP = [0.0, 0.0]  # a mail's stop requests: none


def test_a_step_takes_the_required_fresh_mails_and_names_the_left_out_and_the_stale():
    s = steps.Steps()
    assert s.open(0, 3, 2) == 0 and s.open(0, 3, 2) == 0  # once; the same again is fine
    with pytest.raises(UsageError, match="with 3 worker.*asked for 4"):
        s.open(0, 4, 2)
    assert s.mail(0, 0, 0, 8.0, NO_STOP) == 1
    ready, *_ = s.wait_mailed(0, 0, 10)
    assert ready == 0  # 1 of 2: not yet
    assert s.mail(0, 1, 0, 6.0, NO_STOP) == 1
    ready, count, *stop_and_mask = s.wait_mailed(0, 0, 10)
    assert (ready, count, stop_and_mask) == (1, 14.0, [0, 0, 1, 1, 0])
    assert s.mail(0, 2, 0, 8.0, NO_STOP) == 1  # in time for its mail, too late for the chief
    assert s.publish(0, 0) == 1
    assert list(s.wait_applied(0, 1, 0, 10)) == [1, 0, 0, 0]
    assert list(s.wait_applied(0, 2, 0, 10)) == [1, 1, 0, 0]  # mailed, not taken: left out
    assert s.mail(0, 2, 0, 8.0, NO_STOP) == 0  # the global step moved on: stale
    assert list(s.wait_applied(0, 1, 1, 10)) == [0, 0, 0, 0]  # step 1 not applied yet
    # Once the chief finished its fit, a worker still in it stops waiting.
    s.fit_done(0, 0)
    assert list(s.wait_applied(0, 1, 1, 10)) == [1, 0, 0, 0]
    with pytest.raises(UsageError, match="no synchronous training group 5.*restarted"):
        s.mail(5, 0, 0, 1.0, NO_STOP)
    with pytest.raises(UsageError, match="worker 3 is not one of the group's 3"):
        s.mail(0, 3, 1, 1.0, NO_STOP)


def test_a_finished_worker_is_not_waited_for():
    s = steps.Steps()
    s.open(1, 2, 2)
    s.fit_done(1, 1)  # worker 1 ran out of its fit's steps first
    s.mail(1, 0, 0, 4.0, NO_STOP)
    ready, count, *stop_and_mask = s.wait_mailed(1, 0, 10)
    assert (ready, count, stop_and_mask) == (1, 4.0, [0, 0, 1, 0])


@pytest.mark.timeout(60)
def test_a_wait_blocks_on_the_ps_until_what_it_waits_for_happens():
    port = free_port()
    server, _ = tables.serve_tables("127.0.0.1", port, "ps:0")
    try:
        chief = steps.Client(f"127.0.0.1:{port}", 5, "/CPU:0", group=0, worker=0)
        worker = steps.Client(f"127.0.0.1:{port}", 5, "/CPU:0", group=0, worker=1)
        chief.call("open", 2, 2)
        later = threading.Timer(0.3, lambda: chief.call("publish", 0))
        later.start()
        started = time.monotonic()
        ready, left_out, *stop = worker.call("wait_applied", 1, 0, steps.WAIT_MS)
        took = time.monotonic() - started
        # Ready: woken by the publish (a wait that ran out answers 0), after blocking for it.
        assert (ready, left_out) == (1, 0) and took > 0.2, (ready, took)
        # A wait that never ends fails after the client's timeout, saying why.
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="step 1 was never applied"):
            worker._until(
                lambda ms: worker.call("wait_applied", 1, 1, ms),
                lambda s, _: f"step {s} was never applied",
                1,
            )
        assert 5 <= time.monotonic() - started < 15
        np.testing.assert_equal(chief.call("open", 2, 2), 1)
    finally:
        server.close()


def test_a_stop_request_in_a_mail_the_chief_took_reaches_every_worker_for_that_step():
    """SIGTERM or a callback's stop_training on one worker: its next mail carries it, and
    the step the chief applies with that mail says stop to everyone, the late ones too."""
    s = steps.Steps()
    s.open(0, 3, 2)
    s.mail(0, 0, 0, 1.0, NO_STOP)
    s.mail(0, 1, 0, 1.0, [0.0, 1.0])  # worker 1 got SIGTERM
    ready, _, *stop_and_mask = s.wait_mailed(0, 0, 10)
    assert ready == 1 and stop_and_mask[:2] == [0, 1]
    s.mail(0, 2, 0, 1.0, [1.0, 0.0])  # too late for the chief: its request waits a step
    s.publish(0, 0)
    for w in range(3):
        assert list(s.wait_applied(0, w, 0, 10))[2:] == [0, 1]


def _in_thread(fn, *args):
    """Runs `fn(*args)` in a thread; returns a function that joins it and gives its result."""
    out = {}
    thread = threading.Thread(target=lambda: out.update(result=fn(*args)), daemon=True)
    thread.start()

    def result():
        thread.join(10)
        assert not thread.is_alive(), "the call did not return"
        return out["result"]

    return result


def _begun(s, run) -> None:
    """Waits (on the state's own condition) until the chief's `run` began on `s`."""
    with s.changed:
        began = s.changed.wait_for(lambda: 0 in s.runs and s.runs[0].run == run.tobytes(), 10)
    assert began, "the chief's begin_run never started"


RUN_A, RUN_B = np.full(16, 1, np.uint8), np.full(16, 2, np.uint8)
NONCE_1, NONCE_2 = np.full(16, 7, np.uint8), np.full(16, 8, np.uint8)


def test_a_new_run_drops_the_earlier_runs_step_state_and_exchanges():
    """A ps that outlived its workers: the relaunched chief's new run id drops the group's
    step state (a stale mail must not count as a new worker's) and half-done exchanges; the
    workers that join the new run get its id."""
    s = steps.Steps()
    chief = _in_thread(s.begin_run, 0, RUN_A, 2, 2000)
    _begun(s, RUN_A)
    assert list(s.join_run(0, 1, NONCE_1, 2, 2000)) == [1, *RUN_A]
    assert list(chief()) == [1, 1]
    s.open(0, 2, 2)
    s.mail(0, 1, 0, 8.0, NO_STOP)  # worker 1 mailed step 0, then the job failed
    assert s.exchange(0, 1, 2, 0, [5.0], 0)[0] == 0  # and waited in an exchange
    chief = _in_thread(s.begin_run, 0, RUN_B, 2, 2000)
    _begun(s, RUN_B)
    assert list(s.join_run(0, 1, NONCE_2, 2, 2000)) == [1, *RUN_B]
    assert list(chief()) == [1, 1]
    with pytest.raises(UsageError, match="no synchronous training group 0"):
        s.mail(0, 1, 0, 8.0, NO_STOP)  # the earlier run's group is gone
    s.open(0, 2, 2)
    ready, *_ = s.wait_mailed(0, 0, 10)
    assert ready == 0  # worker 1's old mail does not count in the new run
    assert s.exchanges == {}  # nor does its old exchange


def test_a_worker_given_another_cluster_is_named_then_joins_once_corrected():
    """A worker whose count of workers differs is refused at once (both sides name the other's
    count); relaunched with the right count, it joins the chief's next run."""
    s = steps.Steps()
    started = time.monotonic()
    chief = _in_thread(s.begin_run, 0, RUN_A, 2, 5000)
    _begun(s, RUN_A)
    assert list(s.join_run(0, 1, NONCE_1, 3, 5000))[:2] == [-1, 2]  # learns the chief's 2
    answer = list(chief())
    assert answer[:3] == [-1, 1, 3], answer  # the chief: worker 1 says 3 workers
    assert time.monotonic() - started < 2.5, "named at once, not after the waits"
    chief = _in_thread(s.begin_run, 0, RUN_B, 2, 2000)
    _begun(s, RUN_B)
    assert list(s.join_run(0, 1, NONCE_2, 2, 2000)) == [1, *RUN_B]
    assert list(chief()) == [1, 1]


def test_an_exchange_gives_every_worker_all_values_once_all_handed_in():
    """`strategy.reduce`/`gather` across ParameterServer workers: each worker's values in
    worker order, once every worker handed in that call's; forgotten once all read it."""
    s = steps.Steps()
    first = _in_thread(s.exchange, 0, 0, 2, 0, [1.0, 2.0], 2000)
    second = s.exchange(0, 1, 2, 0, [3.0], 2000)
    assert list(second) == [1, 2, 1, 1.0, 2.0, 3.0]
    assert list(first()) == [1, 2, 1, 1.0, 2.0, 3.0]
    assert s.exchanges == {}
    assert list(s.exchange(0, 0, 2, 1, [4.0], 0)) == [0, 1, 0]  # worker 1 has not come
    with pytest.raises(UsageError, match="worker 2 is not one of the group's 2"):
        s.exchange(0, 2, 2, 1, [4.0], 0)
