"""Runs a real TensorFlow cluster on this machine: ps tasks, an optional chief, and workers.

`launch(LaunchConfig(...))` is what `tfstrat launch` calls. Every task is its own process with
its own `TF_CONFIG` on 127.0.0.1, in its own process group, killed with the launcher
(PR_SET_PDEATHSIG), its output prefixed with its task name. The first task to fail stops the run,
and its last lines are printed in a box, like torchrun's root-cause report.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

from tfstrat.cluster import TFConfig

EXIT_TIMEOUT = 124
# TensorFlow reports a port taken between choosing and binding it only as this.
_PORT_ERRORS = ("Could not start gRPC server", "Address already in use")
_TAIL_LINES = 20


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """What `tfstrat launch` runs.

    Attributes:
        command: the program every chief and worker task runs, e.g. `["python", "train.py"]`.
        workers: number of worker tasks (>= 1).
        ps: number of ps tasks, each running `tfstrat server` (stopped when the workers end).
        chief: whether to add a chief task that runs `command` too.
        timeout: seconds after which every task is stopped and launch returns 124; None waits.
        port_retries: how many times to restart with fresh ports when a port was taken.
        threads_per_task: threads in each of TensorFlow's pools for every task
            (`TF_NUM_INTRAOP_THREADS` and `TF_NUM_INTEROP_THREADS`). None: this host's cores
            divided among the chief and workers (at least 1), so local tasks do not fight
            over cores; 0: TensorFlow's defaults (every task sizes its pools to all cores).
        env: extra environment variables for every task.
        grace: seconds between SIGTERM and SIGKILL when stopping tasks.
    """

    command: Sequence[str]
    workers: int = 1
    ps: int = 0
    chief: bool = False
    timeout: float | None = None
    port_retries: int = 3
    threads_per_task: int | None = None
    env: Mapping[str, str] | None = None
    grace: float = 5.0

    def __post_init__(self):
        if not self.command:
            raise ValueError("Received: command=[]. Give the program to run after `--`.")
        if self.workers < 1:
            raise ValueError(f"Received: workers={self.workers}. A cluster needs >= 1 worker.")
        if self.ps < 0:
            raise ValueError(f"Received: ps={self.ps}. Use 0 or more ps tasks.")
        if self.threads_per_task is not None and self.threads_per_task < 0:
            raise ValueError(
                f"Received: threads_per_task={self.threads_per_task}. Use >= 1, 0 for "
                "TensorFlow's defaults, or None for cores / (workers + chief)."
            )
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"Received: timeout={self.timeout}. Use seconds > 0, or None.")


def _die_with_parent():
    """Runs in the child before exec: own process group, SIGKILL when the launcher dies."""
    os.setpgrp()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the process group still lets a live launcher stop it
        pass


class _Task:
    """One task process and the reader thread that prefixes and keeps its output."""

    def __init__(self, name: str, argv: Sequence[str], env: Mapping[str, str], out: TextIO):
        self.name = name
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self.port_error = False
        self.proc = subprocess.Popen(
            list(argv),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
        self._out = out
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.tail.append(line)
            if any(e in line for e in _PORT_ERRORS):
                self.port_error = True
            self._out.write(f"[{self.name}] {line}\n")
            self._out.flush()

    def poll(self) -> int | None:
        return self.proc.poll()

    def finish_output(self, timeout: float = 5.0):
        self._reader.join(timeout)

    def signal(self, sig: int):
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _stop(tasks: Sequence[_Task], grace: float):
    live = [t for t in tasks if t.poll() is None]
    for t in live:
        t.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(t.poll() is None for t in live):
        time.sleep(0.05)
    for t in tasks:
        t.signal(signal.SIGKILL)  # also reaps grandchildren left in the group
        try:
            t.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        t.finish_output(timeout=2)


def _report_failure(task: _Task, code: int, out: TextIO):
    bar = "=" * 72
    out.write(
        f"{bar}\ntfstrat launch: {task.name} failed first (exit code {code}{_signal_name(code)}); "
        f"stopped the other tasks.\nLast lines of {task.name}:\n"
    )
    for line in task.tail:
        out.write(f"  {line}\n")
    out.write(f"{bar}\n")
    out.flush()


def _task_env(config: LaunchConfig, tf_config: TFConfig, task: str, index: int) -> dict:
    env = dict(os.environ)
    env.update(config.env or {})
    env.update(tf_config.for_task(task, index).to_env())
    env["TFSTRAT_TASK"] = f"{task}:{index}"
    env["PYTHONUNBUFFERED"] = "1"
    if task == "ps":  # a ps logs every client's whole session config at INFO level
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    threads = threads_per_task(config)
    if threads:  # both pools: 2 inter-op threads alone keep ~1.4 cores of a process busy
        env["TF_NUM_INTRAOP_THREADS"] = env["TF_NUM_INTEROP_THREADS"] = str(threads)
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def threads_per_task(config: LaunchConfig) -> int:
    """Threads per TensorFlow pool for each task (0: TensorFlow's defaults)."""
    if config.threads_per_task is not None:
        return config.threads_per_task
    training_tasks = config.workers + (1 if config.chief else 0)
    return max(1, (os.cpu_count() or 1) // training_tasks)


def _start(config: LaunchConfig, tf_config: TFConfig, out: TextIO) -> tuple[list, list]:
    """Starts ps tasks, then chief and workers. Returns (ps tasks, training tasks)."""
    server = [sys.executable, "-m", "tfstrat", "server"]
    ps = [
        _Task(f"ps:{i}", server, _task_env(config, tf_config, "ps", i), out)
        for i in range(config.ps)
    ]
    roles = [("chief", 0)] if config.chief else []
    roles += [("worker", i) for i in range(config.workers)]
    train = [
        _Task(f"{t}:{i}", config.command, _task_env(config, tf_config, t, i), out) for t, i in roles
    ]
    return ps, train


def _local_cluster(config: LaunchConfig) -> TFConfig:
    return TFConfig.local(workers=config.workers, ps=config.ps, chief=config.chief)


def _run_once(
    config: LaunchConfig, out: TextIO, deadline: float | None, make_cluster
) -> tuple[int, bool]:
    """One attempt. Returns (exit code, whether it failed on a taken port)."""
    tf_config = make_cluster(config)
    ps, train = _start(config, tf_config, out)
    everyone = ps + train
    try:
        while True:
            for task in everyone:
                code = task.poll()
                if code is None or (code == 0 and task in train):
                    continue
                if code == 0:  # a ps ended by itself: fine once the workers need it no more
                    continue
                _stop(everyone, config.grace)
                if task.port_error:
                    return code, True
                _report_failure(task, code, out)
                return code, False
            if all(t.poll() == 0 for t in train):
                _stop(ps, config.grace)
                for t in train:
                    t.finish_output()
                return 0, False
            if deadline is not None and time.monotonic() > deadline:
                running = ", ".join(t.name for t in everyone if t.poll() is None)
                _stop(everyone, config.grace)
                out.write(
                    f"tfstrat launch: timed out after {config.timeout:g} s; stopped all tasks "
                    f"(still running then: {running}).\n"
                )
                return EXIT_TIMEOUT, False
            time.sleep(0.05)
    except BaseException:
        _stop(everyone, grace=1.0)
        raise


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def launch(config: LaunchConfig, out: TextIO | None = None, *, _make_cluster=None) -> int:
    """Runs a local cluster to completion and returns its exit code.

    Args:
        config: what to run.
        out: where prefixed task output goes (default: sys.stdout).
        _make_cluster: a seam for tests: `LaunchConfig -> TFConfig`, called once per attempt.

    Returns:
        0 when every chief and worker task exits 0; the first failing task's exit code
        otherwise; 124 on timeout; 130 when interrupted.

    Example:
        >>> from tfstrat import LaunchConfig, launch
        >>> launch(LaunchConfig(["python", "-c", "print('hi')"], workers=2))  # doctest: +SKIP
        0
    """
    out = out or sys.stdout
    deadline = time.monotonic() + config.timeout if config.timeout else None
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt) if in_main else None
    try:
        for attempt in range(config.port_retries + 1):
            code, port_taken = _run_once(config, out, deadline, _make_cluster or _local_cluster)
            if not port_taken:
                return code
            out.write(
                f"tfstrat launch: a port was taken before TensorFlow bound it; retrying with "
                f"fresh ports ({attempt + 1}/{config.port_retries}).\n"
            )
        out.write("tfstrat launch: every retry found a port taken; giving up.\n")
        return code
    except KeyboardInterrupt:
        out.write("tfstrat launch: interrupted; stopped all tasks.\n")
        return 130
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)


def _signal_name(code: int) -> str:
    """ ", killed by SIGSEGV" for a negative exit code, else ""."""
    import signal

    if code >= 0:
        return ""
    try:
        return f", killed by {signal.Signals(-code).name}"
    except ValueError:
        return ""
