"""Kill, relaunch, compare: a worker of the resume tests (run by `tfstrat launch`).

Usage: python faults_resume_run.py OUT STRATEGY PHASE OPT:STOP [OPT:STOP ...]
    STRATEGY: collective | ps | hybrid
    PHASE first: for each OPT, an uninterrupted fit (the chief saves OUT/full-OPT.weights.h5),
        then a fit with BackupAndRestore(OUT/backup/OPT) that STOP interrupts:
          crash      every worker raises after epoch 0's backup; the next OPT follows
          crash-mid  backups every 5 batches (save_freq=5); every worker raises after batch 7
                     of epoch 1 (the backup: epoch 1, 5 batches done); the next OPT follows
          sigterm    the chief sends itself SIGTERM after batch 3 of epoch 1: every worker
                     stops after batch 4, saves, exits 143 (the strategy's SIGTERM stop); last
          kill       the chief SIGKILLs itself while it writes the metadata of epoch 1's
                     backup (the weights are written, a half-written metadata temporary is
                     left); last
    PHASE resume: for each OPT, a fresh model fits with BackupAndRestore(OUT/backup/OPT) to the
        end; the chief saves OUT/resumed-OPT.weights.h5
After a resume, every worker writes OUT/resumed-<task>.json: per OPT, the (epoch, batches) it
trained.
Three epochs of 10 steps (240 examples, global batch 24), `shuffle=True`. The model's table is
a `tfstrat.keras.layers.Embedding`, or under Hybrid a plain `keras.layers.Embedding` (Hybrid
holds it on the ps either way).
"""

import json
import os
import signal
import sys

import numpy as np

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

from tfstrat.keras import _atomic  # noqa: E402
from tfstrat.keras import callbacks as tfcallbacks  # noqa: E402
from tfstrat.keras.layers import Embedding  # noqa: E402

EPOCHS, BATCH = 3, 24
task = os.environ["TFSTRAT_TASK"].replace(":", "")
chief = task == "worker0"
x, y = data(BATCH * 10)


def build(stock=False):
    keras.utils.set_random_seed(7)
    inputs = keras.Input((SEQ,), dtype="int32")
    # A seeded initializer: a ps-held table is drawn on the ps, from the initializer's seed.
    init = keras.initializers.RandomUniform(-0.05, 0.05, seed=3)
    h = (keras.layers.Embedding if stock else Embedding)(VOCAB, 8, embeddings_initializer=init)(
        inputs
    )
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


class Sigterm(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if len(seen.epochs) == 2 and batch == 3 and chief:
            os.kill(os.getpid(), signal.SIGTERM)


class Crash(keras.callbacks.Callback):
    def __init__(self, epoch, batch=None):
        super().__init__()
        self.at = (epoch, batch)

    def on_train_batch_end(self, batch, logs=None):
        if (len(seen.epochs) - 1, batch) == self.at:
            raise RuntimeError(f"crash at {self.at}")

    def on_epoch_end(self, epoch, logs=None):
        if (epoch, None) == self.at:
            raise RuntimeError(f"crash at {self.at}")


class KillWhileWritingMetadata(tfcallbacks.BackupAndRestore):
    def _write_metadata(self, metadata):
        if metadata["epoch"] == 2:
            with open(_atomic.temporary(self._training_metadata_path), "w") as f:
                f.write('{"epoch": 2, "ba')
            os.kill(os.getpid(), signal.SIGKILL)
        super()._write_metadata(metadata)


models = []  # kept alive: ParameterServer's start-up agreement remembers models by id()


def fit(name, backup, stop=None):
    global seen
    with strategy.scope():
        # Hybrid: a plain keras.layers.Embedding, whose table Hybrid holds on the ps all the same.
        model = compile_model(build(stock=kind == "hybrid"), optimizer(name))
    models.append(model)
    seen = Seen()
    backup_class, kwargs, extra = tfcallbacks.BackupAndRestore, {}, []
    if stop == "kill" and chief:
        backup_class = KillWhileWritingMetadata
    elif stop == "sigterm":
        extra = [Sigterm()]
    elif stop == "crash":
        extra = [Crash(0)]
    elif stop == "crash-mid":
        kwargs, extra = {"save_freq": 5}, [Crash(1, 7)]
    callbacks = [seen, backup_class(backup, **kwargs), *extra]
    try:
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, callbacks=callbacks)
    except RuntimeError as e:
        if not str(e).startswith("crash at"):
            raise
    return model


def save(model, name):
    path = os.path.join(out, f"{name}.weights.h5")
    if not chief:  # every worker saves (collective reads), only the chief's file is compared
        path = os.path.join(out, f"{task}-{name}.weights.h5")
    model.save_weights(path)


trained, tables = {}, {}
for name, stop in plan:
    backup = os.path.join(out, "backup", name)
    if phase == "first":
        model = fit(name, os.path.join(out, "full", name))
        save(model, f"full-{name}")
        fit(name, backup, stop)  # sigterm and kill end this process
    else:
        model = fit(name, backup)
        save(model, f"resumed-{name}")
        trained[name] = seen.epochs
        tables[name] = model.layers[1].embeddings.numpy()
# After every fit: ParameterServer names shared variables after Keras's layer names, which a
# layer made by the chief alone would shift.
for name in tables if chief else ():  # the checkpoint loads into a plain Keras model
    stock = build(stock=True)
    stock.load_weights(os.path.join(out, f"resumed-{name}.weights.h5"))
    trained[f"stock-{name}"] = float(
        np.abs(stock.layers[1].embeddings.numpy() - tables[name]).max()
    )
if phase == "resume":
    with open(os.path.join(out, f"resumed-{task}.json"), "w") as f:
        json.dump(trained, f)
print("done", flush=True)
