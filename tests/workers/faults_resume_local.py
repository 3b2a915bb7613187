"""One process, no cluster: the parts of an exact resume that need no peers.

Usage: python faults_resume_local.py OUT
Writes OUT/results.json with what each scenario saw; tests/test_faults_resume.py checks it.
    order     shuffle=True: each epoch's order (3 epochs), the order of a fit started at epoch
              1, and of one that skips epoch 1's first batch
    between   the writer dies after the weights of epoch 2's backup, before its metadata
    sigterm   a stop with model._tfstrat_stop = "sigterm" after batch 1 of epoch 1
    damaged   double_checkpoint=True; the latest weights truncated / a variable's bytes
              overwritten / truncated with no previous backup
    stale     temporaries of dead writers and of a live other process in the backup directory
Every resumed run is compared with an uninterrupted one (Adam, `shuffle=True`).
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np

out = sys.argv[1]
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfstrat.keras import _shuffle  # noqa: E402
from tfstrat.keras import callbacks as tfcallbacks  # noqa: E402

x = np.arange(10, dtype="float32")[:, None]
y = (x[:, 0] % 3).astype("float32")
results = {}


def model(record=None):
    keras.utils.set_random_seed(1)
    m = keras.Sequential([keras.Input((1,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    m.compile(keras.optimizers.Adam(0.05), "mse", run_eagerly=record is not None)
    if record is not None:
        step = m.train_step

        def train_step(data):
            record.append(data[0].numpy()[:, 0].astype(int).tolist())
            return step(data)

        m.train_step = train_step
    return m


def fit(m, callbacks=(), **kw):
    seen = []

    class Seen(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            seen.append([epoch, 0])

        def on_train_batch_end(self, batch, logs=None):
            seen[-1][1] += 1

    m.fit(x, y, batch_size=4, epochs=3, verbose=0, callbacks=[Seen(), *callbacks], **kw)
    return seen


def same(a, b) -> bool:
    return all(np.array_equal(u, v) for u, v in zip(a.get_weights(), b.get_weights()))


reference = model()
fit(reference, [tfcallbacks.BackupAndRestore(os.path.join(out, "reference"))])

# -- order ---------------------------------------------------------------------------------
batches = []
fit(model(batches), [tfcallbacks.BackupAndRestore(os.path.join(out, "order"))])
again = []
fit(model(again), initial_epoch=1)
skipped = []


class Skip(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        _shuffle.skip_batches(1, 1)


fit(model(skipped), [Skip()], initial_epoch=1)
results["order"] = {"epochs": batches, "from_epoch_1": again, "skipping_1": skipped}


# -- between -------------------------------------------------------------------------------
class Dies(Exception):
    pass


class DiesBeforeMetadata(tfcallbacks.BackupAndRestore):
    def _write_metadata(self, metadata):
        if metadata["epoch"] == 2:
            raise Dies()
        super()._write_metadata(metadata)


backup = os.path.join(out, "between")
try:
    fit(model(), [DiesBeforeMetadata(backup)])
except Dies:
    pass
with open(os.path.join(backup, "training_metadata.json")) as f:
    stale_metadata = json.load(f)["epoch"]
m = model()
seen = fit(m, [tfcallbacks.BackupAndRestore(backup)])
results["between"] = {"metadata_epoch": stale_metadata, "seen": seen, "same": same(m, reference)}


# -- sigterm -------------------------------------------------------------------------------
class Sigterm(keras.callbacks.Callback):
    """What a tfstrat strategy does on SIGTERM, before the step's on_train_batch_end."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == (1, 1):
            self.model._tfstrat_stop = "sigterm"
            self.model.stop_training = True


backup = os.path.join(out, "sigterm")
stopped = model()
first = fit(stopped, [Sigterm(), tfcallbacks.BackupAndRestore(backup)])
kept = os.path.exists(backup)
with open(os.path.join(backup, "training_metadata.json")) as f:
    metadata = json.load(f)
m = model()
seen = fit(m, [tfcallbacks.BackupAndRestore(backup)])
results["sigterm"] = {
    "first": first,
    "metadata": {k: metadata[k] for k in ("epoch", "batch", "batches_done")},
    "seen": seen,
    "iterations": int(m.optimizer.iterations.numpy()),
    "same": same(m, reference),
    "kept": kept,
    "removed_after_resume": not os.path.exists(backup),
}

# -- damaged -------------------------------------------------------------------------------
backup = os.path.join(out, "damaged")
fit(
    model(), [tfcallbacks.BackupAndRestore(backup, double_checkpoint=True, delete_checkpoint=False)]
)
results["damaged"] = {"files": sorted(os.listdir(backup))}
latest = "latest.weights.h5"


def resume_from(directory, damage):
    path = os.path.join(directory, latest)
    if damage == "truncated":
        os.truncate(path, os.path.getsize(path) // 2)
    else:  # a variable's bytes overwritten: the file still opens and loads, wrong
        import h5py

        with h5py.File(path, "r") as f:
            data = f["layers/dense/vars/0"].id
            offset, size = data.get_offset(), data.get_storage_size()
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(b"\x5a" * size)
    m = model()
    try:
        keep = tfcallbacks.BackupAndRestore(
            directory, double_checkpoint=True, delete_checkpoint=False
        )
        seen = fit(m, [keep])
    except ValueError as e:
        return {"error": str(e)}
    return {"seen": seen, "same": same(m, reference), "files": sorted(os.listdir(directory))}


for damage in ("truncated", "overwritten"):
    copy = os.path.join(out, f"damaged-{damage}")
    shutil.copytree(backup, copy)
    results["damaged"][damage] = resume_from(copy, damage)
copy = os.path.join(out, "damaged-alone")
shutil.copytree(backup, copy)
for name in os.listdir(copy):
    if name.endswith(".bkp"):
        os.remove(os.path.join(copy, name))
results["damaged"]["alone"] = resume_from(copy, "truncated")

# -- stale ---------------------------------------------------------------------------------
backup = os.path.join(out, "stale")
os.makedirs(backup)
dead = subprocess.Popen(["true"])
dead.wait()
live = subprocess.Popen(["sleep", "60"])
names = {
    "dead": f".tmp-{dead.pid}-latest.weights.h5",
    "mine": f".tmp-{os.getpid()}-training_metadata.json",
    "live": f".tmp-{live.pid}-latest.weights.h5",
}
for name in names.values():
    open(os.path.join(backup, name), "w").close()
fit(model(), [tfcallbacks.BackupAndRestore(backup, delete_checkpoint=False)])
left = set(os.listdir(backup))
live.kill()
results["stale"] = {key: name in left for key, name in names.items()}
results["stale"]["files"] = sorted(left)

with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(results, f)
print("done", tf.__version__)
