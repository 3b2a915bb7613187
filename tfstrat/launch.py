"""Runs a real TensorFlow cluster on this machine: ps tasks, an optional chief, and workers.

`launch(LaunchConfig(...))` is what `tfstrat launch` calls. Every task is its own process with
its own `TF_CONFIG` on 127.0.0.1, its output prefixed with its task name, run under a watcher
that takes it and all its descendants down with the launcher (`tfstrat/_watch.py`). The first
task to fail stops the run, and its last lines are printed in a box, like torchrun's root-cause
report, naming the task its error blames when that is another one. With `restarts=K`, a failed
run is started again, all tasks on fresh ports, up to K times (torchrun's `--max-restarts`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TextIO

from tfstrat import _tasks
from tfstrat._tasks import Failure, Task
from tfstrat.cluster import TFConfig

EXIT_TIMEOUT = 124
# A failure with one of these codes is the command's or its arguments' fault: a restart would
# fail the same way. 2: argparse and most CLIs; 126: not executable; 127: not found.
USAGE_EXIT_CODES = (2, 126, 127)
# A training task that exits 0 while others still run is reported after this many seconds
# (tasks that finish together exit within this of each other).
_LEFT_EARLY_AFTER = 1.0


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """What `tfstrat launch` runs.

    Attributes:
        command: the program every chief and worker task runs, e.g. `["python", "train.py"]`.
        workers: number of worker tasks (>= 1).
        ps: number of ps tasks, each running `tfstrat server` (stopped when the workers end).
        chief: whether to add a chief task that runs `command` too.
        timeout: seconds after which every task is stopped and launch returns 124; None waits.
            It covers all restarts together.
        port_retries: how many times to restart with fresh ports when a port was taken.
        threads_per_task: threads in each of TensorFlow's pools for every task
            (`TF_NUM_INTRAOP_THREADS` and `TF_NUM_INTEROP_THREADS`). None: this host's cores
            divided among the chief and workers (at least 1), so local tasks do not fight
            over cores; 0: TensorFlow's defaults (every task sizes its pools to all cores).
        env: extra environment variables for every task.
        grace: seconds between SIGTERM and SIGKILL when stopping tasks.
        restarts: how many times to stop every task and start all again, on fresh ports, after
            a task fails (not after exit codes 2, 126, 127, a timeout or an interrupt). Each
            task sees the attempt number in `TFSTRAT_RESTART` (0 on the first run).
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
    restarts: int = 0

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
        if self.restarts < 0:
            raise ValueError(f"Received: restarts={self.restarts}. Use 0 or more restarts.")
        if self.grace < 0:
            raise ValueError(f"Received: grace={self.grace}. Use seconds >= 0.")


def _task_env(
    config: LaunchConfig, tf_config: TFConfig, task: str, index: int, restart: int
) -> dict:
    env = dict(os.environ)
    env.update(config.env or {})
    env.update(tf_config.for_task(task, index).to_env())
    env["TFSTRAT_TASK"] = f"{task}:{index}"
    env["TFSTRAT_RESTART"] = str(restart)
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


def _local_cluster(config: LaunchConfig) -> TFConfig:
    return TFConfig.local(workers=config.workers, ps=config.ps, chief=config.chief)


@dataclasses.dataclass(frozen=True)
class _Outcome:
    code: int
    port_taken: bool = False
    failure: Failure | None = None


class _Attempt:
    """One start of every task, watched until the chief and workers end, one fails, or the
    deadline passes."""

    def __init__(self, config: LaunchConfig, tf_config: TFConfig, out: TextIO, restart: int):
        self.config, self.out = config, out
        env = lambda t, i: _task_env(config, tf_config, t, i, restart)
        server = [sys.executable, "-m", "tfstrat", "server"]
        roles = [("chief", 0)] if config.chief else []
        roles += [("worker", i) for i in range(config.workers)]
        self.ps: list[Task] = []
        self.train: list[Task] = []
        try:
            for i in range(config.ps):
                self.ps.append(Task(f"ps:{i}", server, env("ps", i), out))
            for t, i in roles:
                self.train.append(Task(f"{t}:{i}", config.command, env(t, i), out))
        except BaseException:  # an interrupt or OSError midway: none of them may outlive us
            _tasks.stop(self.ps + self.train, 0)
            raise
        self.everyone = self.ps + self.train
        self.by_name = {t.name: t for t in self.everyone}
        self.ended_at: dict[str, float] = {}  # training tasks seen exited 0, when first seen
        self.left_early: list[str] = []  # those that exited 0 while others still ran

    def run(self, deadline: float | None) -> _Outcome:
        try:
            while True:
                outcome = self._check(deadline)
                if outcome is not None:
                    return outcome
                time.sleep(0.05)
        except BaseException:
            _tasks.stop(self.everyone, self.config.grace)
            raise

    def _check(self, deadline: float | None) -> _Outcome | None:
        for task in self.everyone:
            code = task.poll()
            if code:  # a ps that exits 0 is fine once the workers need it no more
                return self._fail(task, code)
        self._note_left_early()
        if all(t.poll() == 0 for t in self.train):
            _tasks.stop(self.ps, self.config.grace)
            _tasks.stop(self.train, 0)  # nothing left to stop: waits for their last output
            return _Outcome(0)
        if deadline is not None and time.monotonic() > deadline:
            running = ", ".join(t.name for t in self.everyone if t.poll() is None)
            _tasks.stop(self.everyone, self.config.grace)
            self.out.write(
                f"tfstrat launch: timed out after {self.config.timeout:g} s; stopped all tasks "
                f"(still running then: {running}).\n"
            )
            return _Outcome(EXIT_TIMEOUT)
        return None

    def _note_left_early(self):
        now = time.monotonic()
        running = [t.name for t in self.train if t.poll() is None]
        for task in self.train:
            if task.poll() != 0 or task.name in self.left_early:
                continue
            first_seen = self.ended_at.setdefault(task.name, now)
            if running and now - first_seen >= _LEFT_EARLY_AFTER:
                self.left_early.append(task.name)
                self.out.write(
                    f"tfstrat launch: {task.name} exited 0 while {', '.join(running)} still "
                    f"{'runs' if len(running) == 1 else 'run'}.\n"
                )
                self.out.flush()

    def _fail(self, task: Task, returncode: int) -> _Outcome:
        task.finish_output(timeout=2)
        # Any task seen exited 0 before this failure left while this one still ran.
        left = self.left_early + [n for n in self.ended_at if n not in self.left_early]
        failure = _tasks.blame(task, returncode, self.by_name, left)
        live = [t.name for t in self.everyone if t.poll() is None]
        if live and not task.port_error:  # the box comes after the stop, up to grace s later
            self.out.write(
                f"tfstrat launch: {failure.headline()}; stopping {', '.join(live)} "
                f"(SIGTERM, SIGKILL after {self.config.grace:g} s).\n"
            )
            self.out.flush()
        _tasks.stop(self.everyone, self.config.grace)
        if task.port_error:
            return _Outcome(failure.code, port_taken=True)
        _tasks.report(failure, self.by_name, self.out)
        return _Outcome(failure.code, failure=failure)


