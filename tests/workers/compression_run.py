"""Trains a small model under `compression=METHOD` and records what test_compression checks.

    python compression_run.py OUT METHOD STRATEGY   (METHOD: fp16, bf16, powersgd,
                                                     powersgd-warmup;
                                                     STRATEGY: collective, hybrid)

The model: y = x W + b + E[id] (Dense(32) on 256 features plus an Embedding(1000, 32) row), MSE,
SGD(0.1), global batch 16, 8 steps. W is the compressed matrix (PowerSGD rank 2), b a vector
(rounded by fp16/bf16, exact under PowerSGD), E's gradient is sparse (gathered exactly, or on
the ps under Hybrid). Writes OUT/worker_I.npz: every step's weights (w{S}_kernel, _bias, _table
after step S; w-1_*: the initial ones), each compressed exchange's "raw" (this worker's gradients
before compression) and "reduced" (their sum after), each step's logged loss, the ring's bytes
per step. powersgd compresses from the first step (warmup_steps=0), powersgd-warmup after 3
exact ones (warmup_steps=3).

Under CollectiveAllReduce with PowerSGD, a second model of the same shapes then trains 2 steps
in the same strategy (its own PowerSGD state: a fresh start and its own warm-up): "second_raw"
and "second_reduced". Under powersgd-warmup its optimizer starts at step 2, as one restored
from a backup does: the warm-up counts the optimizer's steps, so only its first step is exact.
"""

import json
import os
import sys

import tfstrat

out, method, kind = sys.argv[1], sys.argv[2], sys.argv[3]
WARMUP = {"powersgd": 0, "powersgd-warmup": 3}
if method in WARMUP:
    compression = tfstrat.PowerSGD(rank=2, warmup_steps=WARMUP[method])
else:
    compression = method
if kind == "hybrid":
    strategy = tfstrat.Hybrid(compression=compression, partitions=1, timeout=60)
else:
    strategy = tfstrat.CollectiveAllReduce(compression=compression, timeout=60)

import keras  # noqa: E402
import numpy as np  # noqa: E402

rng = np.random.default_rng(0)
N, FEATURES, UNITS, VOCAB = 128, 256, 32, 1000
x = rng.normal(size=(N, FEATURES)).astype("float32")
ids = rng.integers(0, VOCAB, size=(N,)).astype("int32")
y = rng.normal(size=(N, UNITS)).astype("float32")

ops = strategy.extended._cross_device_ops
ops.trace = []


def build():
    keras.utils.set_random_seed(1)
    with strategy.scope():
        xi, ii = keras.Input((FEATURES,)), keras.Input((), dtype="int32")
        dense = keras.layers.Dense(UNITS, name="dense")(xi)
        row = keras.layers.Embedding(VOCAB, UNITS, name="table")(ii)
        model = keras.Model([xi, ii], keras.layers.Add()([dense, row]))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


model = build()


def named(step):  # {w{step}_kernel: ..., ...}; under Hybrid the table is read from the ps
    dense, table = model.get_layer("dense"), model.get_layer("table")
    kernel, bias = dense.get_weights()
    return {
        f"w{step}_kernel": kernel,
        f"w{step}_bias": bias,
        f"w{step}_table": np.asarray(table.embeddings.numpy()),
    }


weights = named(-1)
losses = []


class Record(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        step = len(losses)
        losses.append(float(logs["loss"]))
        weights.update(named(step))


ring = ops.ring
start = ring.bytes_sent
model.fit(
    [x, ids], y, batch_size=16, epochs=1, steps_per_epoch=8, shuffle=False, verbose=0,
    callbacks=[Record()],
)  # fmt: skip
per_step = (ring.bytes_sent - start) / 8
first = list(ops.trace)
second = {}
if kind == "collective" and method in WARMUP:
    ops.trace = []
    again = build()
    if WARMUP[method]:  # as if restored from a backup after 2 steps: the warm-up counts those
        again.optimizer.iterations.assign(2)
    again.fit([x, ids], y, batch_size=16, epochs=1, steps_per_epoch=2, shuffle=False, verbose=0)
    second = {
        "second_raw": np.stack([t["raw"] for t in ops.trace]),
        "second_reduced": np.stack([t["reduced"] for t in ops.trace]),
    }
rank = strategy.extended._id_in_cluster
np.savez(
    os.path.join(out, f"worker_{rank}.npz"),
    x=x,
    ids=ids,
    y=y,
    losses=np.array(losses),
    raw=np.stack([t["raw"] for t in first]),
    reduced=np.stack([t["reduced"] for t in first]),
    **weights,
    **second,
)
with open(os.path.join(out, f"worker_{rank}.json"), "w") as f:
    json.dump({"bytes_per_step": per_step}, f)
