"""LocalSGD on 2 workers (run by `tfstrat launch`), or the plain-Keras side of its checks.

Usage:
    python localsgd_run.py OUT [--only a,b,...]   a worker: runs the scenarios in order, each
                                                  under its own strategy, and writes
                                                  OUT/<task>.json and OUT/<task>.npz
    python localsgd_run.py OUT --plain            no tfstrat: single-device reference of
                                                  "sync1", and the chief's "sync8" checkpoint
                                                  loaded into a plain Keras model
                                                  -> OUT/plain.npz

Scenarios:
    sync1   sync_every=1, plain SGD: synchronous SGD, against one device on the global batch
    sync8   sync_every=8, BatchNormalization, steps_per_execution=3, 20 steps an epoch: both
            workers end identical; the chief saves OUT/sync8.weights.h5
    bytes   bytes per step on the ring's sockets at sync_every 1, 4, 16 and under
            CollectiveAllReduce
    digits  scikit-learn digits: CollectiveAllReduce, then DiLoCo (outer Nesterov), same
            examples seen; test accuracy of each
    resume  DiLoCo with sync_slots: 4 epochs straight, and 2 + a BackupAndRestore resume to 4
    diloco2 DiLoCo (outer Nesterov), sync_every=3, SGD momentum: both workers' weights, against
            the algorithm written out (--plain: two plain Keras models on the workers'
            halves of every global batch, averaged and stepped by the outer rule in NumPy)
"""

import argparse
import json
import os
import time

import numpy as np

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--plain", action="store_true")
parser.add_argument("--only", default="sync1,sync8,bytes,digits,resume,diloco2")
args = parser.parse_args()
wanted = args.only.split(",")

GLOBAL_BATCH = 24
DIGITS_EPOCHS, DIGITS_BATCH, DIGITS_SYNC = 8, 64, 8
DILOCO2_SYNC, DILOCO2_STEPS = 3, 10  # 10 steps an epoch: syncs after 3, 6, 9 and at the end

if not args.plain:
    import tfstrat

    first = tfstrat.LocalSGD(sync_every=1, timeout=60)  # before any other TensorFlow op

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from common import build_model, compile_model, data, diloco_outer_step, optimizer  # noqa: E402


