"""What tfstrat hides by default: TensorFlow's start-up lines and warnings that tell the user
nothing they can act on.

Three places, each with a short list that names every entry:

- `task_env`: the logging environment `tfstrat launch` gives the tasks it starts
  (`TF_CPP_MIN_LOG_LEVEL=2`: TensorFlow's C++ INFO and WARNING lines), unless set already.
- `LineFilter`: lines of a task's output that `tfstrat launch` does not show (they stay in the
  task's file in --log-dir). TensorFlow 2.21 prints some of them before its C++ logging reads
  `TF_CPP_MIN_LOG_LEVEL`, so no environment variable hides them.
- `install`: a `logging.Filter` on TensorFlow's and absl's Python loggers, installed when a
  strategy is created (`tfstrat.runtime.apply`), for warnings about settings tfstrat makes on
  purpose.

Errors are never hidden, nor tfstrat's own lines. A warning that matters (a stock Embedding
on a ps, an uneven split) is tfstrat's own, and is printed by the chief's task, which
`tfstrat launch` shows by default.

Environment:
    TFSTRAT_VERBOSE: "1" (or `tfstrat launch --verbose`) hides nothing: no logging
        environment for tasks, no filtered lines, no filtered Python warnings.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator, Mapping

VERBOSE = "TFSTRAT_VERBOSE"
_TRUE = ("1", "true", "yes", "on")

# Lines a task prints that say nothing to the user: (why it is hidden, the line's pattern).
# Seen with TensorFlow 2.21 on a CPU-only machine, with TF_CPP_MIN_LOG_LEVEL=2.
NOISE_LINES: tuple[tuple[str, re.Pattern], ...] = (
    (
        "absl's notice, printed before TensorFlow's C++ logging starts",
        re.compile(r"^WARNING: All log messages before absl::InitializeLog\(\) is called"),
    ),
    (
        "no CUDA driver: TensorFlow runs on the CPU (`tfstrat devices` lists the devices)",
        re.compile(r"cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine"),
    ),
    (
        "oneDNN's notice that its CPU kernels are on (TensorFlow 2.21 prints it before its C++ "
        "logging starts, on CPUs where the kernels are on by default); setting "
        "TF_ENABLE_ONEDNN_OPTS=0 instead would change speed and rounding",
        re.compile(r"port\.cc:\d+\] oneDNN custom operations are on"),
    ),
    (
        "TensorFlow 2.19's notice that its CUDA plugins registered twice (printed before its "
        "C++ logging starts, with or without a GPU; harmless)",
        re.compile(
            r"Unable to register cu(FFT|DNN|BLAS) factory: Attempting to register factory for "
            r"plugin cu\w+ when one has already been registered"
            r"|computation placer already registered\. Please check linkage"
        ),
    ),
    (
        "tf.data's note that the auto_shard_policy changed: tfstrat shards the input itself "
        "and says how in its own line",
        re.compile(r"WARNING:absl:Changing the value of option auto_shard_policy"),
    ),
)
# Hidden only after the same task said it found no CUDA driver: then cuInit cannot succeed.
# On a machine with a driver, a failing cuInit is a real problem, and is shown.
_CUINIT = re.compile(r"\] failed call to cuInit: ")
_NO_DRIVER = next(p for why, p in NOISE_LINES if "no CUDA driver" in why)

# Python log records hidden by `install`: (logger, why, the message's pattern).
NOISE_RECORDS: tuple[tuple[str, str, re.Pattern], ...] = (
    (
        "absl",
        "tf.data's note that the auto_shard_policy changed (tfstrat sets it on purpose)",
        re.compile(r"^Changing the value of option auto_shard_policy"),
    ),
)


def verbose(env: Mapping[str, str] | None = None) -> bool:
    """Whether `TFSTRAT_VERBOSE` asks to hide nothing."""
    env = os.environ if env is None else env
    return env.get(VERBOSE, "").strip().lower() in _TRUE


def task_env(env: Mapping[str, str], task: str, verbose: bool) -> dict[str, str]:
    """`env` with the logging settings for a task of `tfstrat launch`.

    Args:
        env: the task's environment so far (the user's settings win).
        task: the task's type ("ps", "worker", "chief").
        verbose: hide nothing; passed on to the task as `TFSTRAT_VERBOSE=1`.

    Returns:
        A new dict.
    """
    out = dict(env)
    if verbose:
        out[VERBOSE] = "1"
        if task == "ps":  # a ps logs every client's whole session config at INFO level
            out.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
        return out
    # 2: C++ errors only. 3 would hide errors too (a port taken, a peer gone).
    out.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return out


class LineFilter:
    """Decides, line by line, whether a task's output line is shown (one filter per task).

    Example:
        >>> f = LineFilter()
        >>> f.shows("Epoch 1/5")
        True
        >>> f.shows("WARNING: All log messages before absl::InitializeLog() is called are ...")
        False
    """

    def __init__(self, verbose: bool = False):
        self.verbose = verbose
        self.no_driver = False

    def shows(self, line: str) -> bool:
        if self.verbose:
            return True
        if _NO_DRIVER.search(line):
            self.no_driver = True
            return False
        if self.no_driver and _CUINIT.search(line):
            return False
        return not any(pattern.search(line) for _, pattern in NOISE_LINES)


@contextlib.contextmanager
def quiet_tensorflow_import() -> Iterator[None]:
    """Runs the block with `TF_CPP_MIN_LOG_LEVEL=2` (unless set) and file descriptor 2 read
    through a `LineFilter`, for commands that import TensorFlow in this process (`tfstrat
    devices`, `tfstrat doctor`): TensorFlow's C++ start-up lines go straight to the
    descriptor, past Python's `sys.stderr`, some before it reads its log level."""
    if verbose():
        yield
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.stderr.flush()
    saved = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def pump():
        shown = LineFilter()
        with os.fdopen(read_end, "rb") as pipe:
            for raw in pipe:
                if shown.shows(raw.decode("utf-8", "replace").rstrip("\n")):
                    os.write(saved, raw)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last write end closes: the reader sees its end
        reader.join(5)
        os.close(saved)


class _RecordFilter(logging.Filter):
    def __init__(self, patterns):
        super().__init__()
        self.patterns = patterns

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a record that cannot format is not ours to judge
            return True
        return not any(p.search(message) for p in self.patterns)


_installed = False


def install() -> None:
    """Adds the filters of `NOISE_RECORDS` to their loggers, once (unless TFSTRAT_VERBOSE)."""
    global _installed
    if _installed or verbose():
        return
    _installed = True
    # absl's own logger class must make the "absl" logger: getLogger("absl") before absl's
    # import would make a plain one, which absl would then use.
    import absl.logging  # noqa: F401

    by_logger: dict[str, list[re.Pattern]] = {}
    for name, _, pattern in NOISE_RECORDS:
        by_logger.setdefault(name, []).append(pattern)
    for name, patterns in by_logger.items():
        logging.getLogger(name).addFilter(_RecordFilter(patterns))
