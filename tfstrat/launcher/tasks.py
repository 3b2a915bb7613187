"""The task processes of `tfstrat launch`: starting, watching, stopping, and blaming them.

Each task runs under a small watcher process (`watch.py`): the task and everything it starts
die with the launcher, even when the launcher is SIGKILLed and the task is a wrapper such as
`sh -c "python train.py"`. When a task fails, `blame` reads its last lines for the task it
names (`/job:worker/replica:0/task:1`, `worker:1`, `ps:0`): a worker that times out waiting for
a stopped peer fails first, but the peer is the cause.

A task's output goes, whole, to its file in the launcher's log directory (when there is one),
and to the launcher's stream only when the task is shown (`--show`), less the start-up lines
that `tfstrat/runtime/quiet.py` names. The lines kept for blame and for the failure box leave those
out too: a CUDA notice is no task's error.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, TextIO

from tfstrat.runtime.quiet import LineFilter

_WATCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "watch.py")
# TensorFlow reports a port taken between choosing and binding it only as this.
_PORT_ERRORS = ("Could not start gRPC server", "Address already in use")
_TAIL_LINES = 200  # enough for a crash dump of several threads
# What a worker that stopped gracefully on SIGTERM says last (tfstrat.strategies._stopping).
STOPPED_ON_SIGTERM = "stopped on SIGTERM; exiting with 143"
_BLAME_LINES = 40  # the lines searched for an error line and the tasks it names
# TensorFlow's task names, and tfstrat's (`worker:1`, `ps:0 at host:port`).
_TASK_NAME = re.compile(r"/job:(\w+)/replica:\d+/task:(\d+)|\b(chief|worker|ps|evaluator):(\d+)\b")
_ERROR_LINE = re.compile(r"\w(Error|Exception|Exit)\b|\berror\b|failed|fatal|abort", re.I)
# A log line that is a warning, however it mentions errors (Python's and TensorFlow's forms).
_WARNING = re.compile(r"(WARNING:|W\d{4} |\S+: \w*Warning:|.*\bwarnings?\.warn)")


def exit_status(returncode: int) -> int:
    """A Popen return code as a shell reports it: 128 + N for a task killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def signal_note(returncode: int) -> str:
    """ ", killed by SIGKILL" for a task killed by a signal, else ""."""
    if returncode >= 0:
        return ""
    try:
        return f", killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f", killed by signal {-returncode}"


class Task:
    """One task: its watcher process, and the reader thread that prefixes and keeps its output.

    Args:
        name: the task, e.g. "worker:1".
        argv: its command.
        env: its whole environment.
        out: the launcher's stream; the task's lines go there as "[worker:1] line".
        shown: whether its lines go to `out` at all (they are kept for a failure report anyway).
        log: a file that gets every line of the task, unfiltered; closed at the output's end.
        verbose: show the start-up lines `_quiet.LineFilter` would hide.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: dict[str, str],
        out: TextIO,
        *,
        shown: bool = True,
        log: TextIO | None = None,
        verbose: bool = False,
    ):
        self.name = name
        self.shown = shown
        self._log = log
        self._filter = LineFilter(verbose)
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self.port_error = False
        # All four ends are close-on-exec: no task inherits them.
        read_end, self._lifeline = os.pipe()
        spec_read, spec_write = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", _WATCH, str(read_end), str(spec_read)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=(read_end, spec_read),
            )
        except BaseException:
            os.close(self._lifeline)
            os.close(spec_write)
            raise
        finally:
            os.close(read_end)
            os.close(spec_read)
        try:
            with open(spec_write, "w", encoding="utf-8") as f:
                json.dump({"argv": list(argv), "env": env}, f)
        except BrokenPipeError:  # the watcher died at start: its exit code tells the launcher
            pass
        self._out = out
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        try:
            for raw in self.proc.stdout:
                line = raw.decode("utf-8", "replace").rstrip("\n")
                if any(e in line for e in _PORT_ERRORS):
                    self.port_error = True
                if self._log is not None:
                    self._log.write(line + "\n")
                if not self._filter.shows(line):
                    continue
                self.tail.append(line)
                if self.shown:
                    self._out.write(f"[{self.name}] {line}\n")
                    self._out.flush()
        finally:
            if self._log is not None:
                self._log.close()

    def poll(self) -> int | None:
        return self.proc.poll()

    def finish_output(self, timeout: float = 5.0):
        self._reader.join(timeout)

    def terminate(self):
        """SIGTERM to the task's process group (the watcher forwards it, with SIGCONT)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self):
        """SIGKILL to the task and every descendant; waits for them and the output's end."""
        if self._lifeline is not None:
            os.close(self._lifeline)  # the watcher kills everything below it and exits
            self._lifeline = None
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:  # a watcher that cannot exit: its task has PDEATHSIG
            self.proc.kill()
            self.proc.wait()
        self.finish_output(timeout=2)


