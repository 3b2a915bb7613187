"""`tfstrat launch --private-network`: the whole local cluster in one private network namespace.

TensorFlow's gRPC server binds all interfaces (it has no bind-address option) and runs any op
it is sent, unauthenticated, so a local cluster's ports are open to the machine's network for
as long as it runs. `run` starts a second launcher inside a new network namespace that has only
loopback (`netns.py` creates it, then execs `python -m tfstrat.launcher.inner`, which reads
the LaunchConfig as JSON on stdin), copies its output, and forwards SIGINT/SIGTERM to it. The
inner launcher is an ordinary `launch`: its tasks, watchers and reports are the same.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import TextIO

from tfstrat.launcher.tasks import uninterrupted

_NETNS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netns.py")
_EXIT_TIMEOUT = 124
_SLACK = 30.0  # seconds the inner launcher gets beyond its own timeout and grace


def run(config, out: TextIO) -> int:
    """Runs `config` (a LaunchConfig with private_network=True) in a private network; returns
    the inner launcher's exit code (125 when the kernel refused the namespace)."""
    spec = dataclasses.asdict(dataclasses.replace(config, private_network=False))
    spec["command"] = list(config.command)
    argv = [sys.executable, "-I", "-S", _NETNS, str(os.getpid())]
    argv += [sys.executable, "-m", "tfstrat.launcher.inner"]
    # Its own process group: a terminal's Ctrl-C reaches this launcher only, which forwards it
    # once (two SIGINTs would cut the inner launcher's grace period short).
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        process_group=0,
    )
    try:
        proc.stdin.write(json.dumps(spec).encode())
        proc.stdin.close()
    except BrokenPipeError:  # it failed before reading: its output says why
        pass
    reader = threading.Thread(target=_copy, args=(proc.stdout, out), daemon=True)
    reader.start()
    limit = config.timeout + config.grace + _SLACK if config.timeout else None
    try:
        code = _wait(proc, limit)
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        proc.send_signal(signum)  # the inner launcher stops every task, then exits 128 + signum
        code = uninterrupted(lambda: _wait(proc, config.grace + _SLACK))
    if code is None:
        proc.kill()  # its tasks' watchers see their lifeline cut and kill them
        proc.wait()
        out.write(
            "tfstrat launch: the launcher in the private network did not end in time; killed "
            "it and its tasks.\n"
        )
        code = _EXIT_TIMEOUT
    reader.join(5)
    out.flush()
    return code


def _copy(pipe, out: TextIO) -> None:
    for raw in pipe:
        out.write(raw.decode("utf-8", "replace"))
        out.flush()


def _wait(proc: subprocess.Popen, limit: float | None) -> int | None:
    """The exit status of `proc` (128 + N for signal N), or None after `limit` seconds."""
    deadline = None if limit is None else time.monotonic() + limit
    while deadline is None or time.monotonic() < deadline:
        try:
            code = proc.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            continue
        return 128 - code if code < 0 else code
    return None
