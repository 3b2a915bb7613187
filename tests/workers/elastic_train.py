"""One task of the elastic tests, under `tfstrat launch --nodes ... --restarts K --backup-dir D`.

Usage: python elastic_train.py OUT collective|hybrid [--reference]

--reference: the same training on one device, no strategy, no backups (one process): what an
uninterrupted run on the three nodes must end at (the strategies equal one device).

CollectiveAllReduce (SGD with momentum) or Hybrid (Adagrad; the table on the ps), 3 epochs of
8 steps at global batch 12 (divisible by 3 and 2 workers), with
`tfstrat.keras.callbacks.BackupAndRestore(save_freq=2)` in TFSTRAT_BACKUP_DIR. Every step
sleeps 0.25 s, so a test can stop a node in the middle of an epoch. The chief prints a line per
step (`elastic: epoch E batch B restart R workers W at T`) and at the end writes OUT/final.npz:
the final weights, a ps-held table read whole.
"""

import contextlib
import os
import sys
import time

out, kind = sys.argv[1], sys.argv[2]
reference = "--reference" in sys.argv[3:]

import tfstrat  # noqa: E402

if reference:
    strategy = None
elif kind == "collective":
    strategy = tfstrat.CollectiveAllReduce(timeout=30)
else:
    strategy = tfstrat.Hybrid(partitions=1, timeout=30)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from common import CLASSES, SEQ, VOCAB, build_model, compile_model, data, optimizer  # noqa: E402

from tfstrat.keras.callbacks import BackupAndRestore  # noqa: E402
from tfstrat.keras.layers import Embedding  # noqa: E402

EPOCHS, STEPS, BATCH = 3, 8, 12
RESTART = os.environ.get("TFSTRAT_RESTART", "0")
chief = reference or strategy.worker_index == 0


def build():
    if kind == "collective":
        return build_model()
    keras.utils.set_random_seed(7)
    inputs = keras.Input((SEQ,), dtype="int32")
    init = keras.initializers.RandomUniform(-0.05, 0.05, seed=3)  # the ps draws it alike
    h = Embedding(VOCAB, 8, embeddings_initializer=init, name="table")(inputs)
    h = keras.layers.Dense(16, activation="relu")(keras.layers.Flatten()(h))
    return keras.Model(inputs, keras.layers.Dense(CLASSES)(h))


class Steps(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if reference:
            return
        time.sleep(0.25)
        if chief:
            print(
                f"elastic: epoch {self.epoch} batch {batch} restart {RESTART} workers "
                f"{strategy.num_workers} at {time.time():.3f}",
                flush=True,
            )


x, y = data(BATCH * STEPS)
with strategy.scope() if strategy else contextlib.nullcontext():
    model = compile_model(build(), optimizer("sgdm" if kind == "collective" else "adagrad"))
callbacks = [Steps()] + ([] if reference else [BackupAndRestore(save_freq=2)])
model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)
if chief:
    weights = []
    for layer in model.layers:
        if isinstance(layer, keras.layers.Embedding):
            weights.append(np.asarray(layer.embeddings))
        else:
            weights += [np.asarray(w) for w in layer.trainable_weights]
    tmp = os.path.join(out, "final.tmp.npz")
    np.savez(tmp, *weights, iterations=int(model.optimizer.iterations.numpy()))
    os.replace(tmp, os.path.join(out, "final.npz"))
print(f"elastic: done, restart {RESTART}", flush=True)
