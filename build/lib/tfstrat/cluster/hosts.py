"""Host lists as SLURM, Horovod hostfiles and people write them, and the checks every address passes.

Errors are `TFConfigError`s whose message names the value and the fix. TensorFlow-free.
"""

from __future__ import annotations

import itertools
import logging
import math
import re
from collections.abc import Mapping

from tfstrat.cluster.ports import is_ipv6, join
from tfstrat.errors import TFConfigError

logger = logging.getLogger(__name__)

_HOST_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_DIGITS_RE = re.compile(r"[0-9]{1,9}")  # bounded: int() of a 5000-digit string raises ValueError
# Bounds SLURM and hostfile expansion: `node[1-999999999]` must fail fast, not exhaust memory.
MAX_TASKS = 100_000


def show(value: object, limit: int = 80) -> str:
    """`repr(value)`, shortened so that an error message stays one readable line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def to_int(
    name: str, value: object, low: int | None = 0, high: int | None = None, why: str = ""
) -> int:
    """An int, or a string of ASCII digits (Kubeflow and shells write indices as text)."""
    if isinstance(value, str) and _DIGITS_RE.fullmatch(value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TFConfigError(f"Received: {name}={show(value)}. Use an int or a digit string.")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"{'' if low is None else low}..{'' if high is None else high}"
        raise TFConfigError(f"Received: {name}={value}. Use a value in {bounds}{why}.")
    return value


def check_address(where: str, address: object) -> None:
    host, sep, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if host.startswith("[") and host.endswith("]"):
        good_host = is_ipv6(host[1:-1])
    else:
        good_host = _HOST_RE.fullmatch(host) is not None
    if not sep or not good_host or not re.fullmatch(r"[0-9]{1,5}", port):
        raise TFConfigError(
            f"Received: {where}={show(address)}. An address is a 'host:port' string with a "
            "non-empty host (IPv6 in brackets, '[::1]:2222'); write it like 'worker-0:2222'."
        )
    if not 1 <= int(port) <= 65535:
        raise TFConfigError(
            f"Received: {where}={address!r}. Port {int(port)} is out of range; use 1..65535."
        )


def slurm_var(environ: Mapping[str, str], *names: str) -> tuple[str, str]:
    """(name, value) of the first of `names` set in `environ`."""
    for name in names:
        value = environ.get(name) if isinstance(environ, Mapping) else None
        if isinstance(value, str) and value:
            return name, value
    raise TFConfigError(
        f"Received: {' / '.join(names)} unset or empty. Run inside a SLURM allocation (srun), "
        "or build the TFConfig with from_hosts."
    )


def expand_nodelist(name: str, text: str) -> list[str]:
    """`node[01-03,07],b3` -> node01 node02 node03 node07 b3 (SLURM's hostlist syntax)."""
    where = f"{name}={show(text)}"
    bad = TFConfigError(
        f"Received: {where}. Write it like 'node[01-03,07],b3', with at most {MAX_TASKS} hosts."
    )
    # Commas inside brackets separate ranges, outside them hosts; anything unmatched (empty
    # items, an unclosed bracket) makes the items no longer join back into the text.
    items = re.findall(r"(?:[^,\[]|\[[^\]]*\])+", text)
    if ",".join(items) != text:
        raise bad
    hosts: list[str] = []
    for item in items:
        # re.split alternates literal text (even positions) and bracket contents (odd).
        parts = re.split(r"\[([^\]]*)\]", item)
        choices = [[p] if i % 2 == 0 else _expand_ranges(p, where) for i, p in enumerate(parts)]
        if not item or math.prod(map(len, choices)) + len(hosts) > MAX_TASKS:
            raise bad
        hosts += ["".join(combo) for combo in itertools.product(*choices)]
    return hosts


def _expand_ranges(ranges: str, where: str) -> list[str]:
    """`01-03,07` -> 01 02 03 07; zero padding follows the low end, as in SLURM."""
    names: list[str] = []
    for part in ranges.split(","):
        match = re.fullmatch(r"([0-9]{1,9})(?:-([0-9]{1,9}))?", part)
        low, high = (int(match[1]), int(match[2] or match[1])) if match else (1, 0)
        if low > high or high - low + len(names) >= MAX_TASKS:
            raise TFConfigError(
                f"Received: {where} with range {show(ranges, 30)}. Write "
                "ranges like [01-03,07] (low <= high, no steps)."
            )
        names += [str(n).zfill(len(match[1])) for n in range(low, high + 1)]
    return names


def slurm_tasks_per_node(environ: Mapping[str, str], num_hosts: int) -> list[int]:
    """`2(x3),1` -> [2, 2, 2, 1]: one task count per host."""
    names = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if not any(environ.get(name) for name in names):
        logger.info("SLURM tasks per node unset; assuming 1 task on each of %d nodes.", num_hosts)
        return [1] * num_hosts
    name, text = slurm_var(environ, *names)
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"([0-9]{1,5})(?:\(x([0-9]{1,6})\))?", part)
        count, repeat = (int(match[1]), int(match[2] or 1)) if match else (0, 0)
        if count < 1 or repeat < 1 or len(counts) + repeat > num_hosts:
            counts = []  # reported below; num_hosts >= 1, so [] never matches it
            break
        counts += [count] * repeat
    if len(counts) != num_hosts:
        raise TFConfigError(
            f"Received: {name}={show(text)} for {num_hosts} nodes. Write it like "
            "'2(x3),1', with one count >= 1 per node of the nodelist."
        )
    return counts


def parse_hostfile_line(line: str, where: str, port: int) -> tuple[str, int]:
    """`host slots=N` -> (host, N); bare `host` -> (host, 1); comment or blank -> ('', 0)."""
    fields = line.split("#", 1)[0].split()
    slots = 1 if fields else 0
    for option in fields[1:]:
        match = re.fullmatch(r"slots=([0-9]{1,5})", option)
        slots = int(match[1]) if match else 0
        if not 1 <= slots <= 65536 - port:
            raise TFConfigError(
                f"Received: {show(option)} at {where}. Write 'host slots=N', N >= 1, with "
                f"port+N-1 <= 65535 (port={port})."
            )
    if fields:
        check_address(where, join(fields[0], port))  # names the line, not the index
    return (fields[0] if fields else ""), slots
