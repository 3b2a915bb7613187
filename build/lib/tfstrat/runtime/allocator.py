"""Process settings tfstrat makes on the user's behalf: TensorFlow's BFC allocator on the CPU,
and quiet logs (`quiet`: TensorFlow's Python warnings that say nothing).

With TensorFlow's default CPU allocator (the C library's malloc), a step under a tf.distribute
strategy ran at about half the speed of the same step without one (benchmarks/overhead). The strategy's input path builds a GeneratorDataset, whose kernel fixes
glibc's mmap threshold at 128 KiB for the whole process (TF 2.21's
`mallopt(M_MMAP_THRESHOLD, 131072)`); from then on every step buffer over 128 KiB is mapped,
faulted in page by page and unmapped again. TensorFlow's BFC allocator keeps its memory, so
tensors stay clear of malloc and the steps run as fast as without a strategy.

TensorFlow reads `TF_CPU_ALLOCATOR_USE_BFC` once, when it creates its CPU devices: at the
first op, `tf.config.list_logical_devices()` or the first strategy, not at `import tensorflow`.
So creating a tfstrat strategy sets it while that has not happened yet (`configure`, called by
`tfstrat.runtime.apply`), and warns once when it is too late; `tfstrat launch` sets it in the environment of every task it starts
(`task_env`).

Environment:
    TFSTRAT_CPU_ALLOCATOR: "bfc" (the default) or "default" to leave TensorFlow's allocator
        alone. A `TF_CPU_ALLOCATOR_USE_BFC` already in the environment always wins.
    TF_CPU_ALLOCATOR_USE_BFC: TensorFlow's own switch; tfstrat sets it to "true".
    TF_CPU_BFC_MEM_LIMIT_IN_MB: TensorFlow's cap on the BFC CPU allocator's memory, in MB.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

from tfstrat.errors import UsageError
from tfstrat.runtime import quiet

logger = logging.getLogger("tfstrat")

SWITCH = "TFSTRAT_CPU_ALLOCATOR"
ALLOCATOR = "TF_CPU_ALLOCATOR_USE_BFC"
_OFF = ("default", "tensorflow", "off", "0", "false", "no")
_ON = ("bfc", "", "on", "1", "true", "yes")

# What this process's `configure` did: "set" (tfstrat set the variable), "launcher"
# (`tfstrat launch` set it for this task), "too-late" (TensorFlow had its devices), or None.
_state: str | None = None
_announced = False


def _choice(env: Mapping[str, str]) -> str:
    value = env.get(SWITCH, "bfc").strip().lower()
    if value in _OFF:
        return "default"
    if value in _ON:
        return "bfc"
    raise UsageError(
        f"Received: {SWITCH}={env.get(SWITCH)!r}. Use 'bfc' (TensorFlow's BFC CPU allocator, "
        "tfstrat's default) or 'default' (TensorFlow's own choice)."
    )


def task_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` for a task that `tfstrat launch` starts, with tfstrat's process settings added.

    The user's own `TF_CPU_ALLOCATOR_USE_BFC` is kept; one that tfstrat set in this process
    (`configure`) is dropped when the task asks for `TFSTRAT_CPU_ALLOCATOR=default`.

    Args:
        env: the task's environment so far.

    Returns:
        A new dict: `env` plus `TF_CPU_ALLOCATOR_USE_BFC=true` and `TFSTRAT_CPU_ALLOCATOR=bfc`
        (which tells the task that tfstrat made the choice), unless turned off.
    """
    out = dict(env)
    ours = _state == "set" and out.get(ALLOCATOR) == os.environ.get(ALLOCATOR)
    if _choice(out) == "default":
        if ours:
            out.pop(ALLOCATOR, None)
        return out
    if ALLOCATOR not in out or ours:
        out[ALLOCATOR] = "true"
        out[SWITCH] = "bfc"
    return out


def _tensorflow_has_devices() -> bool:
    """Whether TensorFlow created its devices (and so chose its CPU allocator) already."""
    context = sys.modules.get("tensorflow.python.eager.context")  # never imports TensorFlow
    ctx = getattr(context, "context_safe", lambda: None)()
    return bool(ctx is not None and getattr(ctx, "_initialized", False))


def configure() -> None:
    """Sets `TF_CPU_ALLOCATOR_USE_BFC=true` in this process if TensorFlow can still read it.

    Called when a strategy is created (`tfstrat.runtime.apply`). Does nothing when the
    variable is already set (by the user, or by `tfstrat launch`) or
    `TFSTRAT_CPU_ALLOCATOR=default`; warns once when TensorFlow has already created its
    devices. Also hides TensorFlow's Python warnings that say nothing (`quiet.install`;
    `TFSTRAT_VERBOSE=1` keeps them).
    """
    global _state
    quiet.install()
    if _state is not None:
        return
    try:
        choice = _choice(os.environ)
    except ValueError as e:  # say it, and keep TensorFlow's allocator
        logger.warning("tfstrat: %s Keeping TensorFlow's CPU allocator.", e)
        return
    if choice == "default":
        return
    if ALLOCATOR in os.environ:
        # tfstrat launch marks the tasks it set it for; anything else is the user's choice.
        if os.environ.get(SWITCH, "").strip().lower() == "bfc":
            _state = "launcher" if os.environ[ALLOCATOR].lower() == "true" else None
        return
    if _tensorflow_has_devices():
        _state = "too-late"
        logger.warning(
            "tfstrat: TensorFlow created its CPU devices before the first tfstrat strategy, so "
            "its CPU allocator stays the default one, with which steps under a strategy run up "
            "to 2x slower on CPU. Set %s=true in the environment before Python starts (or "
            "create the strategy before any TensorFlow op); %s=default silences this warning.",
            ALLOCATOR,
            SWITCH,
        )
        return
    os.environ[ALLOCATOR] = "true"
    _state = "set"


def announce() -> None:
    """Logs once per process what `configure` set (`tfstrat.runtime.apply` calls it)."""
    global _announced
    if _announced or _state not in ("set", "launcher"):
        return
    _announced = True
    by = "tfstrat's strategy" if _state == "set" else "tfstrat launch"
    logger.info(
        "tfstrat: TensorFlow's BFC CPU allocator (%s=true, set by %s; %s=default turns it off)",
        ALLOCATOR,
        by,
        SWITCH,
    )
