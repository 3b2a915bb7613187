"""Kill, relaunch, compare: a worker of the resume tests (run by `tfstrat launch`).

Usage: python faults_resume_run.py OUT STRATEGY PHASE OPT:STOP [OPT:STOP ...]
    STRATEGY: collective | ps | hybrid
    PHASE first: for each OPT, an uninterrupted fit (the chief saves OUT/full-OPT.weights.h5),
        then a fit with BackupAndRestore(OUT/backup/OPT) that STOP interrupts:
          sigterm  mid-epoch 1 (after batch 4), as a tfstrat strategy stops on SIGTERM:
                   model._tfstrat_stop = "sigterm" and stop_training; the next OPT follows
          crash    every worker raises after epoch 0's backup; the next OPT follows
          kill     the chief SIGKILLs itself while it writes the metadata of epoch 1's backup
                   (the weights are written, a half-written metadata temporary is left); last
    PHASE resume: for each OPT, a fresh model fits with BackupAndRestore(OUT/backup/OPT) to the
        end; the chief saves OUT/resumed-OPT.weights.h5
Every worker writes OUT/<PHASE>-<task>.json: per OPT, the (epoch, batches) it trained.
Three epochs of 10 steps (240 examples, global batch 24), `shuffle=True`.
"""

import json
import os
import signal
import sys

out, kind, phase = sys.argv[1], sys.argv[2], sys.argv[3]
plan = [item.split(":") for item in sys.argv[4:]]

import tfstrat  # noqa: E402

if kind == "collective":
    strategy = tfstrat.CollectiveAllReduce(timeout=60)
elif kind == "ps":
    strategy = tfstrat.ParameterServer(timeout=60)
else:
    strategy = tfstrat.Hybrid(partitions=2, timeout=60)

import keras  # noqa: E402
from common import CLASSES, SEQ, VOCAB, compile_model, data, optimizer  # noqa: E402

from tfstrat.keras import callbacks as tfcallbacks  # noqa: E402
from tfstrat.keras.layers import Embedding  # noqa: E402

EPOCHS, BATCH = 3, 24
task = os.environ["TFSTRAT_TASK"].replace(":", "")
chief = task == "worker0"
x, y = data(BATCH * 10)


def build():
    keras.utils.set_random_seed(7)
    inputs = keras.Input((SEQ,), dtype="int32")
    # A seeded initializer: a ps-held table is drawn on the ps, from the initializer's seed.
    init = keras.initializers.RandomUniform(-0.05, 0.05, seed=3)
    h = Embedding(VOCAB, 8, embeddings_initializer=init)(inputs)
    h = keras.layers.Conv1D(8, 3, activation="relu")(h)
    h = keras.layers.Dense(16, activation="relu")(keras.layers.Flatten()(h))
    return keras.Model(inputs, keras.layers.Dense(CLASSES)(h))


class Seen(keras.callbacks.Callback):
    """The batches each epoch trained."""

    def __init__(self):
        super().__init__()
        self.epochs = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs.append([epoch, 0])

    def on_train_batch_end(self, batch, logs=None):
        self.epochs[-1][1] += 1


class SigtermStop(keras.callbacks.Callback):
    """What a tfstrat strategy does on SIGTERM, before the step's on_train_batch_end."""

    def on_train_batch_end(self, batch, logs=None):
        if self.params and len(seen.epochs) == 2 and batch == 4:
            self.model._tfstrat_stop = "sigterm"
            self.model.stop_training = True


class Crash(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        raise RuntimeError("crash after the backup of epoch 0")


class KillWhileWritingMetadata(tfcallbacks.BackupAndRestore):
    def _write_metadata(self, metadata):
        if metadata["epoch"] == 2:
            with open(tfcallbacks._temporary(self._training_metadata_path), "w") as f:
                f.write('{"epoch": 2, "ba')
            os.kill(os.getpid(), signal.SIGKILL)
        super()._write_metadata(metadata)


def fit(name, backup, extra=(), backup_class=tfcallbacks.BackupAndRestore):
    global seen
    with strategy.scope():
        model = compile_model(build(), optimizer(name))
    seen = Seen()
    stops = [c for c in extra if isinstance(c, SigtermStop)]
    after = [c for c in extra if not isinstance(c, SigtermStop)]
    callbacks = [seen, *stops, backup_class(backup), *after]
    try:
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, callbacks=callbacks)
    except RuntimeError as e:
        if "crash after the backup" not in str(e):
            raise
    return model


def save(model, name):
    path = os.path.join(out, f"{name}.weights.h5")
    if not chief:  # every worker saves (collective reads), only the chief's file is compared
        path = os.path.join(out, f"{task}-{name}.weights.h5")
    model.save_weights(path)


trained = {}
for name, stop in plan:
    backup = os.path.join(out, "backup", name)
    if phase == "first":
        model = fit(name, os.path.join(out, "full", name))
        save(model, f"full-{name}")
        trained[f"full-{name}"] = seen.epochs
        if stop == "kill" and chief:
            fit(name, backup, backup_class=KillWhileWritingMetadata)
        else:
            fit(name, backup, [{"sigterm": SigtermStop, "crash": Crash, "kill": Seen}[stop]()])
        trained[name] = seen.epochs
    else:
        model = fit(name, backup)
        save(model, f"resumed-{name}")
        trained[name] = seen.epochs
with open(os.path.join(out, f"{phase}-{task}.json"), "w") as f:
    json.dump(trained, f)
print("done", flush=True)
