"""Start-up of a multi-worker strategy that cannot hang: every peer must join within `timeout`.

TensorFlow's `context.ensure_initialized()` (TF 2.21) waits for every chief and worker task to
join its coordination service, forever, whatever `CommunicationOptions.timeout_seconds` says,
and it holds Python's GIL while it waits: no thread of this process runs, no Python signal
handler either (SIGTERM is ignored). So the watchdog is a tiny separate process: if start-up
has not finished after `timeout` seconds, it prints one line naming the tasks that never
answered (a TCP connect to each peer's TF_CONFIG address tells a task that is not listening
from one that is) and ends this process with exit code 1, a plain failure: for the length of
the start-up, SIGHUP's handler is libc's `_exit` itself (called with the signal's number, 1),
which runs without Python's GIL. (A SIGKILL would also get through, but exit 137 reads as an
out-of-memory kill to schedulers and scripts; it is the fallback when the program ignores or
handles SIGHUP itself.)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

from tfstrat.cluster import TFConfig
from tfstrat.cluster.ports import accepts


def peers(tf_config: TFConfig) -> list[tuple[str, str]]:
    """(task name, address) of every chief and worker task but this one."""
    me = (tf_config.task_type, tf_config.task_index)
    return [
        (f"{job}:{i}", address)
        for job in ("chief", "worker")
        for i, address in enumerate(tf_config.addresses(job))
        if (job, i) != me
    ]


def diagnosis(me: str, everyone: list[tuple[str, str]], timeout: float) -> str:
    """The line printed when the cluster did not come up in time."""
    silent = [f"{name} at {address}" for name, address in everyone if not accepts(address)]
    if silent:
        return (
            f"tfstrat: {me}: {', '.join(silent)} did not come up within {timeout:g} s "
            "(nothing listens there). Start every task of TF_CONFIG's cluster (`tfstrat "
            "launch`, or one process per task), check the addresses, or raise `timeout=`."
        )
    listed = ", ".join(f"{name} at {address}" for name, address in everyone)
    return (
        f"tfstrat: {me}: the cluster did not come up within {timeout:g} s: {listed} listen "
        "but did not join (a task stopped, still starting, or given another TF_CONFIG?). "
        "Run the same program with the same cluster on every task, or raise `timeout=`."
    )


def _watch(argv: list[str]) -> None:
    """The watchdog process: `python -m tfstrat.strategies._startup FD PID TIMEOUT ME PEERS`."""
    import select

    fd, pid, timeout = int(argv[0]), int(argv[1]), float(argv[2])
    me, everyone, signum = argv[3], [tuple(p) for p in json.loads(argv[4])], int(argv[5])
    ready, _, _ = select.select([fd], [], [], timeout)
    if ready:  # start-up finished (the pipe closed) or the process died
        return
    message = diagnosis(me, everyone, timeout)
    if select.select([fd], [], [], 0)[0]:  # finished while we probed
        return
    print(message, file=sys.stderr, flush=True)
    os.kill(pid, signum)


EXIT_SIGNAL = signal.SIGHUP  # its number, 1, becomes the exit code (`_exit_on`)


def _exit_on(signum: int):
    """Makes `signum` end this process at once with exit code `signum`: its handler becomes
    libc's `_exit`, which needs no GIL (a Python handler would wait for TensorFlow to let go
    of it). Returns a function that restores the signal's default action, or None when the
    signal was not at its default (ignored, as under nohup, or handled by the program): then
    it is left alone, and the watchdog kills instead."""
    import ctypes

    if signal.getsignal(signum) is not signal.SIG_DFL:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal(signum, ctypes.cast(libc._exit, ctypes.c_void_p).value)
    return lambda: libc.signal(signum, 0)  # SIG_DFL


@contextlib.contextmanager
def watchdog(tf_config: TFConfig | None, timeout: float | None):
    """Ends this process (exit code 1) with a message naming the missing peers if the body
    (TensorFlow's blocking cluster start-up) takes longer than `timeout` seconds."""
    if tf_config is None or not peers(tf_config) or not timeout:
        yield
        return
    me = f"{tf_config.task_type}:{tf_config.task_index}"
    restore = _exit_on(EXIT_SIGNAL)
    signum = EXIT_SIGNAL if restore else signal.SIGKILL
    read, write = os.pipe()
    argv = [str(read), str(os.getpid()), str(timeout), me, json.dumps(peers(tf_config))]
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tfstrat.strategies._startup", *argv, str(int(signum))],
            pass_fds=(read,),
            stdin=subprocess.DEVNULL,
        )
    except BaseException:
        os.close(write)
        if restore:
            restore()
        raise
    finally:
        os.close(read)
    try:
        yield
    finally:
        os.close(write)  # the watchdog sees end-of-file and exits
        proc.wait()
        if restore:  # only now: a watchdog that had decided has sent its signal by now
            restore()


if __name__ == "__main__":
    _watch(sys.argv[1:])
