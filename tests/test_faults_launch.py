"""Faults of `tfstrat launch` itself: restarts, exit codes, blame, and processes left behind.

Real processes throughout: the launcher as a user runs it (`python -m tfstrat launch`) or its
function, worker scripts from tests/workers (faults_launch_*.py), TensorFlow clusters where
the fault needs one.
"""

import contextlib
import io
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from paths import WORKERS

from tfstrat import LaunchConfig, launch

pytestmark = pytest.mark.faults
PY = sys.executable
START_SLACK = 120  # imports and first traces of TensorFlow tasks on a loaded 2-core machine


class _Timed(io.TextIOBase):
    """A launcher `out` that remembers when each line arrived."""

    def __init__(self):
        self.start = time.monotonic()
        self.lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()

    def write(self, text):
        with self._lock:
            now = time.monotonic()
            self.lines += [(now, line) for line in text.splitlines()]
        return len(text)

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def when(self, part: str) -> float:
        return next(t for t, line in self.lines if part in line)


class _Marking(_Timed):
    """A `_Timed` that creates `path` once a line containing `part` arrives."""

    def __init__(self, part: str, path):
        super().__init__()
        self.part, self.path = part, path

    def write(self, text):
        if self.part in text:
            with open(self.path, "w"):
                pass
        return super().write(text)


def _launch(*args, out=None, **config) -> tuple[int, str, _Timed, float]:
    """`launch` of `python SCRIPT ARGS...` from tests/workers; (code, output, lines, end time)."""
    out = out or _Timed()
    cwd = os.getcwd()
    os.chdir(WORKERS)  # the TensorFlow scripts import common.py from there
    try:
        code = launch(LaunchConfig([PY, *args], **config), out)
    finally:
        os.chdir(cwd)
    return code, out.text(), out, time.monotonic()


def _cli(*args, env=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "tfstrat", "launch", *args],
        cwd=WORKERS,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _restart_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("tfstrat launch: restart ")]


# Item 10: --restarts.


@pytest.mark.timeout(120)
def test_failed_run_restarts_every_task_on_fresh_ports(tmp_path):
    code, out, _, _ = _launch(
        "faults_launch_restart.py", str(tmp_path), "once", workers=2, restarts=2, timeout=100
    )
    assert code == 0, out
    restarts = _restart_lines(out)
    assert restarts == [
        "tfstrat launch: restart 1/2, every task on fresh ports (TFSTRAT_RESTART=1), after "
        "worker:1 failed (exit code 1): RuntimeError: planned failure on attempt 0"
    ], out
    runs = [line.split(" ", 2) for line in (tmp_path / "attempts.txt").read_text().splitlines()]
    assert sorted((a, t) for a, t, _ in runs) == [
        ("0", "worker:0"),
        ("0", "worker:1"),
        ("1", "worker:0"),
        ("1", "worker:1"),
    ], runs
    clusters = {a: c.split('"task"')[0] for a, _, c in runs}
    assert clusters["0"] != clusters["1"], "the restart reused the first attempt's ports"


