"""The collectives' watchdog (`tfstrat.strategies._watchdog`): one thread per process bounds
TensorFlow's collectives instead of a thread per op. Its messages as pure functions, and a
real process (two logical CPUs) where a call longer than the timeout that keeps beginning
steps goes on and a collective a device never joins is aborted after the timeout."""

import json

import pytest
from cluster import run_script

from tfstrat.strategies import _watchdog

TIMEOUT = 4


def test_the_message_names_silent_peers_else_the_ones_that_did_not_join():
    dog = _watchdog.Watchdog()
    dog.me = "worker:0"
    dog.peers = [
        ("worker:1", "/job:worker/replica:0/task:1"),
        ("worker:2", "/job:worker/replica:0/task:2"),
    ]
    wait = _watchdog._Wait(15, "a step")
    silent = dog.diagnosis(wait, 15.2, {"worker:2": "DeadlineExceededError: ..."})
    assert silent.startswith("tfstrat: worker:0: a step waited 15 s (timeout=15) in TensorFlow")
    assert (
        "do not answer (dead, stopped or cut off): worker:2 (/job:worker/replica:0/task:2)"
        in silent
    )
    assert "worker:1" not in silent
    late = dog.diagnosis(wait, 15.2, {})
    assert "every peer answers, and worker:1 (/job:worker/replica:0/task:1), worker:2" in late
    assert "raise `timeout=`" in late
    dog.peers = []
    assert "among this process's own devices" in dog.diagnosis(wait, 15.2, {})


@pytest.mark.timeout(180)
def test_a_long_call_that_begins_steps_goes_on_and_a_collective_never_joined_is_aborted():
    out = run_script("watchdog_probe.py", str(TIMEOUT))
    report = json.loads(next(x for x in out.splitlines() if x.startswith("WATCHDOG "))[9:])
    long, hang = report["long"], report["hang"]
    # 8 steps of about TIMEOUT / 2 s each (two replicas sleep TIMEOUT / 4 s in turn): the call
    # lasts longer than the timeout, and each of its steps all-reduced both replicas' 1.0.
    assert long.get("value") == 16.0 and long["seconds"] > TIMEOUT, long
    assert hang["error"] and "tfstrat: this process: a step waited" in hang["error"], hang
    assert "among this process's own devices" in hang["error"], hang
    # The timeout, at most a poll (TIMEOUT / 4 here), and a busy machine's slack.
    assert TIMEOUT <= hang["seconds"] < TIMEOUT + TIMEOUT / 4 + 10, hang
    assert report["threads"][1] - report["threads"][0] < 10, report["threads"]
