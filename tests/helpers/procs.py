"""Finding the tests' own processes by what they were started with (Linux /proc)."""

from __future__ import annotations

import os
from collections.abc import Iterable


def find(env: Iterable[str] = (), arg: str | None = None, program: str | None = None) -> list[int]:
    """Pids of the processes whose environment holds every "K=V" of `env`, whose command line
    has `arg` as one of its words (if given) and whose program contains `program` (if given);
    this process excluded."""
    wanted = [e.encode() for e in env]
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            with open(f"/proc/{name}/cmdline", "rb") as f:
                words = f.read().split(b"\0")
        except OSError:
            continue
        if not all(e in environ for e in wanted):
            continue
        if arg is not None and arg.encode() not in words:
            continue
        if program is not None and program.encode() not in words[0]:
            continue
        found.append(int(name))
    return found
