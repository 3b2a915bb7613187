"""One task of a ParameterServer cluster test (run by `tfstrat launch`), or the reference.

Usage:
    python ps_equiv.py OUT [--partitions K] [--aggregate M] [--reload FILE] [--traffic]
    python ps_equiv.py OUT --reference [--load FILE ...]

A worker trains an Embedding + Dense model with SGD and with Adagrad (sync mode) on the same
global batches as the reference; with --traffic it then measures the bytes that evaluating
moves from the ps for a large table, with tfstrat's Embedding and with Keras's. The chief saves each model's weights
(OUT/<optimizer>.weights.h5). Each worker writes OUT/<task>.json.

--reference trains the same models on one device, without tfstrat, sparse gradients densified,
and writes OUT/reference.npz; with --load it instead loads each .weights.h5 into the stock model
and writes its weights to <file>.npz.
"""

import argparse
import json
import os
import types

import numpy as np

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--reference", action="store_true")
parser.add_argument("--load", nargs="*", default=[])
parser.add_argument("--partitions", default="auto")
parser.add_argument("--aggregate", type=int, default=None)
parser.add_argument("--reload", default=None, help="chief: load this file after training")
parser.add_argument("--traffic", action="store_true", help="measure bytes moved by lookups")
parser.add_argument("--global-batch", type=int, default=24)
parser.add_argument("--examples", type=int, default=24 * 20)
args = parser.parse_args()

import tfstrat  # noqa: E402

strategy = None
if not args.reference:
    partitions = args.partitions if args.partitions == "auto" else int(args.partitions)
    strategy = tfstrat.ParameterServer(
        replicas_to_aggregate=args.aggregate, partitions=partitions, timeout=60
    )

import graphs  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from common import CLASSES, SEQ, VOCAB, compile_model, data, dump_loaded, optimizer  # noqa: E402

from tfstrat.keras.layers import Embedding  # noqa: E402
from tfstrat.runtime.traffic import tcp_bytes  # noqa: E402


def build(stock: bool, vocab: int = VOCAB, dim: int = 8):
    keras.utils.set_random_seed(7)
    inputs = keras.Input((SEQ,), dtype="int32")
    layer = keras.layers.Embedding if stock else Embedding
    x = layer(vocab, dim, name="embedding")(inputs)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(16, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(CLASSES)(x))


if args.reference and args.load:
    dump_loaded(build, args.load)
    raise SystemExit(0)

x, y = data(args.examples)
scope = (strategy or tf.distribute.get_strategy()).scope
task = os.environ.get("TFSTRAT_TASK", "reference").replace(":", "_")
report, arrays = {}, {}


def count_rows(model) -> list:
    """The rows each training step of `model` receives, as it runs."""
    rows, inner = [], type(model).train_step

    def train_step(self, data):  # a method named so: the strategy tells Keras's step by it
        seen = tf.numpy_function(
            lambda n: rows.append(int(n)) or n, [tf.shape(data[0])[0]], tf.int32, stateful=True
        )
        with tf.control_dependencies([seen]):
            return inner(self, data)

    model.train_step = types.MethodType(train_step, model)
    return rows


for name in ("sgd", "adagrad"):
    with scope():
        model = compile_model(build(stock=args.reference), optimizer(name, densify=args.reference))
    rows = count_rows(model)
    history = model.fit(x, y, batch_size=args.global_batch, epochs=2, shuffle=False, verbose=0)
    if not args.reference:  # where the step cut this worker's rows from the global batch
        nodes = graphs.step_nodes(model)
        report[name] = {
            "slice_devices": sorted({n.device for n in nodes if "tfstrat_worker_rows/" in n.name}),
            "input_devices": sorted({n.device for n in nodes if "GetNext" in n.op}),
        }
    report[name] = {
        **report.get(name, {}),
        "step_rows": sorted(set(rows)),
        "iterations": int(model.optimizer.iterations.numpy()),
        "loss": history.history["loss"],
        "devices": {w.path: w.value.device for w in model.weights},
        "evaluate": model.evaluate(x, y, batch_size=args.global_batch, verbose=0),
        "predict_rows": int(model.predict(x, batch_size=args.global_batch, verbose=0).shape[0]),
    }
    if args.reference:
        for i, w in enumerate(v for v in model.weights if v.trainable):
            arrays[f"{name}/w{i}"] = w.numpy()
    elif strategy.extended.should_checkpoint:
        model.save_weights(os.path.join(args.out, f"{name}.weights.h5"))
        if args.reload:
            model.load_weights(args.reload)
            model.save_weights(os.path.join(args.out, f"{name}.reloaded.weights.h5"))

if args.reference:
    np.savez(os.path.join(args.out, "reference.npz"), **arrays)
else:
    report["dropped"] = strategy.dropped
    report["placement"] = strategy.placement_summary()
if args.traffic:
    # Bytes moved from the ps by evaluating a model with a 1.6 MB table: tfstrat's Embedding
    # fetches the looked-up rows, Keras's reads the whole table every step.
    ps_ports = {int(a.rsplit(":", 1)[1]) for a in strategy.extended.tf_config.addresses("ps")}
    big_x = np.random.default_rng(1).integers(0, 25_000, (24 * 5, SEQ)).astype("int32")
    for stock in (False, True):
        with scope():
            model = compile_model(build(stock, vocab=25_000, dim=16), optimizer("sgd"))
        model.evaluate(big_x[:24], y[:24], batch_size=24, verbose=0)  # trace first
        before = tcp_bytes(ps_ports)[1]
        model.evaluate(big_x, y[: len(big_x)], batch_size=24, verbose=0)
        per_step = (tcp_bytes(ps_ports)[1] - before) / 5
        report["stock" if stock else "tfstrat"] = {"bytes_per_step": per_step}
    report["table_bytes"] = 25_000 * 16 * 4
if not args.reference:
    with open(os.path.join(args.out, f"{task}.json"), "w") as f:
        json.dump(report, f, indent=1)
