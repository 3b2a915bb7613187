"""Global batches the replicas cannot split evenly, against single-device training.

Usage:
    python uneven_equiv.py OUT mirrored     one process: the single-device reference
                                            (OUT/reference.npz), then MirroredNCCL over 2, 3
                                            and 4 logical CPUs (OUT/mirrored_<N>.npz)
    python uneven_equiv.py OUT reference    the reference only
    python uneven_equiv.py OUT collective   a CollectiveAllReduce worker (`tfstrat launch`)
    python uneven_equiv.py OUT hybrid       a Hybrid worker (`tfstrat launch --ps 1`)
    [--batches 25,30,31]

For each global batch it trains two models for one epoch on 92 examples (so it ends
with a partial batch: 17, 2 and 30 rows; 2 rows over 3 or 4 replicas leaves some empty):
"sgdm" (SGD with momentum, plain loss) and "adam" (Adam, per-example sample_weight and an L2
regularizer). It records the weights, every step's logs (loss, accuracy), and evaluate.
"""

import argparse
import os

import numpy as np

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("mode", choices=["reference", "mirrored", "collective", "hybrid"])
parser.add_argument("--batches", default="25,30,31")
args = parser.parse_args()
BATCHES = [int(b) for b in args.batches.split(",")]
EXAMPLES, EPOCHS = 92, 1

import tfstrat  # noqa: E402

# Created before any other TensorFlow op (collectives are configured at program start; the
# CPU is split before the runtime starts).
if args.mode == "collective":
    cluster_strategy = tfstrat.CollectiveAllReduce(timeout=60)
elif args.mode == "hybrid":
    cluster_strategy = tfstrat.Hybrid(timeout=60)
else:
    tfstrat.split_cpu(4)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from common import CLASSES, SEQ, VOCAB, data, optimizer  # noqa: E402

x, y = data(EXAMPLES)
sample_weight = np.random.default_rng(1).uniform(0.2, 2.0, EXAMPLES).astype("float32")


def build(regularized: bool):
    keras.utils.set_random_seed(7)
    inputs = keras.Input((SEQ,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 8)(inputs)
    h = keras.layers.Conv1D(8, 3, activation="relu")(h)
    h = keras.layers.Flatten()(h)
    reg = keras.regularizers.L2(1e-2) if regularized else None
    h = keras.layers.Dense(16, activation="relu", kernel_regularizer=reg)(h)
    return keras.Model(inputs, keras.layers.Dense(CLASSES)(h))


class StepLogs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.rows = []

    def on_train_batch_end(self, batch, logs=None):
        self.rows.append([float(logs["loss"]), float(logs["accuracy"])])


def train(strategy, reference: bool) -> dict:
    results = {}
    for batch in BATCHES:
        for name in ("sgdm", "adam"):
            weighted = name == "adam"
            with (strategy or tf.distribute.get_strategy()).scope():
                model = build(regularized=weighted)
                model.compile(
                    optimizer=optimizer(name, densify=reference),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=["accuracy"],
                )
            steps = StepLogs()
            model.fit(
                x,
                y,
                sample_weight=sample_weight if weighted else None,
                batch_size=batch,
                epochs=EPOCHS,
                shuffle=False,
                verbose=0,
                callbacks=[steps],
            )
            key = f"{batch}/{name}"
            for i, w in enumerate(model.weights):
                results[f"{key}/w{i}"] = w.numpy()
            results[f"{key}/steps"] = np.array(steps.rows)
            results[f"{key}/iterations"] = np.array(int(model.optimizer.iterations.numpy()))
            results[f"{key}/evaluate"] = np.array(model.evaluate(x, y, batch_size=batch, verbose=0))
    return results


if args.mode in ("reference", "mirrored"):
    np.savez(os.path.join(args.out, "reference.npz"), **train(None, reference=True))
if args.mode == "mirrored":
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    for n in (2, 3, 4):
        strategy = tfstrat.MirroredNCCL(devices=devices[:n], timeout=60)
        np.savez(os.path.join(args.out, f"mirrored_{n}.npz"), **train(strategy, reference=False))
        print("done mirrored", n, flush=True)
elif args.mode != "reference":
    task = os.environ["TFSTRAT_TASK"].replace(":", "_")
    np.savez(os.path.join(args.out, f"{task}.npz"), **train(cluster_strategy, reference=False))
    print("done", task, flush=True)