def uninterrupted(fn: Callable[[], Any]):
    """Runs fn to the end even if SIGINT/SIGTERM (KeyboardInterrupt) arrives meanwhile."""
    while True:
        try:
            return fn()
        except KeyboardInterrupt:
            continue


def stop(tasks: Sequence[Task], grace: float):
    """SIGTERM to every live task, up to `grace` seconds to exit, then SIGKILL to all."""
    live = [t for t in tasks if t.poll() is None]
    try:
        for t in live:
            t.terminate()
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(t.poll() is None for t in live):
            time.sleep(0.05)
    except KeyboardInterrupt:  # a second Ctrl-C or SIGTERM: no more grace
        pass
    for t in tasks:
        uninterrupted(t.kill)


def recent(tail, count: int = _BLAME_LINES) -> list[str]:
    """The lines of a task's tail that say why it ended: the last `count`, or, when the last
    Python traceback began before them, from that traceback on (Python prints warnings after
    the traceback as it tears objects down, e.g. TensorFlow's "Value in checkpoint could not be
    found" for every optimizer slot of an unfinished restore; they must not hide the error)."""
    lines = list(tail)
    start = max((i for i, x in enumerate(lines) if x.startswith("Traceback")), default=None)
    if start is None or start >= len(lines) - count:
        return lines[-count:]
    return lines[start:]


def error_line(lines: Sequence[str]) -> str:
    """The last line that looks like an error (e.g. Python's exception line), else the last."""
    lines = [line.strip() for line in lines if line.strip()]
    line = next((x for x in reversed(lines) if _ERROR_LINE.search(x)), lines[-1] if lines else "")
    return line[:300] or "(no output)"


def named_tasks(lines: Sequence[str], me: str, known: Collection[str]) -> list[str]:
    """Tasks of `known` other than `me` that the last error in `lines` names, latest first.

    Only the lines from the last "Traceback" on count when there is one: earlier lines are
    logs, which may name other tasks for other reasons.
    """
    lines = list(lines)
    start = max((i for i, x in enumerate(lines) if x.startswith("Traceback")), default=0)
    names: list[str] = []
    for line in reversed(lines[start:]):
        for m in _TASK_NAME.finditer(line):
            name = f"{m[1]}:{m[2]}" if m[1] else f"{m[3]}:{m[4]}"
            if name != me and name in known and name not in names:
                names.append(name)
    return names


@dataclasses.dataclass(frozen=True)
class Failure:
    """The first task that failed, and the task that probably caused it."""

    noticed_by: Task
    returncode: int  # Popen's: negative for a signal
    cause: str  # a task name; the noticer's own unless its error names another or one left
    why: str = ""  # how the cause was found, when it is not the noticer
    # A multi-node run's task -> "node 1 (host)": reports say where each task ran.
    places: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def code(self) -> int:
        return exit_status(self.returncode)

    def at(self, name: str) -> str:
        """ "worker:1", or "worker:1 on node 1 (host)" in a multi-node run."""
        return f"{name} on {self.places[name]}" if name in self.places else name

    def headline(self) -> str:
        seen = (
            f"{self.at(self.noticed_by.name)} failed first (exit code {self.code}"
            f"{signal_note(self.returncode)})"
        )
        if self.cause == self.noticed_by.name:
            return seen
        return f"{self.at(self.cause)} is the probable cause: {seen} {self.why}"

    def summary(self) -> str:
        """One line for a restart notice: which task, exit code, its error line."""
        line = error_line(recent(self.noticed_by.tail))
        if self.cause == self.noticed_by.name:
            return (
                f"{self.at(self.cause)} failed (exit code {self.code}"
                f"{signal_note(self.returncode)}): {line}"
            )
        return (
            f"{self.at(self.cause)} (probable cause; {self.noticed_by.name} failed with exit "
            f"code {self.code}): {line}"
        )


