"""Files written atomically: a temporary sibling, flushed to disk, renamed over the final name
(`publish`), so a reader sees the previous file or the new one, never part of one. Used by
tfstrat's callbacks and by the savers of multi-worker strategies (`_saving`)."""

from __future__ import annotations

import logging
import os
import re
import shutil

logger = logging.getLogger(__name__)
_STALE = re.compile(r"^\.tmp-(\d+)-")  # temporary(path): .tmp-PID-name


def temporary(path: str) -> str:
    """A sibling of `path` that keeps its suffix (Keras checks `.keras` / `.weights.h5`)."""
    directory, name = os.path.split(path)
    return os.path.join(directory, f".tmp-{os.getpid()}-{name}")


def fsync_dir(directory: str) -> None:
    fd = os.open(directory or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: str, final: str) -> None:
    """Makes the written file `tmp` the file `final`, atomically and durably."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fsync_dir(os.path.dirname(final))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(directory: str) -> None:
    """Removes the temporaries of writers that died (or of an earlier life of this pid).

    A live other process's temporary is kept: it may be another job writing to the directory.
    """
    if not directory or not os.path.isdir(directory):
        return
    for name in os.listdir(directory):
        match = _STALE.match(name)
        if not match:
            continue
        pid = int(match.group(1))
        if pid != os.getpid() and _alive(pid):
            continue
        path = os.path.join(directory, name)
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else unlink(path)
        logger.info("tfstrat: removed %s, left by a writer that died (pid %d)", path, pid)


def unlink(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