def _no_restart_reason(failure: Failure, restarts_done: int, restarts: int) -> str | None:
    if failure.code in USAGE_EXIT_CODES:
        return (
            f"exit code {failure.code} means the command or its arguments are wrong "
            "(2: usage, 126: not executable, 127: not found)"
        )
    if restarts_done >= restarts:
        return f"no restarts left ({restarts_done} of --restarts {restarts} used)"
    return None


def _attempts(config: LaunchConfig, out: TextIO, deadline: float | None, make_cluster) -> int:
    """Runs attempts until one succeeds, times out, or fails without a restart left."""
    restart = port_retry = 0
    while True:
        outcome = _Attempt(config, make_cluster(config), out, restart).run(deadline)
        if outcome.port_taken:
            if port_retry >= config.port_retries:
                out.write("tfstrat launch: every retry found a port taken; giving up.\n")
                return outcome.code
            port_retry += 1
            out.write(
                f"tfstrat launch: a port was taken before TensorFlow bound it; retrying with "
                f"fresh ports ({port_retry}/{config.port_retries}).\n"
            )
            continue
        if outcome.failure is None:
            return outcome.code
        reason = _no_restart_reason(outcome.failure, restart, config.restarts)
        if reason is not None:
            if config.restarts:
                out.write(f"tfstrat launch: not restarting: {reason}.\n")
            return outcome.code
        restart += 1
        out.write(
            f"tfstrat launch: restart {restart}/{config.restarts}, every task on fresh ports "
            f"(TFSTRAT_RESTART={restart}), after {outcome.failure.summary()}\n"
        )
        out.flush()


def _command_problem(config: LaunchConfig) -> tuple[int, str] | None:
    """(exit code, message) when the command cannot run: 127 not found, 126 not executable."""
    name = config.command[0]
    path = (config.env or {}).get("PATH", os.environ.get("PATH", os.defpath))
    if shutil.which(name, path=path):
        return None
    fix = "Give a program on PATH or the path of an executable file after `--`."
    if os.sep not in name:
        return 127, f"command not found: {name!r} is not on PATH. {fix}"
    if not os.path.exists(name):
        return 127, f"command not found: {name!r} does not exist. {fix}"
    return 126, (
        f"cannot run {name!r}: not an executable file. Run `chmod +x {name}`, or name its "
        f"interpreter: `-- python {name}`."
    )


class _Interrupted(KeyboardInterrupt):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_interrupted(signum, frame):
    raise _Interrupted(signum)


def launch(config: LaunchConfig, out: TextIO | None = None, *, _make_cluster=None) -> int:
    """Runs a local cluster to completion and returns its exit code.

    Args:
        config: what to run.
        out: where prefixed task output goes (default: sys.stdout).
        _make_cluster: a seam for tests: `LaunchConfig -> TFConfig`, called once per attempt.

    Returns:
        0 when every chief and worker task exits 0; the first failing task's exit code
        otherwise (128 + N for a task killed by signal N), after `config.restarts` restarts;
        124 on timeout; 127 when the command is not found, 126 when it is not executable;
        130 on SIGINT (Ctrl-C) and 143 on SIGTERM to the launcher, after stopping every task.

    Example:
        >>> from tfstrat import LaunchConfig, launch
        >>> launch(LaunchConfig(["python", "-c", "print('hi')"], workers=2))  # doctest: +SKIP
        0
    """
    out = out or sys.stdout
    problem = _command_problem(config)
    if problem is not None:
        out.write(f"tfstrat launch: {problem[1]}\n")
        return problem[0]
    deadline = time.monotonic() + config.timeout if config.timeout else None
    in_main = threading.current_thread() is threading.main_thread()
    handled = (signal.SIGINT, signal.SIGTERM) if in_main else ()
    previous = {s: signal.signal(s, _raise_interrupted) for s in handled}
    try:
        return _attempts(config, out, deadline, _make_cluster or _local_cluster)
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, _Interrupted) else signal.SIGINT
        out.write(f"tfstrat launch: {signal.Signals(signum).name} received; stopped all tasks.\n")
        return 128 + signum
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
