"""Chief-aware Keras 3 callbacks: only the chief writes to your paths.

Keras 3's ModelCheckpoint, BackupAndRestore and TensorBoard know nothing of chief and worker:
under a multi-worker strategy every worker would write the same files. Every worker must still
run the save (reading some variables is a collective), so the others write to a scratch
directory that is removed when training ends. Files the chief writes appear atomically: written
under a temporary name in the same directory, then renamed.

Drop-in replacements, same arguments:

    from tfstrat.keras.callbacks import BackupAndRestore, ModelCheckpoint, TensorBoard
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

import keras

logger = logging.getLogger(__name__)


def _is_chief(model) -> bool:
    strategy = getattr(model, "distribute_strategy", None)
    return strategy is None or bool(strategy.extended.should_checkpoint)


def _temporary(path: str) -> str:
    """A sibling of `path` that keeps its suffix (Keras checks `.keras` / `.weights.h5`)."""
    directory, name = os.path.split(path)
    return os.path.join(directory, f".tmp-{os.getpid()}-{name}")


class _Scratch:
    """A per-process scratch directory for the files of a non-chief worker."""

    def __init__(self):
        self.path = None

    def get(self) -> str:
        if self.path is None:
            self.path = tempfile.mkdtemp(prefix="tfstrat-worker-")
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
        self._scratch = _Scratch()
        self._final = None

    def _get_file_path(self, epoch, batch, logs):
        final = super()._get_file_path(epoch, batch, logs)
        if not _is_chief(self.model):
            final = os.path.join(self._scratch.get(), os.path.basename(final))
        self._final = final
        return _temporary(final)

    def _save_model(self, epoch, batch, logs):
        self._final = None
        super()._save_model(epoch, batch, logs)
        if self._final and os.path.exists(_temporary(self._final)):
            os.replace(_temporary(self._final), self._final)

    def on_train_end(self, logs=None):
        super().on_train_end(logs)
        self._scratch.remove()


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """`keras.callbacks.BackupAndRestore` for multi-worker training.

    The chief writes the backup to `backup_dir` (atomically); every worker restores from it on
    restart, so all workers resume at the same epoch with the same weights.
    """

    def __init__(self, backup_dir, *args, **kwargs):
        super().__init__(backup_dir, *args, **kwargs)
        self._scratch = _Scratch()

    def _save_model(self):
        paths = (self.backup_dir, self._weights_path, self._training_metadata_path)
        if not _is_chief(self.model):
            scratch = self._scratch.get()
            self.backup_dir = scratch
            self._weights_path = os.path.join(scratch, os.path.basename(paths[1]))
            self._training_metadata_path = os.path.join(scratch, os.path.basename(paths[2]))
        final = self._weights_path
        self._weights_path = _temporary(final)
        try:
            super()._save_model()
            os.replace(self._weights_path, final)
        finally:
            self.backup_dir, self._weights_path, self._training_metadata_path = paths

    def on_train_end(self, logs=None):
        if _is_chief(self.model):
            super().on_train_end(logs)
        self._scratch.remove()


class TensorBoard(keras.callbacks.TensorBoard):
    """`keras.callbacks.TensorBoard` whose logs only the chief writes to `log_dir`."""

    def set_model(self, model):
        if not _is_chief(model):
            if not hasattr(self, "_scratch"):
                self._scratch = _Scratch()
            self.log_dir = self._scratch.get()
            self._log_write_dir = self.log_dir
            self._train_dir = os.path.join(self.log_dir, "train")
            self._val_dir = os.path.join(self.log_dir, "validation")
        super().set_model(model)

    def on_train_end(self, logs=None):
        super().on_train_end(logs)
        if hasattr(self, "_scratch"):
            self._scratch.remove()
