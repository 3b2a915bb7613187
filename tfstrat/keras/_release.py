"""Keras's dataset iterators are destroyed on threads of their own, not the training thread.

A `tf.data` iterator's resources are destroyed when the last reference to their handles goes,
and the destructor waits for the pipeline's autotuning thread, which TensorFlow 2.19-2.21 does
not wake: it sleeps out its optimization period, which doubles (up to a minute) for as long as
the pipeline lives. Keras makes a new iterator every epoch and drops the last one as the next
epoch's first batch is taken (and the last of all as `fit` returns), on the training thread.
Measured with two devices in one process (an iterator holds a pipeline per device), an epoch
then started 5, 10, 20 or 36 s late, with `tf.distribute.MirroredStrategy` as with tfstrat's
strategies: half of a short epoch's time.

`when_dropped(iterator)` gives an iterator a finalizer that holds its resource handles (the
eager tensors of dtype resource it and its nested iterators hold): when the iterator goes, the
finalizer hands them to a daemon thread of their own, which drops them once nothing else holds
them, so the wait happens there. One thread per iterator, not one queue: an iterator waiting
in a queue behind another's destructor keeps its pipeline (and its threads) alive and its
period doubling, so with epochs shorter than the waits (measured: 1.2 s epochs, two devices
per worker) the queue, the waits and the process's threads grew without end. Each thread lives
as long as one destructor (about an epoch). At exit the process waits (up to `_EXIT_WAIT_S`)
for the threads to finish, as it would have waited on the training thread: a daemon thread
still in TensorFlow's destructor while Python shuts down could abort the process. Iterators
dropped after that are destroyed where they are dropped.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
import weakref

THREAD_NAME = "tfstrat-iterator-release"
_DEPTH = 6  # DistributedIterator -> per-worker -> multi-device -> per-device iterators
_PATIENCE_S = 5.0  # how long the thread waits for the iterator's own references to go
_EXIT_WAIT_S = 60.0  # TensorFlow's longest autotuning period

_state = threading.Condition()
_pending = 0  # handed over and not yet dropped
_registered = False  # the exit wait
_closing = False  # at exit: nothing more is handed over


def handles(iterator) -> list:
    """The resource handles `iterator` holds: eager tensors of dtype resource among its
    attributes, and those of the iterators it holds (a distributed iterator's per-worker,
    multi-device and per-device ones), in lists, tuples and dicts, `_DEPTH` levels deep."""
    import tensorflow as tf

    # A loop over a stack, not a nested function calling itself: such a function is a
    # reference cycle holding `found`, so the handles would live until Python's cyclic
    # collector ran, and be destroyed there, on whichever thread it ran on (measured: stalls
    # of 1-7 s every 15-20 epochs, on the training thread or a thread it waits for).
    found: list = []
    seen: set[int] = set()
    stack = [(iterator, _DEPTH)]
    while stack:
        x, depth = stack.pop()
        if depth < 0 or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, tf.Tensor):
            if x.dtype == tf.resource and hasattr(x, "numpy"):  # eager, not a graph's
                found.append(x)
        elif isinstance(x, (list, tuple)):
            stack.extend((y, depth - 1) for y in reversed(x))
        elif isinstance(x, dict):
            stack.extend((y, depth - 1) for y in reversed(list(x.values())))
        elif "Iterator" in type(x).__name__ and hasattr(x, "__dict__"):
            stack.extend((y, depth - 1) for y in reversed(list(vars(x).values())))
    return found


def when_dropped(iterator) -> bool:
    """Arranges for `iterator`'s resources to be destroyed on a release thread when it goes
    (once: again changes nothing); False when it holds no handle or cannot be weakly
    referenced (nothing changes then)."""
    if iterator is None or getattr(iterator, "_tfstrat_release", False):
        return iterator is not None
    held = handles(iterator)
    if not held:
        return False
    try:
        weakref.finalize(iterator, _hand_over, held).atexit = False
        iterator._tfstrat_release = True
    except (TypeError, AttributeError):
        return False
    return True


def _hand_over(held: list) -> None:
    global _pending, _registered
    with _state:
        if _closing:
            return  # dropped here, as without tfstrat
        if not _registered:
            atexit.register(_finish)
            _registered = True
        _pending += 1
    # In a box the thread empties: its own arguments would hold the list until it ends.
    threading.Thread(target=_drop, args=([held],), name=THREAD_NAME, daemon=True).start()


def _finish() -> None:
    """At exit: no more handing over; wait for what was handed over to be destroyed."""
    global _closing
    with _state:
        _closing = True
        if not _state.wait_for(lambda: _pending == 0, timeout=_EXIT_WAIT_S):
            print(
                f"tfstrat: {_pending} dataset iterator(s) still being destroyed after "
                f"{_EXIT_WAIT_S:.0f} s at exit; exiting anyway",
                file=sys.stderr,
            )


def _others(held: list) -> int:
    """References to `held`'s handles besides `held`'s own (the list's slot, the loop's name
    and getrefcount's argument counted out)."""
    return max(sys.getrefcount(h) - 3 for h in held)


def _drop(box: list) -> None:
    global _pending
    held = box.pop()
    # The finalizer runs as the iterator is deallocated, before its attributes go: wait
    # (briefly) until the handles are held here alone, so the last reference is this one.
    deadline = time.monotonic() + _PATIENCE_S
    while _others(held) > 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    del held
    with _state:
        _pending -= 1
        _state.notify_all()
