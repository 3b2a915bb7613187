"""`model.save` / `save_weights` called on every worker of a multi-worker strategy.

Keras 3.15's savers know nothing of workers: under a multi-worker strategy every worker writes
the same file at once, and a later `load_model` may read a torn zip (`BadZipFile`); stock
`keras.callbacks.ModelCheckpoint` on a shared path races the same way. Every worker must still
run the save, because reading some variables is a collective (Keras's metric variables are
on-read synchronised: their value is an all-reduce), so tfstrat wraps Keras's two savers. The
rule: **when the workers' k-th saves name the same absolute path, only the chief writes it;
otherwise each worker writes its own file.**

- the chief (worker 0, or the chief task) writes the file under a temporary name in the same
  directory, flushes it to disk and renames it over the final name (`_atomic.publish`): a
  reader sees the previous file or the new one, never part of one; it then hands in its outcome and the path it wrote (TensorFlow's coordination service; under
  `ParameterServer`, ps 0) and goes on. The chief never waits: code that saves on the chief
  only works as before.
- another worker saves into a private temporary directory and waits for the chief's outcome
  of the same save (its k-th save, whatever the path). Same path: its own copy is dropped,
  and when `save` returns the chief's file is in place, so `load_model` of it reads what was
  just saved (on a file system they share). Another path (Keras's multi-worker guide has
  non-chief workers save to temporary directories of their own): its copy is published at
  its own path, atomically. A chief that failed to write the shared path makes the others
  raise, naming it; a chief that never saves makes them fail after the strategy's `timeout`,
  naming it.

Saves into a directory (`zipped=False`) and sharded weights (`max_shard_size`) are several
files: the chief writes them in place (not atomically), another worker moves its copies to its
own path when the paths differ. A model outside any multi-worker strategy saves as Keras does.

The strategies take part through a small interface (`Coordinated`), so this module knows no
strategy: a multi-worker tfstrat strategy has `num_workers`, `worker_index`, `tf_config`,
`timeout`, and publishes and reads the chief's outcome of a save by key.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import tempfile
import threading
from typing import Protocol, runtime_checkable

from tfstrat._compat import patches
from tfstrat.cluster import TFConfig
from tfstrat.keras._atomic import publish, temporary, unlink

logger = logging.getLogger(__name__)


@runtime_checkable
class Coordinated(Protocol):
    """What a multi-worker strategy gives the savers (CollectiveAllReduce and its kinds through
    TensorFlow's coordination service, ParameterServer through ps 0)."""

    num_workers: int
    worker_index: int
    tf_config: TFConfig
    timeout: float

    def _tfstrat_publish(self, key: str, outcome: dict) -> None:
        """The chief hands in `outcome` (JSON-able) under `key`; never waits."""

    def _tfstrat_read_chief(self, key: str, names: list[str]) -> dict:
        """The chief's outcome under `key`, waiting up to `timeout` seconds (names: the
        tasks by worker index, for the error)."""


_installed = _stock = False
_saves: dict[str, int] = {}  # this worker's saves: its k-th save waits for the chief's k-th


def install() -> None:
    """Wraps Keras's `save_model` and `save_weights` (idempotent; no effect without a
    multi-worker tfstrat strategy)."""
    global _installed
    import keras

    from tfstrat._compat.keras import saving_api

    if _stock or (_installed and patches.is_patched(saving_api, "save_model")):
        return  # (after `patches.remove_all()` it installs again)

    why = "multi-worker saves: the chief writes a shared path, atomically"
    for name in ("save_model", "save_weights"):
        original = getattr(saving_api, name)
        wrapped = functools.wraps(original)(functools.partial(_save, original, name))
        patches.patch(saving_api, name, wrapped, why)  # model.save / save_weights call these
    patches.patch(keras.saving, "save_model", saving_api.save_model, why)
    patches.patch(keras.models, "save_model", saving_api.save_model, why)
    _installed = True


def uninstall() -> None:
    """Keras's own savers from now on, whatever strategies come (tests measure their race)."""
    global _installed, _stock
    _stock = True
    import keras

    from tfstrat._compat.keras import saving_api

    for owner, name in (
        (saving_api, "save_model"),
        (saving_api, "save_weights"),
        (keras.saving, "save_model"),
        (keras.models, "save_model"),
    ):
        patches.remove(owner, name)
    _installed = False


def _multi_worker(model):
    """The model's tfstrat strategy when it has several workers, else None."""
    strategy = getattr(model, "_distribute_strategy", None)
    if strategy is None or not hasattr(strategy, "num_workers") or strategy.num_workers < 2:
        return None
    return strategy if isinstance(strategy, Coordinated) else None


_own = threading.local()


@contextlib.contextmanager
def as_keras_does():
    """Saves inside run as Keras's own: tfstrat's callbacks already write atomically, on the
    chief only, each worker to its own path (a non-chief's path would never match the
    chief's, so waiting for the chief's matching save would wait forever)."""
    _own.depth = getattr(_own, "depth", 0) + 1
    try:
        yield
    finally:
        _own.depth -= 1


def _save(original, kind, model, filepath, overwrite=True, *args, **kwargs):
    strategy = None if getattr(_own, "depth", 0) else _multi_worker(model)
    if strategy is None:
        return original(model, filepath, overwrite, *args, **kwargs)
    final = os.fspath(filepath)
    # save_model(..., zipped) / save_weights(..., max_shard_size): the argument after overwrite.
    extra = args[0] if args else kwargs.get("zipped" if kind == "save_model" else "max_shard_size")
    several = extra is False if kind == "save_model" else extra is not None
    if not strategy.extended.should_checkpoint:
        return _save_elsewhere(strategy, original, model, final, overwrite, several, args, kwargs)
    error = None
    try:
        if several or final.startswith("hf://"):
            original(model, filepath, overwrite, *args, **kwargs)
        else:
            _save_atomically(original, model, final, overwrite, args, kwargs)
    except Exception as e:  # handed in below first: the others must not wait for it
        error = e
    _synchronise(strategy, final, error)
    if error is not None:
        raise error


def _save_atomically(original, model, final, overwrite, args, kwargs):
    _refuse_overwrite(final, overwrite)
    tmp = temporary(final)
    try:
        original(model, tmp, True, *args, **kwargs)
        publish(tmp, final)
    finally:
        unlink(tmp)


def _refuse_overwrite(final: str, overwrite: bool) -> None:
    if not overwrite and os.path.exists(final):
        raise FileExistsError(
            f"Received: filepath={final!r} with overwrite=False, and it exists. Workers of a "
            "multi-worker strategy cannot be asked interactively: pass overwrite=True or "
            "another path."
        )


def _save_elsewhere(strategy, original, model, final, overwrite, several, args, kwargs):
    """A non-chief's save: the same reads (some are collectives) into a private directory;
    then its copy is dropped (the chief wrote the same path) or published at its own path."""
    scratch = tempfile.mkdtemp(prefix="tfstrat-save-")
    error = None
    try:
        try:
            original(model, os.path.join(scratch, os.path.basename(final)), True, *args, **kwargs)
        except Exception as e:  # the chief's outcome is still awaited: saves stay paired
            error = e
        shared = _synchronise(strategy, final, error)
        if error is not None:
            raise error
        if not shared:
            _refuse_overwrite(final, overwrite)
            _move_out(scratch, final, several)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _move_out(scratch: str, final: str, several: bool) -> None:
    """The files saved in `scratch` at `final` (one file: atomically)."""
    if not several:
        tmp = temporary(final)
        try:
            shutil.copyfile(os.path.join(scratch, os.path.basename(final)), tmp)
            publish(tmp, final)
        finally:
            unlink(tmp)
        return
    where = os.path.dirname(os.path.abspath(final))
    for name in os.listdir(scratch):  # a directory (zipped=False) or a weights file's shards
        target = os.path.join(where, name)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)
        shutil.move(os.path.join(scratch, name), target)