@pytest.mark.timeout(120)
def test_restarts_exhausted_return_the_task_code_from_the_cli_and_its_env_fallback(tmp_path):
    proc = _cli(
        "--workers=2",
        "--timeout=100",
        "--",
        PY,
        "faults_launch_restart.py",
        str(tmp_path),
        "always",
        env={"TFSTRAT_RESTARTS": "1"},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert len(_restart_lines(out)) == 1, out
    assert "not restarting: no restarts left (1 of --restarts 1 used)" in out
    attempts = (tmp_path / "attempts.txt").read_text().splitlines()
    assert sorted(line.split()[0] for line in attempts) == ["0", "0", "1", "1"]


@pytest.mark.timeout(120)
def test_usage_errors_and_timeouts_are_not_restarted(tmp_path):
    code, out, _, _ = _launch(
        "faults_launch_restart.py", str(tmp_path), "usage", workers=2, restarts=3, timeout=100
    )
    assert code == 2, out
    assert not _restart_lines(out), out
    assert "not restarting: exit code 2 means the command or its arguments are wrong" in out
    # Worker 0 sleeps 60 s in mode "always": the timeout ends the run, and nothing restarts.
    code, out, _, _ = _launch(
        "faults_launch_restart.py", str(tmp_path), "always", workers=1, restarts=3, timeout=3
    )
    assert code == 124, out
    assert not _restart_lines(out), out


# Item 11: exit codes.


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig, code", [(signal.SIGKILL, 137), (signal.SIGTERM, 143)])
def test_task_killed_by_a_signal_exits_128_plus_the_signal(sig, code):
    script = f"import os; print('dying', flush=True); os.kill(os.getpid(), {int(sig)})"
    proc = _cli("--workers=2", "--timeout=100", "--", PY, "-c", script)
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert f"failed first (exit code {code}, killed by {sig.name})" in proc.stdout


@pytest.mark.timeout(120)
def test_command_not_found_or_not_executable_is_one_line(tmp_path):
    proc = _cli("--workers=2", "--", "no-such-command", "--flag")
    assert proc.returncode == 127, proc.stdout + proc.stderr
    lines = (proc.stdout + proc.stderr).splitlines()
    assert len(lines) == 1 and "'no-such-command'" in lines[0], lines

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    proc = _cli("--", str(script))
    assert proc.returncode == 126, proc.stdout + proc.stderr
    lines = (proc.stdout + proc.stderr).splitlines()
    assert len(lines) == 1 and "chmod +x" in lines[0] and str(script) in lines[0], lines

    # Not found inside a wrapper: the task's own 127, a usage error, so no restart.
    proc = _cli("--restarts=2", "--", "sh", "-c", "no-such-command")
    assert proc.returncode == 127, proc.stdout + proc.stderr
    assert not _restart_lines(proc.stdout) and "Traceback" not in proc.stdout + proc.stderr


# SIGTERM to the launcher: graceful stop of every task, exit 143, no restart.

TRAPS_SIGTERM = """
import os, signal, sys, time
def bye(signum, frame):
    print("stopping gracefully", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
print("PID", os.getpid(), flush=True)
time.sleep(120)
"""


@pytest.mark.timeout(120)
def test_sigterm_to_the_launcher_stops_tasks_gracefully_and_exits_143():
    launcher = subprocess.Popen(
        [
            PY,
            "-m",
            "tfstrat",
            "launch",
            "--workers=2",
            "--restarts=2",
            "--show=all",  # both tasks' lines are read
            "--",
            PY,
            "-c",
            TRAPS_SIGTERM,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        started = 0
        for line in launcher.stdout:
            started += " PID " in line
            if started == 2:
                break
        launcher.send_signal(signal.SIGTERM)
        out, _ = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 143, out
    assert out.count("stopping gracefully") == 2, out
    assert "SIGTERM received; stopped all tasks" in out
    assert not _restart_lines(out), out


# Item 13: every descendant dies with the launcher.


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is as good as dead
    except OSError:  # no such file, or ESRCH when the process goes between open() and read()
        return False


# One write(2) per line: print() with PYTHONUNBUFFERED=1 writes "TAG", " ", "PID", "\n" apart,
# and the two grandchildren's lines interleaved on the shared pipe ("GROUPSESSION 5303").
GRANDCHILD = "import os, time; {setsid}os.write(1, b'{tag} %d\\n' % os.getpid()); time.sleep(600)"


@pytest.mark.timeout(120)
def test_grandchildren_die_with_a_killed_launcher():
    # One grandchild stays in the task's process group; one leaves it (setsid), as daemons do.
    in_group = GRANDCHILD.format(setsid="", tag="GROUP")
    own_session = GRANDCHILD.format(setsid="os.setsid(); ", tag="SESSION")
    wrapper = f'{PY} -c "{own_session}" & {PY} -c "{in_group}"; echo done'
    launcher = subprocess.Popen(
        [PY, "-m", "tfstrat", "launch", "--workers", "1", "--", "sh", "-c", wrapper],
        stdout=subprocess.PIPE,
        text=True,
    )
    pids: dict[str, int] = {}
    try:
        for line in launcher.stdout:
            _, tag, pid = (line.split() + ["", "", ""])[:3]
            if tag in ("GROUP", "SESSION"):
                pids[tag] = int(pid)
            if len(pids) == 2:
                break
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [t for t, p in pids.items() if _alive(p)], f"left running: {pids}"
    finally:
        launcher.kill()
        for p in pids.values():
            with contextlib.suppress(OSError):  # gone between the check and the kill
                if _alive(p):
                    os.kill(p, signal.SIGKILL)


# Item 12: blame the right task (TensorFlow clusters).

TIMEOUT = 15  # the collective timeout of the worker scripts, and so their start-up deadline
GRACE = 2.0
BLAMED = "worker:1 is the probable cause: worker:0 failed first (exit code 1)"


def _assert_blames_worker_1(code, out, lines, end, mode):
    assert code == 1, out[-6000:]
    assert "training finished" not in out
    # The first line that reports the failure says it (when worker 1 still runs, as soon as
    # worker 0's exit is noticed), and so does the box, with worker 0's error naming worker 1.
    noticed, first = next((t, line) for t, line in lines.lines if "failed first" in line)
    assert BLAMED in first, out[-6000:]
    assert "/job:worker/replica:0/task:1" in out.rsplit(BLAMED, 1)[1], out[-6000:]
    # From worker 1's fault: worker 0's collective timeout and exit, the launcher's grace
    # period, and a busy machine's slack.
    fault = lines.when(f"worker 1: {mode} now")
    assert end - fault < TIMEOUT + GRACE + 30, (end - fault, out[-3000:])
    assert end - noticed < GRACE + 10, out[-3000:]


@pytest.mark.cluster
@pytest.mark.timeout(START_SLACK + TIMEOUT + 15 + 60)
def test_stopped_worker_is_blamed_not_the_worker_that_timed_out():
    code, out, lines, end = _launch(
        "faults_launch_peer.py", "sigstop", str(TIMEOUT), workers=2, threads_per_task=1, grace=GRACE
    )
    _assert_blames_worker_1(code, out, lines, end, "sigstop")


@pytest.mark.cluster
@pytest.mark.timeout(START_SLACK + TIMEOUT + 15 + 60)
def test_worker_that_exits_0_mid_run_is_blamed():
    code, out, lines, end = _launch(
        "faults_launch_peer.py", "exit0", str(TIMEOUT), workers=2, threads_per_task=1, grace=GRACE
    )
    _assert_blames_worker_1(code, out, lines, end, "exit0")


@pytest.mark.cluster
@pytest.mark.timeout(START_SLACK + TIMEOUT + 15 + 60)
@pytest.mark.parametrize("mode", ["sigstop", "late"])
def test_a_faulty_peer_in_tensorflows_collectives_is_named_within_the_timeout(mode):
    """Two devices per worker and steps_per_execution 2: the step's gradients go over
    TensorFlow's collectives, which carry no per-op timeout; the process's watchdog ends worker
    0's wait after `timeout` naming worker 1: stopped (SIGSTOP: its gRPC server does not
    answer) or late (asleep in a callback: it answers but does not join). A peer gone (exit 0)
    is noticed as a stopped one is (`faults_launch_peer.py exit0 T 2` runs it; the test above
    runs it on one device)."""
    code, out, lines, end = _launch(
        "faults_launch_peer.py",
        mode,
        str(TIMEOUT),
        "2",
        workers=2,
        threads_per_task=1,
        grace=GRACE,
    )
    _assert_blames_worker_1(code, out, lines, end, mode)
    # A stopped or gone task is noticed by the coordination service's heartbeats or by the
    # watchdog's probe, whichever comes first; a late one only by the watchdog.
    said = {
        "sigstop": ["do not answer (dead, stopped or cut off): worker:1", "stopped sending heart"],
        "late": ["every peer answers, and worker:1 (/job:worker/replica:0/task:1) did not join"],
    }[mode]
    assert any(s in out for s in said), out[-6000:]


@pytest.mark.cluster
@pytest.mark.timeout(START_SLACK + 180)
def test_async_worker_that_exits_0_early_is_reported_and_the_run_still_succeeds(tmp_path):
    report = "tfstrat launch: worker:1 exited 0 while worker:0 still runs."
    reported = tmp_path / "reported"
    code, out, _, _ = _launch(
        "faults_launch_async.py",
        str(reported),
        out=_Marking(report, reported),
        workers=2,
        ps=1,
        threads_per_task=1,
    )
    assert code == 0, out[-6000:]
    assert report in out, out[-6000:]
    assert "worker:0 finished training" in out
    assert "worker:0 saw the launcher's report: True" in out, out[-6000:]


@pytest.mark.timeout(120)
def test_error_before_teardown_warnings_is_shown_and_blamed():
    """Python's teardown warnings after a traceback (TensorFlow prints one per optimizer slot
    of an unfinished restore) neither hide the error in the box nor the task it names."""
    code, out, _, _ = _launch("faults_launch_noisy_exit.py", workers=2, grace=5)
    assert code != 0, out[-3000:]
    box = out[out.index("=" * 72) :]
    assert "TimeoutError: no reply from /job:worker/replica:0/task:1 after 60 s" in box, box
    assert "more lines after it left out" in box, box
    assert "worker:1 is the probable cause" in out, out[-3000:]