def build_bn():
    """build_model's layers with a BatchNormalization (moving statistics to average)."""
    from common import CLASSES, SEQ, VOCAB

    keras.utils.set_random_seed(7)
    inputs = keras.Input((SEQ,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, 8)(inputs)
    x = keras.layers.Conv1D(8, 3)(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Activation("relu")(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(16, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(CLASSES)(x))


def build_mlp(inputs=64, hidden=64, classes=10, seed=3):
    keras.utils.set_random_seed(seed)
    x_in = keras.Input((inputs,))
    x = keras.layers.Dense(hidden, activation="relu")(x_in)
    return keras.Model(x_in, keras.layers.Dense(classes)(x))


def digits():
    from common import digits as load

    x, y = load()
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order].astype("int64")
    return (x[:1504], y[:1504]), (x[1504:], y[1504:])


if args.plain:
    out = {}
    if "sync1" in wanted:
        x, y = data(GLOBAL_BATCH * 20)
        model = compile_model(build_model(), optimizer("sgd", densify=True))
        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
        for i, w in enumerate(model.trainable_weights):
            out[f"sync1/w{i}"] = w.numpy()
    if "diloco2" in wanted:  # worker i steps on rows [i * 12, i * 12 + 12) of each batch
        x, y = data(GLOBAL_BATCH * DILOCO2_STEPS, seed=4)
        half = GLOBAL_BATCH // 2
        workers = [compile_model(build_model(), optimizer("sgdm", densify=True)) for _ in "ab"]
        anchor = [w.numpy() for w in workers[0].trainable_weights]
        outer_m = [np.zeros_like(a) for a in anchor]
        since = 0
        for _epoch in range(2):
            for step in range(DILOCO2_STEPS):
                for i, m in enumerate(workers):
                    lo = step * GLOBAL_BATCH + i * half
                    m.train_on_batch(x[lo : lo + half], y[lo : lo + half])
                since += 1
                if since < DILOCO2_SYNC and step < DILOCO2_STEPS - 1:
                    continue
                since = 0
                mean = [(a.numpy() + b.numpy()) / np.float32(2)
                        for a, b in zip(*(m.trainable_weights for m in workers), strict=True)]  # fmt: skip
                anchor = diloco_outer_step(anchor, outer_m, mean)
                for m in workers:
                    for w, a in zip(m.trainable_weights, anchor, strict=True):
                        w.assign(a)
        for i, a in enumerate(anchor):
            out[f"diloco2/w{i}"] = a
    if "sync8" in wanted:
        model = build_bn()
        model.load_weights(os.path.join(args.out, "sync8.weights.h5"))
        for i, w in enumerate(model.weights):
            out[f"sync8/w{i}"] = w.numpy()
    np.savez(os.path.join(args.out, "plain.npz"), **out)
    raise SystemExit(0)

from tfstrat.keras.callbacks import BackupAndRestore  # noqa: E402
from tfstrat.runtime.traffic import tcp_bytes  # noqa: E402

task = os.environ["TFSTRAT_TASK"].replace(":", "_")
report, arrays = {"seconds": {}}, {}
clock = [time.monotonic()]


def lap(name):
    now = time.monotonic()
    report["seconds"][name] = round(now - clock[0], 1)
    clock[0] = now


def strategy_for(**kw):
    """A new strategy per scenario (the process's cluster and ring are reused)."""
    return tfstrat.LocalSGD(timeout=60, **kw)


if "sync1" in wanted:
    x, y = data(GLOBAL_BATCH * 20)
    with first.scope():
        model = compile_model(build_model(), optimizer("sgd"))
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    for i, w in enumerate(model.trainable_weights):
        arrays[f"sync1/w{i}"] = w.numpy()
    report["sync1"] = {"iterations": int(model.optimizer.iterations.numpy())}

lap("sync1")
if "sync8" in wanted:
    strategy = strategy_for(sync_every=8)
    x, y = data(GLOBAL_BATCH * 20, seed=1)
    with strategy.scope():
        model = compile_model(build_bn(), optimizer("sgdm"), steps_per_execution=3)
    ring = strategy.extended._cross_device_ops.ring
    calls = ring.calls
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    report["sync8"] = {
        "iterations": int(model.optimizer.iterations.numpy()),
        "state": strategy.sync_state(model),
        "ring_calls": ring.calls - calls,
        "loss": history.history["loss"],
    }
    for i, w in enumerate(model.weights):
        arrays[f"sync8/w{i}"] = w.numpy()
    if strategy.extended.should_checkpoint:
        model.save_weights(os.path.join(args.out, "sync8.weights.h5"))

lap("sync8")
if "bytes" in wanted:
    x = np.random.default_rng(2).random((GLOBAL_BATCH * 32, 256), dtype=np.float32)
    y = (x[:, 0] * 10).astype("int64") % 10
    sent = {}
    for every in (1, 4, 16, "collective"):
        if every == "collective":
            strategy = tfstrat.CollectiveAllReduce(timeout=60)
        else:
            strategy = strategy_for(sync_every=every)
        with strategy.scope():
            model = build_mlp(inputs=256, hidden=256)
            model.compile(optimizer=keras.optimizers.SGD(0.01), loss=keras.losses.
                          SparseCategoricalCrossentropy(from_logits=True))  # fmt: skip
        model.fit(
            x[: GLOBAL_BATCH * 16],
            y[: GLOBAL_BATCH * 16],
            batch_size=GLOBAL_BATCH,
            shuffle=False,
            verbose=0,
        )  # fmt: skip  (traces; ends synced)
        # Only the ring's two sockets (to the next worker's listener, from the previous
        # worker's): the coordination service's heartbeats and gRPC run beside them.
        ring = strategy.extended._cross_device_ops.ring
        ports = {ring._next.getpeername()[1], ring._prev.getpeername()[1]}
        before = sum(tcp_bytes(ports))
        model.fit(x, y, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
        sent[str(every)] = (sum(tcp_bytes(ports)) - before) / 32
    report["bytes"] = {
        "per_step": sent,
        "params": int(sum(np.prod(w.shape) for w in model.trainable_weights)),
    }

lap("bytes")
if "digits" in wanted:
    (x, y), (xt, yt) = digits()
    accuracy = {}
    for name in ("collective", "diloco"):
        if name == "collective":
            strategy = tfstrat.CollectiveAllReduce(timeout=60)
        else:
            strategy = strategy_for(sync_every=DIGITS_SYNC, outer_optimizer="diloco")
        with strategy.scope():
            model = build_mlp()
            model.compile(
                optimizer=keras.optimizers.Adam(0.01),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        model.fit(x, y, batch_size=DIGITS_BATCH, epochs=DIGITS_EPOCHS, shuffle=False, verbose=0)
        logits = model(tf.constant(xt), training=False).numpy()
        accuracy[name] = float((logits.argmax(1) == yt).mean())
        if name == "diloco":
            accuracy["state"] = strategy.sync_state(model)
    report["digits"] = accuracy

lap("digits")
if "resume" in wanted:
    strategy = strategy_for(sync_every=4, outer_optimizer="diloco", sync_slots=True)
    x, y = data(GLOBAL_BATCH * 10, seed=3)
    backup = os.path.join(args.out, "backup")

    def fresh():
        with strategy.scope():
            return compile_model(build_bn(), optimizer("sgdm"))

    def state(model):
        return [v.numpy() for v in model.weights] + [v.numpy() for v in model.optimizer.variables]

    straight = fresh()
    straight.fit(x, y, batch_size=GLOBAL_BATCH, epochs=4, shuffle=False, verbose=0)
    epochs = []

    class Epochs(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            epochs.append(epoch)

    for total in (2, 4):
        resumed = fresh()
        callbacks = [BackupAndRestore(backup, delete_checkpoint=False), Epochs()]
        resumed.fit(x, y, batch_size=GLOBAL_BATCH, epochs=total, shuffle=False, verbose=0,
                    callbacks=callbacks)  # fmt: skip
    a, b = state(straight), state(resumed)
    report["resume"] = {
        "epochs": epochs,
        "variables": len(a),
        "max_diff": max(float(np.abs(p - q).max()) if p.size else 0.0 for p, q in zip(a, b)),
        "state": strategy.sync_state(resumed),
    }

lap("resume")
if "diloco2" in wanted:
    strategy = strategy_for(sync_every=DILOCO2_SYNC, outer_optimizer="diloco")
    x, y = data(GLOBAL_BATCH * DILOCO2_STEPS, seed=4)
    with strategy.scope():
        model = compile_model(build_model(), optimizer("sgdm"))
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    for i, w in enumerate(model.trainable_weights):
        arrays[f"diloco2/w{i}"] = w.numpy()
    report["diloco2"] = strategy.sync_state(model)

lap("diloco2")
np.savez(os.path.join(args.out, f"{task}.npz"), **arrays)
with open(os.path.join(args.out, f"{task}.json"), "w") as f:
    json.dump(report, f, indent=1)
print("localsgd_run: done", flush=True)