def _task_names(strategy: Coordinated) -> list[str]:
    """Task names by worker index (the chief task first, as TensorFlow ranks them)."""
    tf_config = strategy.tf_config
    return [tf_config.trainer_name(w) for w in range(tf_config.num_workers)]


def _synchronise(strategy, final: str, error: BaseException | None) -> bool:
    """One-sided: the chief hands in its outcome and path and goes on; another worker waits
    for the chief's outcome of the same save (its k-th save) and returns whether the chief
    wrote the same absolute path (raising if it failed to). The chief never waits, so code
    that saves on the chief only keeps working."""
    path = os.path.abspath(final)
    # Matched by count, not path: Keras's multi-worker guide has non-chiefs save to paths of
    # their own (a temporary directory each), at the same points as the chief.
    _saves["all"] = count = _saves.get("all", 0) + 1
    names = _task_names(strategy)
    me = names[strategy.worker_index]
    key = f"tfstrat-save-{count}"
    if strategy.worker_index == 0:
        outcome = {"error": None if error is None else repr(error), "path": path}
        strategy._tfstrat_publish(key, outcome)
        return True
    try:
        chief = strategy._tfstrat_read_chief(key, names)
    except Exception as e:
        raise RuntimeError(
            f"tfstrat: {me} saving {final}: {names[0]} did not finish its save number {count} "
            f"within {strategy.timeout:g} s ({e}). Only {names[0]} "
            "writes a path every worker names; when other workers save too, each must save "
            "as often as the chief, at the same points (to any path)."
        ) from e
    shared = chief.get("path") == path
    if shared and error is None and chief["error"] is not None:
        raise RuntimeError(
            f"tfstrat: {me}: {names[0]} failed to save {path} ({chief['error']}); "
            "its log has the traceback."
        )
    return shared
