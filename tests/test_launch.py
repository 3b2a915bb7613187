"""Cluster tests of the launcher: real task processes on 127.0.0.1."""

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tfstrat import LaunchConfig, TFConfig, launch
from tfstrat.launcher import api

pytestmark = pytest.mark.cluster
PY = sys.executable


def _run(config):
    out = io.StringIO()
    start = time.monotonic()
    code = launch(config, out)
    return code, out.getvalue(), time.monotonic() - start


def test_workers_get_distinct_tasks():
    script = "import os; print('TFC', os.environ['TF_CONFIG'])"
    code, out, _ = _run(LaunchConfig([PY, "-c", script], workers=2, timeout=60))
    assert code == 0, out
    configs = {}
    for line in out.splitlines():
        prefix, _, rest = line.partition(" ")
        if rest.startswith("TFC "):
            configs[prefix] = json.loads(rest[4:])
    assert set(configs) == {"[worker:0]", "[worker:1]"}, out
    assert configs["[worker:0]"]["task"] == {"type": "worker", "index": 0}
    assert configs["[worker:1]"]["task"] == {"type": "worker", "index": 1}
    assert configs["[worker:0]"]["cluster"] == configs["[worker:1]"]["cluster"]
    assert len(configs["[worker:0]"]["cluster"]["worker"]) == 2


@pytest.mark.parametrize(
    "threads, chief, expected",
    [
        (None, False, 6),  # 12 cores over 2 workers
        (None, True, 4),  # 12 cores over 2 workers and a chief
        (3, False, 3),
        (0, False, None),
    ],
)
def test_threads_per_task_sizes_both_tensorflow_pools(threads, chief, expected, monkeypatch):
    # A 12-core machine as the launcher sees it, so that each case expects its own count
    # (on 2 cores every default would be 1).
    monkeypatch.setattr(os, "cpu_count", lambda: 12)
    for name in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
        monkeypatch.delenv(name, raising=False)
    script = (
        "import os; print('THREADS', os.environ.get('TF_NUM_INTRAOP_THREADS'), "
        "os.environ.get('TF_NUM_INTEROP_THREADS'))"
    )
    config = LaunchConfig([PY, "-c", script], workers=2, chief=chief, threads_per_task=threads)
    code, out, _ = _run(config)
    assert code == 0, out
    lines = [line.split(" ", 1)[1] for line in out.splitlines() if " THREADS " in line]
    assert lines == [f"THREADS {expected} {expected}"] * (3 if chief else 2), out


def test_negative_threads_per_task_is_a_clear_error():
    with pytest.raises(ValueError, match="threads_per_task=-1"):
        LaunchConfig([PY, "-c", "pass"], threads_per_task=-1)


def test_first_failure_stops_everyone_promptly():
    script = (
        "import os, sys, time\n"
        "if os.environ['TFSTRAT_TASK'] == 'worker:1':\n"
        "    print('worker one fails now'); sys.exit(3)\n"
        "time.sleep(120)\n"
    )
    code, out, elapsed = _run(LaunchConfig([PY, "-c", script], workers=2, timeout=100, grace=2))
    assert code == 3, out
    assert elapsed < 60, out  # far below the 100 s timeout and the 120 s sleep
    assert "worker:1 failed first (exit code 3)" in out
    assert "worker one fails now" in out.rsplit("failed first", 1)[1]  # in the final box


def test_timeout_stops_everything_with_124():
    script = "import time; print('started', flush=True); time.sleep(120)"
    code, out, elapsed = _run(LaunchConfig([PY, "-c", script], workers=2, timeout=3, grace=1))
    assert code == 124, out
    assert "timed out after 3 s" in out
    assert elapsed < 60  # far below the 120 s sleep


def _bindable(address):
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        try:
            s.bind((host, int(port)))
            return True
        except OSError:
            return False


# The worker waits until its ps task's gRPC server accepts connections, then exits 0.
WAIT_FOR_PS = """
import json, os, socket, time
addr = json.loads(os.environ["TF_CONFIG"])["cluster"]["ps"][0]
host, port = addr.rsplit(":", 1)
deadline = time.time() + 60
while True:
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        break
    except OSError:
        assert time.time() < deadline, "ps never came up"
        time.sleep(0.2)
print("PS", addr)
"""


def test_ps_tasks_are_started_and_stopped():
    code, out, _ = _run(LaunchConfig([PY, "-c", WAIT_FOR_PS], workers=1, ps=1, timeout=120))
    assert code == 0, out
    addr = next(line.split()[-1] for line in out.splitlines() if " PS " in line)
    assert "[ps:0]" in out and "serving at" in out, out
    assert _bindable(addr), f"ps:0 still holds {addr} after launch returned"


def test_port_taken_before_binding_is_retried(monkeypatch):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    taken = f"127.0.0.1:{held.getsockname()[1]}"
    calls = []

    def make_cluster(config):
        fresh = TFConfig.local(workers=config.workers, ps=config.ps)
        calls.append(fresh)
        if len(calls) == 1:  # first attempt: the ps port is already taken by someone else
            return TFConfig.from_hosts(worker=list(fresh.addresses("worker")), ps=[taken])
        return fresh

    # The launcher's free ports, except that the first attempt's ps port is one held here.
    monkeypatch.setattr(api, "_local_cluster", make_cluster)
    try:
        code, out, _ = _run(LaunchConfig([PY, "-c", WAIT_FOR_PS], workers=1, ps=1, timeout=120))
    finally:
        held.close()
    assert code == 0, out
    assert len(calls) == 2, out
    assert "retrying with fresh ports" in out


def _cli_launch(script):
    """`tfstrat launch` of two workers running `python -c script`, as a user types it."""
    return [
        PY,
        "-m",
        "tfstrat",
        "launch",
        "--workers",
        "2",
        "--timeout",
        "100",
        "--show",
        "all",  # both tasks' lines are read
        "--",
        PY,
        "-c",
        script,
    ]


def test_cli_names_the_failed_task_and_returns_its_code():
    script = "import os, sys, time; sys.exit(3) if os.environ['TFSTRAT_TASK'].endswith(':1') else time.sleep(120)"
    start = time.monotonic()
    proc = subprocess.run(
        _cli_launch(script),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert time.monotonic() - start < 60  # far below the 120 s sleep
    assert "worker:1 failed first" in proc.stdout


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie is as good as dead
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:  # no such file, or ESRCH when the process goes between open() and read()
        return False


def test_tasks_die_with_a_killed_launcher():
    script = "import os, time; print('PID', os.getpid(), flush=True); time.sleep(120)"
    launcher = subprocess.Popen(
        _cli_launch(script),
        stdout=subprocess.PIPE,
        text=True,
    )
    pids = []
    try:
        for line in launcher.stdout:
            if " PID " in line:
                pids.append(int(line.split()[-1]))
            if len(pids) == 2:
                break
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), f"orphans left: {pids}"
    finally:
        launcher.kill()
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
