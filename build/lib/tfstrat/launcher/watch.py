"""Runs one task of `tfstrat launch` and takes every process it started down with it.

The launcher starts it as `python -I -S watch.py LIFELINE SPEC` (two file descriptors) and
writes the task's command and environment as JSON to SPEC, so the only process whose
`/proc/PID/environ` holds the task's TF_CONFIG, and whose command line is the task's, is the
task itself (tests and tools find tasks that way). It imports only the standard library (not
tfstrat, not TensorFlow), so it costs ~20 ms and a few MB per task. It

- starts COMMAND in its own process group, with SIGKILL as its parent-death signal;
- is a child subreaper (Linux), so the command's orphaned descendants (the `python` of
  `sh -c "python train.py; ..."`, a daemon that called setsid) become its children instead of
  init's and can still be found when the task must die;
- forwards SIGTERM to the command's group, with SIGCONT so a stopped (SIGSTOP) task sees it;
- when FD reaches end of file (it is the read end of a pipe whose write end only the launcher
  holds, so this happens when the launcher dies, even by SIGKILL, or closes it to stop the
  task) or the command ends, SIGKILLs the group and every descendant and reaps them;
- ends with the command's status: its exit code, or its signal raised again on itself, so the
  launcher sees what the task did.
"""

import ctypes
import json
import os
import resource
import select
import signal
import subprocess
import sys
import time

_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36
_EXIT_NOT_FOUND, _EXIT_NOT_EXECUTABLE = 127, 126  # the shell's codes


def _prctl(option: int, value: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the process group still works
        pass


def _in_child() -> None:
    os.setpgrp()  # the launcher's SIGTERM reaches the task's whole group
    # A watcher killed by SIGKILL cannot clean up; its direct child at least goes with it.
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _descendants() -> list[int]:
    """Every live process below this one (orphans of the command land here: subreaper)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:  # no /proc (not Linux): the process group is all we can reach
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != b"Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _reap(task: int, status: int | None) -> int | None:
    """Reaps every finished child; returns the task's wait status once it is among them."""
    while True:
        try:
            pid, got = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status
        if pid == 0:
            return status
        if pid == task:
            status = got


def _kill_everything(task: int, status: int | None) -> int:
    """SIGKILLs the task's group and all descendants until none is left; returns its status."""
    try:
        os.killpg(task, signal.SIGKILL)
    except OSError:
        pass
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        status = _reap(task, status)
        pids = _descendants()  # again after each pass: one may have forked before it died
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)
    if status is None:  # cannot happen unless the kernel refused to kill it; do not hang
        status = os.waitpid(task, 0)[1]
    return status


def _wait(task: int, lifeline: int) -> int | None:
    """Waits until the task ends (its wait status) or the lifeline is cut (None)."""
    try:
        watched = [lifeline, os.pidfd_open(task)]
        poll = 1.0  # only to reap orphans that ended; the pidfd wakes us when the task ends
    except (AttributeError, OSError):  # no pidfd (old kernel, not Linux): poll the task
        watched, poll = [lifeline], 0.1
    status = None
    while status is None:
        ready, _, _ = select.select(watched, [], [], poll)
        if lifeline in ready and not os.read(lifeline, 64):
            return None
        status = _reap(task, None)
    return status


def _exit_like(status: int) -> None:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGSEGV/SIGABRT: no core of ours
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL has no handler to reset
            pass
        os.kill(os.getpid(), sig)
        time.sleep(1)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


def main(argv: list[str]) -> None:
    lifeline = int(argv[1])
    with open(int(argv[2]), encoding="utf-8") as f:
        spec = json.load(f)
    command = spec["argv"]
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    # Ctrl-C and a closed terminal reach the launcher's process group, this one included: the
    # launcher decides what happens to the task (handlers, not SIG_IGN, so exec resets them).
    signal.signal(signal.SIGINT, lambda *_: None)
    signal.signal(signal.SIGHUP, lambda *_: None)
    try:
        proc = subprocess.Popen(command, env=spec["env"], preexec_fn=_in_child)
    except OSError as e:
        print(f"tfstrat launch: cannot run {command[0]!r}: {e.strerror}", flush=True)
        os._exit(_EXIT_NOT_FOUND if isinstance(e, FileNotFoundError) else _EXIT_NOT_EXECUTABLE)

    def forward(signum, frame):
        for sig in (signum, signal.SIGCONT):
            try:
                os.killpg(proc.pid, sig)
            except OSError:
                pass

    signal.signal(signal.SIGTERM, forward)
    # The task's status is collected with os.waitpid, never through `proc`.
    status = _kill_everything(proc.pid, _wait(proc.pid, lifeline))
    _exit_like(status)


if __name__ == "__main__":
    main(sys.argv)
