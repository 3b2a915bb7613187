"""Stopping together under CollectiveAllReduce / Hybrid / ParameterServer: one worker asks,
every worker stops (ParameterServer async: that worker stops).

Usage (under TF_CONFIG, 2 workers; 1 ps for ps-*): python faults_stop.py OUT_DIR CASES [STRATEGY]
CASES: comma-separated, each one fit of a fresh model, in order:
  nan        worker 1's slice of batch 5 holds a NaN: keras's TerminateOnNaN stops worker 1
  batch      a callback on worker 1 alone sets stop_training after batch 7
  epoch      a callback on worker 0 alone sets stop_training at the end of epoch 1
  sigterm    worker 1 sends itself SIGTERM after batch 6 (BackupAndRestore in the callbacks)
STRATEGY: car (default), hybrid, ps-sync or ps-async (ParameterServer's modes).
Each worker writes OUT_DIR/<case>_<i>.json: the optimizer's iterations, the epochs begun,
and why it stopped.
"""

import json
import os
import signal
import sys

import tfstrat

out_dir, cases = sys.argv[1], sys.argv[2].split(",")
kind = sys.argv[3] if len(sys.argv) > 3 else "car"
if kind.startswith("ps-"):
    strategy = tfstrat.ParameterServer(mode=kind[3:], timeout=30)
else:
    strategy = (tfstrat.Hybrid if kind == "hybrid" else tfstrat.CollectiveAllReduce)(timeout=30)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfstrat.keras.callbacks import BackupAndRestore  # noqa: E402

me = strategy.worker_index
rng = np.random.default_rng(0)
GLOBAL = 16
x = rng.normal(size=(GLOBAL * 20, 6)).astype("float32")
y = (x[:, 0] > 0).astype("int64")
nan_x = x.copy()
nan_x[GLOBAL * 5 + GLOBAL // 2 :][:2] = np.nan  # batch 5, rows of worker 1's half only
case, epochs_begun = None, []


class Record(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        epochs_begun.append(epoch)

    def on_train_batch_end(self, batch, logs=None):
        if case == "batch" and me == 1 and batch == 7:
            self.model.stop_training = True
        if case == "sigterm" and me == 1 and batch == 6 and not epochs_begun[-1]:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_epoch_end(self, epoch, logs=None):
        if case == "epoch" and me == 0 and epoch == 1:
            self.model.stop_training = True


def write(stopped_by):
    with open(os.path.join(out_dir, f"{case}_{me}.json"), "w") as f:
        json.dump(
            {
                "iterations": int(model.optimizer.iterations.numpy()),
                "epochs": epochs_begun,
                "stop": stopped_by,
            },
            f,
        )


class WriteAtEnd(keras.callbacks.Callback):
    def on_train_end(self, logs=None):  # runs before the SIGTERM exit (143)
        write(getattr(self.model, "_tfstrat_stop", None))


for case in cases:
    epochs_begun = []
    with strategy.scope():
        # tanh, not relu: oneDNN's fused MatMul + ReLU (on by default on AVX-512 CPUs) turns a
        # NaN into 0, and the NaN case needs a NaN loss.
        model = keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)]
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    callbacks = [Record(), keras.callbacks.TerminateOnNaN(), WriteAtEnd()]
    if case == "sigterm":
        callbacks.insert(0, BackupAndRestore(os.path.join(out_dir, "backup")))
    inputs = nan_x if case == "nan" else x
    model.fit(inputs, y, batch_size=GLOBAL, epochs=3, shuffle=False, verbose=0, callbacks=callbacks)
    print(f"worker {me} finished fit ({case})", flush=True)
