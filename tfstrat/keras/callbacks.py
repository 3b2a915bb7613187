"""Chief-aware Keras 3 callbacks: only the chief writes to your paths, and nothing is lost.

Keras 3's ModelCheckpoint, BackupAndRestore and TensorBoard know nothing of chief and worker:
under a multi-worker strategy every worker would write the same files. Every worker must still
run the save (reading some variables is a collective), so the others write to a scratch
directory of their own, named after the job's path and the task (a restarted task reuses it),
and removed when training ends.

Files the chief writes appear whole and durably: written under a temporary name
(`.tmp-<pid>-<name>`) in the same directory, flushed to disk, renamed over the final name, and
the directory flushed. Temporaries that a killed writer left behind are removed when training
begins.

`BackupAndRestore` writes the weights first and `training_metadata.json` last. The weights
file names its own epoch and batch (an HDF5 attribute), so a chief killed between the two
writes resumes from a consistent pair; the metadata records a checksum of the weights that a
restore verifies. `double_checkpoint=True` keeps the previous backup as `*.bkp` and falls back
to it when the latest is damaged. A training stopped by SIGTERM (a tfstrat strategy sets
`model._tfstrat_stop = "sigterm"`) saves the state after its last step, and a relaunch resumes
at the next batch in the same order (array input; see `tfstrat.keras._shuffle`).

Drop-in replacements, same arguments:

    from tfstrat.keras.callbacks import BackupAndRestore, ModelCheckpoint, TensorBoard

`Throughput` (tfstrat.keras._throughput) puts global examples/s (and, under ParameterServer and
Hybrid with ps tasks, bytes per step to the ps) on the progress bar, in History and TensorBoard;
tfstrat strategies add one to every fit (`TFSTRAT_THROUGHPUT=0` stops that).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import uuid

import keras

from tfstrat.errors import UsageError
from tfstrat.keras import _shuffle
from tfstrat.keras._atomic import fsync_dir, publish, remove_stale, temporary, unlink
from tfstrat.keras._throughput import Throughput  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)

_STATE = "tfstrat_backup"  # HDF5 attribute of a backup's weights file: its training state


def _is_chief(model) -> bool:
    strategy = getattr(model, "distribute_strategy", None)
    return strategy is None or bool(strategy.extended.should_checkpoint)


def _task() -> str:
    """This task's name from TF_CONFIG (`worker1`), else the pid."""
    try:
        task = json.loads(os.environ.get("TF_CONFIG") or "{}").get("task", {})
        return f"{task['type']}{int(task['index'])}"
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"pid{os.getpid()}"


class _Scratch:
    """A non-chief worker's stand-in for the chief's directory `target`.

    Named after `target` and this task, so a restarted task reuses it rather than leaving
    another copy of the checkpoint behind.
    """

    def __init__(self, target: str):
        self.target = target
        self.path = None

    def get(self) -> str:
        if self.path is None:
            digest = hashlib.sha1(os.path.abspath(self.target).encode()).hexdigest()[:12]
            name = f"tfstrat-worker-{digest}-{_task()}"
            self.path = os.path.join(tempfile.gettempdir(), name)
            os.makedirs(self.path, exist_ok=True)
        return self.path

    def remove(self):
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None


class ModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """`keras.callbacks.ModelCheckpoint` that only the chief writes, atomically.

    Example:
        >>> cb = ModelCheckpoint("ckpt/epoch{epoch}.weights.h5", save_weights_only=True)
        >>> model.fit(x, y, callbacks=[cb])  # doctest: +SKIP
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._scratch = _Scratch(os.path.dirname(self.filepath) or ".")
        self._final = None

    def on_train_begin(self, logs=None):
        if _is_chief(self.model):
            remove_stale(os.path.dirname(os.path.abspath(self.filepath)))
        super().on_train_begin(logs)

    def _get_file_path(self, epoch, batch, logs):
        final = super()._get_file_path(epoch, batch, logs)
        if not _is_chief(self.model):
            final = os.path.join(self._scratch.get(), os.path.basename(final))
        self._final = final
        return temporary(final)

    def _save_model(self, epoch, batch, logs):
        from tfstrat.keras._saving import as_keras_does

        self._final = None
        with as_keras_does():  # atomic and chief-only already
            super()._save_model(epoch, batch, logs)
        if self._final and os.path.exists(temporary(self._final)):
            publish(temporary(self._final), self._final)

    def on_train_end(self, logs=None):
        super().on_train_end(logs)
        self._scratch.remove()


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            value = json.load(f)
        return value if isinstance(value, dict) else None
    except (OSError, ValueError):
        return None


def _backup_state(weights: str, metadata: str) -> dict:
    """The training state of the backup `weights`, checked against `metadata`.

    Raises:
        OSError: the file cannot be read as HDF5 (truncated, overwritten).
        ValueError: its checksum is not the one its metadata recorded, or it has no state.
    """
    import h5py

    with h5py.File(weights, "r") as f:
        raw = f.attrs.get(_STATE)
    recorded = _read_json(metadata)
    if raw is None:  # written by keras.callbacks.BackupAndRestore: the metadata has the epoch
        if recorded is None or "epoch" not in recorded:
            raise UsageError(f"no training state in it and none in {metadata}")
        return {"epoch": int(recorded["epoch"]), "batches_done": 0}
    state = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    # Metadata of another save (the chief died between the two writes) has no say.
    if recorded and recorded.get("id") == state["id"]:
        if _sha256(weights) != recorded.get("sha256"):
            raise UsageError(f"its checksum differs from the one recorded in {metadata}")
    return state


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """`keras.callbacks.BackupAndRestore` for multi-worker training that loses nothing.

    The chief writes the backup to `backup_dir` (atomically: weights first, metadata last);
    every worker restores from it on restart, so all workers resume at the same epoch with the
    same weights. Beyond Keras's callback:

    - the backup holds everything training needs to continue exactly: the model's and the
      optimizer's variables, and under `tfstrat.Hybrid` the optimizer slots of ps-held tables;
    - a training stopped by SIGTERM saves the state after its last step; a relaunch resumes at
      the next batch of that epoch, in the same order, and the backup is kept;
    - `double_checkpoint=True` keeps the previous backup (`latest.weights.h5.bkp`,
      `training_metadata.json.bkp`) and restores it when the latest is damaged;
    - a restore checks the weights against the checksum in the metadata, and a damaged backup
      with nothing to fall back to is an error that names it (Keras would train from it).

    A run resumed in the middle of an epoch draws the batches already trained from its input
    without training on them, then trains on the rest (`tfstrat.keras._shuffle`). Array
    input (NumPy) with `shuffle=True` is shuffled in an order drawn from (seed, epoch), so the
    resumed epoch replays the interrupted one's order; a `tf.data` input resumes exactly when
    it yields the same batches each time it is iterated. Exact resumes also need each epoch to
    be one pass over the data (no `steps_per_epoch` shorter than it).

    Args:
        backup_dir: the directory of the backup (the chief's; only the chief writes there).
            None: `TFSTRAT_BACKUP_DIR`, which `tfstrat launch --backup-dir DIR` sets (a
            multi-node run that restarts needs one directory every node shares).
        save_freq: "epoch", or a number of batches between backups.
        double_checkpoint: keep the previous backup to fall back to.
        delete_checkpoint: delete the backup when training ends (not when it is stopped by
            SIGTERM).

    Example:
        >>> cb = BackupAndRestore("backup", double_checkpoint=True)
        >>> model.fit(x, y, epochs=10, callbacks=[cb])  # doctest: +SKIP
    """

    def __init__(self, backup_dir=None, *args, **kwargs):
        if backup_dir is None:
            backup_dir = os.environ.get("TFSTRAT_BACKUP_DIR")
            if not backup_dir:
                raise UsageError(
                    "Received: BackupAndRestore() with no backup_dir and TFSTRAT_BACKUP_DIR "
                    "unset. Give the directory, BackupAndRestore('backup'), or launch with "
                    "`tfstrat launch --backup-dir DIR` (which sets TFSTRAT_BACKUP_DIR)."
                )
        super().__init__(backup_dir, *args, **kwargs)
        self._scratch = _Scratch(backup_dir)
        self._offset = 0  # batches of the current epoch trained before this run started
        self._resumed = None  # the epoch this run resumes in the middle of
        self._stopped = False
        _shuffle.seed_shuffles(set_global_seed=False)  # array input's order from (seed, epoch)

    # -- restoring ---------------------------------------------------------------------------

    def on_train_begin(self, logs=None):
        self._stopped, self._offset, self._resumed = False, 0, None
        self._current_epoch, self._last_batch_seen = 0, 0
        if _is_chief(self.model):
            remove_stale(self.backup_dir)
        state = self._restore()
        if state is None:
            return
        epoch, done = int(state["epoch"]), int(state["batches_done"])
        steps = (self.params or {}).get("steps")
        if done and steps and done >= steps:  # stopped after an epoch's last batch
            epoch, done = epoch + 1, 0
        self.model._initial_epoch = self._current_epoch = epoch
        logger.info("tfstrat: resuming at epoch %d, batch %d (%s)", epoch, done, self.backup_dir)
        if done:
            _shuffle.skip_batches(epoch, done)
            self._offset, self._resumed, self._last_batch_seen = done, epoch, done - 1

    def _restore(self) -> dict | None:
        """Loads the latest usable backup; returns its state, or None without one."""
        pairs = [(self._weights_path, self._training_metadata_path)]
        pairs.append((self._prev_weights_path, self._prev_training_metadata_path))
        damaged = []
        for weights, metadata in pairs:
            if not os.path.exists(weights):
                continue
            try:
                state = _backup_state(weights, metadata)
                self._load_weights(weights)
            except (OSError, ValueError, KeyError) as e:
                damaged.append(f"{weights} ({type(e).__name__}: {e})")
                logger.warning("tfstrat: backup %s is damaged: %s", weights, e)
                continue
            if damaged:
                logger.warning("tfstrat: restored the previous backup %s instead", weights)
                if _is_chief(self.model):  # else the next backup would keep it as "previous"
                    for path in pairs[0]:
                        unlink(path)
            return state
        if damaged:
            keep = (
                "(double_checkpoint=True: the previous backup is missing or damaged too)"
                if self.double_checkpoint
                else "or use BackupAndRestore(double_checkpoint=True) to keep a previous backup "
                "to fall back to"
            )
            raise UsageError(
                f"Received: a damaged backup in backup_dir={self.backup_dir!r}: "
                f"{'; '.join(damaged)}. Remove the directory to train from the start {keep}."
            )
        return None

    def _load_weights(self, path: str) -> None:
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:  # its variables must exist to load
            optimizer.build(self.model.trainable_variables)
        if path.endswith(".weights.h5"):
            return self.model.load_weights(path)
        # Keras reads weights only from a name ending in .weights.h5 (the previous backup's
        # ends in .bkp): through a link with that name, outside the chief's directory.
        directory = tempfile.mkdtemp(prefix="tfstrat-restore-")
        try:
            link = os.path.join(directory, "previous.weights.h5")
            os.symlink(os.path.abspath(path), link)
            self.model.load_weights(link)
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    # -- saving ------------------------------------------------------------------------------

    def on_epoch_begin(self, epoch, logs=None):
        self._current_epoch = epoch
        if epoch != self._resumed:
            self._offset = 0

    def on_train_batch_end(self, batch, logs=None):
        batch += self._offset
        if getattr(self.model, "_tfstrat_stop", None) == "sigterm":
            self._stopped = True
            self._last_batch_seen = batch
            self._save(self._current_epoch, batch + 1)
        elif self._should_save_on_batch(batch):
            self._save(self._current_epoch, batch + 1)

    def _end_resumed_epoch(self):
        _shuffle.cancel_skip()
        self._resumed = None

    def on_epoch_end(self, epoch, logs=None):
        self._end_resumed_epoch()
        if self._stopped:  # stopped by SIGTERM: this epoch is incomplete, its state is saved
            return
        self._current_epoch, self._last_batch_seen = epoch + 1, 0
        if self.save_freq == "epoch":
            self._save(epoch + 1, 0)

    def on_train_end(self, logs=None):
        self._end_resumed_epoch()
        # SIGTERM agreed at an epoch's end stops after that epoch's (complete) backup: keep it.
        stopped = self._stopped or getattr(self.model, "_tfstrat_stop", None) == "sigterm"
        if _is_chief(self.model) and not stopped:
            super().on_train_end(logs)
        self._scratch.remove()

    def _save(self, epoch: int, done: int) -> None:
        """Backs up the state after `done` batches of `epoch` (only the chief's is kept)."""
        from tfstrat.keras._saving import as_keras_does

        with as_keras_does():  # atomic and chief-only already
            self._save_backup(epoch, done)

    def _save_backup(self, epoch: int, done: int) -> None:
        if not _is_chief(self.model):
            self.model.save_weights(os.path.join(self._scratch.get(), "latest.weights.h5"))
            return
        os.makedirs(self.backup_dir, exist_ok=True)
        state = {"epoch": epoch, "batch": max(done - 1, 0), "batches_done": done}
        state["id"] = uuid.uuid4().hex
        tmp = temporary(self._weights_path)
        self.model.save_weights(tmp, overwrite=True)
        import h5py

        with h5py.File(tmp, "r+") as f:
            f.attrs[_STATE] = json.dumps(state)
        digest = _sha256(tmp)
        if self.double_checkpoint:
            self._keep_previous()
        publish(tmp, self._weights_path)
        self._write_metadata({**state, "sha256": digest})

    def _keep_previous(self) -> None:
        """The current backup becomes the previous one; each file is a whole backup's."""
        for path, previous in (
            (self._weights_path, self._prev_weights_path),
            (self._training_metadata_path, self._prev_training_metadata_path),
        ):
            if os.path.exists(path):
                os.replace(path, previous)
        fsync_dir(self.backup_dir)

    def _write_metadata(self, metadata: dict) -> None:
        tmp = temporary(self._training_metadata_path)
        with open(tmp, "w") as f:
            json.dump(metadata, f)
        publish(tmp, self._training_metadata_path)


class TensorBoard(keras.callbacks.TensorBoard):
    """`keras.callbacks.TensorBoard` whose logs only the chief writes to `log_dir`."""

    def set_model(self, model):
        if not _is_chief(model):
            if not hasattr(self, "_scratch"):
                self._scratch = _Scratch(self.log_dir)
            self.log_dir = self._scratch.get()
            self._log_write_dir = self.log_dir
            self._train_dir = os.path.join(self.log_dir, "train")
            self._val_dir = os.path.join(self.log_dir, "validation")
        super().set_model(model)

    def on_train_end(self, logs=None):
        super().on_train_end(logs)
        if hasattr(self, "_scratch"):
            self._scratch.remove()
