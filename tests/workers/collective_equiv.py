"""One worker of a CollectiveAllReduce cluster test (run by `tfstrat launch`), or the reference.

Usage: python collective_equiv.py OUT_DIR [--reference] [--global-batch B] [--examples N]
       [--devices D]

Trains the shared model with SGD+momentum and with Adam on the same global batches, evaluates
and predicts, and writes OUT_DIR/<task>.npz (weights, iterations, evaluate logs, predictions).
With --reference it runs the same thing on one device (sparse gradients densified).
"""

import argparse
import json
import os

import numpy as np

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--reference", action="store_true")
parser.add_argument("--global-batch", type=int, default=24)
parser.add_argument("--examples", type=int, default=24 * 21)
parser.add_argument("--clip", default=None, help="KIND=VALUE, e.g. global_clipnorm=0.1")
parser.add_argument("--communication", default="auto", help="CollectiveAllReduce's")
parser.add_argument("--devices", type=int, default=0, help="logical CPUs (replicas) per worker")
args = parser.parse_args()

import tfstrat  # noqa: E402

# Created before any other TensorFlow op: collectives are configured at program start.
if args.devices and not args.reference:
    tfstrat.split_cpu(args.devices)
strategy = (
    None
    if args.reference
    else tfstrat.CollectiveAllReduce(
        timeout=60, communication=args.communication, devices=args.devices or None
    )
)
# Every exchange of the TCP ring: the size summed (-1: none) and the blocks gathered
# (wrapped before any step is traced, which captures it).
ring_sizes, ring_gathers = [], []
ring = strategy.extended._cross_device_ops.ring if strategy else None
if ring is not None:
    ring_exchange = ring.exchange

    def counted(reduce, gathers):
        ring_sizes.append(-1 if reduce is None else reduce.size)
        ring_gathers.append(len(gathers))
        return ring_exchange(reduce, gathers)

    ring.exchange = counted

import graphs  # noqa: E402
import tensorflow as tf  # noqa: E402
from common import build_model, compile_model, data, optimizer  # noqa: E402

scope = (strategy or tf.distribute.get_strategy()).scope
x, y = data(args.examples)
results = {}
for name in ("sgdm", "adam"):
    kw = {}
    if args.clip:
        kind, value = args.clip.split("=")
        kw[kind] = float(value)
    with scope():
        model = compile_model(build_model(), optimizer(name, densify=args.reference, **kw))
    history = model.fit(
        x,
        y,
        batch_size=args.global_batch,
        epochs=2,
        shuffle=False,
        verbose=0,
        validation_data=(x[:48], y[:48]),
    )
    results[f"{name}/val_loss"] = np.array(history.history["val_loss"])
    if not args.reference:  # the traced step: its collectives and its gradient ops' devices
        results[f"{name}/graph"] = np.array(json.dumps(graphs.summary(model)))
    for i, w in enumerate(model.weights):
        results[f"{name}/w{i}"] = w.numpy()
    results[f"{name}/iterations"] = np.array(model.optimizer.iterations.numpy())
    results[f"{name}/loss"] = np.array(history.history["loss"])
    results[f"{name}/evaluate"] = np.array(
        model.evaluate(x, y, batch_size=args.global_batch, verbose=0)
    )
    results[f"{name}/predict"] = model.predict(x, batch_size=args.global_batch, verbose=0)

# A tf.data input with steps_per_epoch, and steps_per_execution > 1 (Keras runs the steps in a
# while loop, where stock collectives fail to get their instance keys).
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.global_batch).repeat()
with scope():
    model = compile_model(
        build_model(), optimizer("sgdm", densify=args.reference), steps_per_execution=3
    )
model.fit(dataset, steps_per_epoch=6, epochs=2, verbose=0)
for i, w in enumerate(model.weights):
    results[f"dataset/w{i}"] = w.numpy()
results["dataset/iterations"] = np.array(model.optimizer.iterations.numpy())

# Which examples did a shuffled epoch see? Row i of a 1-wide embedding indexed by example id
# moves by the same step each time example i is in a batch (loss = mean output, plain SGD).
ids = np.arange(240, dtype="int32")
with scope():
    import keras

    probe = keras.Sequential([keras.Input((1,), dtype="int32"), keras.layers.Embedding(240, 1)])
    probe.layers[0].embeddings.assign(np.zeros((240, 1), "float32"))
    probe.compile(
        optimizer=keras.optimizers.SGD(1.0), loss=lambda y, p: keras.ops.reshape(p, (-1,))
    )
probe.fit(ids[:, None], np.zeros(240, "float32"), batch_size=24, epochs=1, shuffle=True, verbose=0)
results["shuffle/times_seen"] = -probe.layers[0].embeddings.numpy()[:, 0] * 24  # up to a constant

results["ring/sizes"] = np.array(ring_sizes, np.int64)
results["ring/gathers"] = np.array(ring_gathers, np.int64)
results["dense_params"] = np.array(
    sum(w.numpy().size for w in build_model().weights if "embedding" not in w.path)
)
task = os.environ.get("TFSTRAT_TASK", "reference").replace(":", "_")
np.savez(os.path.join(args.out, f"{task}.npz"), **results)
print("wrote", task, "evaluate", {k: v.tolist() for k, v in results.items() if "evaluate" in k})