def blame(
    task: Task,
    returncode: int,
    known: Collection[str],
    left_early: Sequence[str],
    places: Mapping[str, str] | None = None,
):
    """The Failure of `task`: the task its error names, else one that exited 0 too early.

    `known` holds every task of the cluster (in a multi-node run, other nodes' too)."""
    places = places or {}
    tail = recent(task.tail)
    if exit_status(returncode) == 143 and any(STOPPED_ON_SIGTERM in line for line in tail):
        # It stopped as it was told (its logs may name other tasks): nobody else to blame.
        return Failure(task, returncode, task.name, "", places)
    named = named_tasks(tail, task.name, known)
    if named:
        return Failure(task, returncode, named[0], f"with an error naming {named[0]}", places)
    others = [name for name in left_early if name != task.name]
    if others:
        return Failure(
            task,
            returncode,
            others[0],
            f"after {others[0]} had exited 0 while the others ran",
            places,
        )
    return Failure(task, returncode, task.name, "", places)


def last_lines(tail, count: int = 20) -> list[str]:
    """The last `count` lines of a task's output, without Python's crash-dump list of loaded
    extension modules (one line of thousands of characters); after a native crash, from a
    few lines before "Fatal Python error" instead (the line that says what crashed, and TF's
    own fatal message just before it, matter more than the last threads' stacks); when the
    last Python traceback began before the last `count` lines, the lines up to its error (the
    last line that reads as one, not a warning) and 2 after it, with lines saying how many
    were left out before and after (e.g. TensorFlow's teardown warnings)."""
    lines = [line for line in tail if not line.startswith("Extension modules:")]
    fatal = [i for i, line in enumerate(lines) if line.startswith("Fatal Python error")]
    if fatal:
        start = max(0, fatal[-1] - 5)
        return lines[start:][: max(count, 40)]
    shown = recent(lines, count)
    if len(shown) <= count:
        return shown
    errors = [i for i, x in enumerate(shown) if _ERROR_LINE.search(x) and not _WARNING.match(x)]
    end = min(len(shown), (errors[-1] if errors else len(shown) - 1) + 3)
    start = max(1, end - (count - 3))
    head = [shown[0]] if start == 1 else [shown[0], f"... ({start - 1} lines left out)"]
    after = len(shown) - end
    tail_lines = [f"... ({after} more lines after it left out; the last:)", shown[-1]]
    return [*head, *shown[start:end], *(tail_lines if after > 1 else shown[end:])]


def report(
    failure: Failure, tasks_by_name: dict[str, Task], out: TextIO, log_dir: str | None = None
):
    """The box printed when a run fails: headline, the noticer's last lines (and the cause's),
    whether or not those tasks were shown, and where every task's whole output is."""
    bar = "=" * 72
    task = failure.noticed_by
    out.write(f"{bar}\ntfstrat launch: {failure.headline()}; stopped the other tasks.\n")
    out.write(f"Last lines of {failure.at(task.name)}:\n")
    for line in last_lines(task.tail):
        out.write(f"  {line}\n")
    cause = tasks_by_name.get(failure.cause)
    if cause is not None and cause is not task:
        out.write(f"Last lines of {cause.name}:\n")
        for line in list(cause.tail)[-5:] or ["(no output)"]:
            out.write(f"  {line}\n")
    if log_dir is not None:
        out.write(f"Every task's full output: {log_dir}\n")
    out.write(f"{bar}\n")
    out.flush()
