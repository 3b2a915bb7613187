"""One task of a multihost test (a worker started by hand in its own network namespace), or the
single-device reference.

Usage:
    python multihost_train.py OUT --reference
        one device, no tfstrat: writes OUT/reference.npz (every model below, sparse gradients
        densified) and OUT/<model>.init.weights.h5 (the initial weights the workers load)
    python multihost_train.py OUT --model collective|ps|hybrid [--communication C]
        a worker of the cluster in TF_CONFIG: writes OUT/<task>.npz (its final weights, in the
        stock model's layout: a table as one array)

Small on purpose (the tier must be fast): a few steps at global batch 24, SGD with momentum for
CollectiveAllReduce, Adagrad (its accumulator on the ps) for ParameterServer and Hybrid.
"""

import argparse
import json
import os

import numpy as np

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--reference", action="store_true")
parser.add_argument("--model", choices=("collective", "ps", "hybrid"), default="collective")
parser.add_argument("--communication", default="auto", help="CollectiveAllReduce's")
parser.add_argument("--global-batch", type=int, default=24)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--timeout", type=float, default=60, help="the strategy's")
args = parser.parse_args()

import tfstrat  # noqa: E402

strategy = None
if not args.reference:
    if args.model == "collective":
        # Created before any other TensorFlow op: collectives are configured at program start.
        strategy = tfstrat.CollectiveAllReduce(
            timeout=args.timeout, communication=args.communication
        )
    elif args.model == "ps":
        strategy = tfstrat.ParameterServer(partitions=1, timeout=args.timeout)
    else:
        strategy = tfstrat.Hybrid(partitions=1, timeout=args.timeout)

import keras  # noqa: E402
from common import CLASSES, SEQ, VOCAB, build_model, compile_model, data, optimizer  # noqa: E402

from tfstrat.keras.layers import Embedding  # noqa: E402


def build_table_model(stock: bool):
    """A tfstrat Embedding (held by the ps under ParameterServer and Hybrid) and a dense head."""
    keras.utils.set_random_seed(7)
    inputs = keras.Input((SEQ,), dtype="int32")
    layer = keras.layers.Embedding if stock else Embedding
    x = layer(VOCAB, 8, name="table")(inputs)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(16, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(CLASSES)(x))


def stock_weights(model) -> list[np.ndarray]:
    """Trainable weights in the stock model's layout: a tfstrat table as one array, no anchor."""
    out = []
    for layer in model.layers:
        if isinstance(layer, keras.layers.Embedding):
            out.append(np.asarray(layer.embeddings))
        else:
            out += [w.numpy() for w in layer.trainable_weights]
    return out


def build(name: str, stock: bool):
    return build_model() if name == "collective" else build_table_model(stock)


# Hybrid updates ps-held tables row by row: SGD without momentum, Adagrad or Adam only.
OPTIMIZER = {"collective": "sgdm", "ps": "adagrad", "hybrid": "adagrad"}


x, y = data(args.global_batch * args.steps)
if args.reference:
    arrays = {}
    for name in ("collective", "ps", "hybrid"):
        model = compile_model(build(name, stock=True), optimizer(OPTIMIZER[name], densify=True))
        model.save_weights(os.path.join(args.out, f"{name}.init.weights.h5"))
        model.fit(x, y, batch_size=args.global_batch, epochs=1, shuffle=False, verbose=0)
        for i, w in enumerate(stock_weights(model)):
            arrays[f"{name}/w{i}"] = w
    np.savez(os.path.join(args.out, "reference.npz"), **arrays)
    print("wrote reference")
    raise SystemExit(0)

config = json.loads(os.environ["TF_CONFIG"])
task = f"{config['task']['type']}_{config['task']['index']}"
with strategy.scope():
    model = compile_model(build(args.model, stock=False), optimizer(OPTIMIZER[args.model]))
if args.model != "collective":
    # The reference's initial weights (a ps-held table is not drawn as the stock layer draws it).
    model.load_weights(os.path.join(args.out, f"{args.model}.init.weights.h5"))
history = model.fit(x, y, batch_size=args.global_batch, epochs=1, shuffle=False, verbose=0)
arrays = {f"w{i}": w for i, w in enumerate(stock_weights(model))}
arrays["iterations"] = np.array(int(model.optimizer.iterations.numpy()))
arrays["loss"] = np.array(history.history["loss"])
np.savez(os.path.join(args.out, f"{task}.npz"), **arrays)
print("wrote", task, "loss", history.history["loss"], flush=True)
