"""`model.save` / `save_weights` called on every worker of a multi-worker strategy: one writer.

Keras 3.15's savers know nothing of workers: under a multi-worker strategy every worker writes
the same file at once, and a later `load_model` may read a torn zip (`BadZipFile`); stock
`keras.callbacks.ModelCheckpoint` on a shared path races the same way. Every worker must still
run the save, because reading some variables is a collective (Keras's metric variables are
on-read synchronised: their value is an all-reduce), so tfstrat wraps Keras's two savers:

- the chief (worker 0, or the chief task) writes the file under a temporary name in the same
  directory, flushes it to disk and renames it over the final name (tfstrat's callbacks'
  `_publish`): a reader sees the previous file or the new one, never part of one;
- the other workers write into a private temporary directory, removed at once: nothing visible;
- the save then is a synchronisation point: every worker hands in its outcome (one small
  all-gather over the ring or TensorFlow's collectives; under `ParameterServer`, through ps 0),
  so when `save` returns on any worker, the chief's file is in place and `load_model` of it
  reads what was just saved, on every worker (on a file system they share). A chief that
  failed makes every worker raise, naming it; a chief that never arrives makes the others
  fail after the strategy's `timeout`, naming it.

Saves into a directory (`zipped=False`) and sharded weights (`max_shard_size`) are several
files: the chief writes them in place (not atomically), the others nowhere, with the same
synchronisation. A model outside any multi-worker strategy saves as Keras does.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import tempfile

from tfstrat.keras.callbacks import _publish, _temporary, _unlink

logger = logging.getLogger(__name__)

_installed = _stock = False
_saves = [0]  # saves of this process (the same count on every worker): keys the ps exchange


def install() -> None:
    """Wraps Keras's `save_model` and `save_weights` (idempotent; no effect without a
    multi-worker tfstrat strategy)."""
    global _installed
    if _installed or _stock:
        return
    import keras
    from keras.src.saving import saving_api

    for name in ("save_model", "save_weights"):
        original = getattr(saving_api, name)
        wrapped = functools.wraps(original)(functools.partial(_save, original, name))
        setattr(saving_api, name, wrapped)  # model.save / save_weights call these
    keras.saving.save_model = keras.models.save_model = saving_api.save_model
    _installed = True


def uninstall() -> None:
    """Keras's own savers from now on, whatever strategies come (tests measure their race)."""
    global _installed, _stock
    _stock = True
    import keras
    from keras.src.saving import saving_api

    for name in ("save_model", "save_weights"):
        fn = getattr(saving_api, name)
        setattr(saving_api, name, getattr(fn, "__wrapped__", fn))
    keras.saving.save_model = keras.models.save_model = saving_api.save_model
    _installed = False


def _multi_worker(model):
    """The model's tfstrat strategy when it has several workers, else None."""
    strategy = getattr(model, "_distribute_strategy", None)
    if strategy is None or not hasattr(strategy, "num_workers") or strategy.num_workers < 2:
        return None
    from tfstrat.strategies.collective import CollectiveAllReduce
    from tfstrat.strategies.ps import ParameterServer

    return strategy if isinstance(strategy, (CollectiveAllReduce, ParameterServer)) else None


def _save(original, kind, model, filepath, overwrite=True, *args, **kwargs):
    strategy = _multi_worker(model)
    if strategy is None:
        return original(model, filepath, overwrite, *args, **kwargs)
    final = os.fspath(filepath)
    # save_model(..., zipped) / save_weights(..., max_shard_size): the argument after overwrite.
    extra = args[0] if args else kwargs.get("zipped" if kind == "save_model" else "max_shard_size")
    several = extra is False if kind == "save_model" else extra is not None
    error = None
    try:
        if not strategy.extended.should_checkpoint:
            _save_nowhere(original, model, final, overwrite, args, kwargs)
        elif several or final.startswith("hf://"):
            original(model, filepath, overwrite, *args, **kwargs)
        else:
            _save_atomically(original, model, final, overwrite, args, kwargs)
    except Exception as e:  # handed in below first: the others must not wait for it
        error = e
    _synchronise(strategy, final, error)
    if error is not None:
        raise error


def _save_atomically(original, model, final, overwrite, args, kwargs):
    if not overwrite and os.path.exists(final):
        raise FileExistsError(
            f"Received: filepath={final!r} with overwrite=False, and it exists. Workers of a "
            "multi-worker strategy cannot be asked interactively: pass overwrite=True or "
            "another path."
        )
    tmp = _temporary(final)
    try:
        original(model, tmp, True, *args, **kwargs)
        _publish(tmp, final)
    finally:
        _unlink(tmp)


def _save_nowhere(original, model, final, overwrite, args, kwargs):
    """A non-chief's save: the same reads (some are collectives) into a file nobody sees."""
    scratch = tempfile.mkdtemp(prefix="tfstrat-save-")
    try:
        original(model, os.path.join(scratch, os.path.basename(final)), True, *args, **kwargs)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _task_names(strategy) -> list[str]:
    """Task names by worker index (the chief task first, as TensorFlow ranks them)."""
    tf_config = getattr(strategy, "tf_config", None) or strategy.extended.tf_config
    names = [
        f"{job}:{i}" for job in ("chief", "worker") for i in range(len(tf_config.addresses(job)))
    ]
    names[0] += " (the chief)"
    return names


def _synchronise(strategy, final: str, error: BaseException | None) -> None:
    """Every worker hands in its outcome; raises on every worker if the chief's save failed."""
    _saves[0] += 1
    names = _task_names(strategy)
    me = names[strategy.worker_index]
    mine = {"path": os.path.abspath(final), "error": None if error is None else repr(error)}
    try:
        everyone = _exchange(strategy, mine, names)
    except Exception as e:
        raise RuntimeError(
            f"tfstrat: {me} saving {final}: waiting for the other workers failed ({e}). Every "
            f"worker saves together and {names[0]} writes the file: call model.save / "
            "save_weights (or run ModelCheckpoint) on every worker, in the same order."
        ) from e
    chief = everyone[0]
    if chief["path"] != mine["path"] and strategy.worker_index != 0:
        logger.warning(
            "tfstrat: %s saved %s while %s saved %s at the same point: only the chief writes, "
            "so %s was not written. Save to the same path on every worker.",
            me,
            final,
            names[0],
            chief["path"],
            final,
        )
    if error is None and chief["error"] is not None:
        raise RuntimeError(
            f"tfstrat: {me}: {names[0]} failed to save {chief['path']} ({chief['error']}); "
            "its log has the traceback."
        )


def _exchange(strategy, mine: dict, names: list[str]) -> list[dict]:
    """Every worker's `mine`, by worker index."""
    from tfstrat.strategies.collective import CollectiveAllReduce

    if isinstance(strategy, CollectiveAllReduce):
        payloads = strategy._all_gather_bytes(json.dumps(mine).encode())
        return [json.loads(p) for p in payloads]
    from tfstrat.ps import variables as psvars

    ext, key = strategy.extended, f"save/{_saves[0]}"
    psvars.publish(key, ext.worker, mine, strategy)
    seen = {ext.worker: mine}
    others = [w for w in range(strategy.num_workers) if w != ext.worker]
    where = f"ps:0 at {ext.tf_config.addresses('ps')[0]}"
    for w, theirs in psvars.read_published(
        key, others, ext.timeout, lambda w: names[w], where, "save outcome", strategy
    ):
        seen[w] = theirs
    return [seen[w] for w in range(strategy.num_workers)]
