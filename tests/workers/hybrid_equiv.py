"""One worker of a Hybrid cluster test (run by `tfstrat launch`), or the reference.

Usage:
    python hybrid_equiv.py OUT --reference --load FILE...   each file's weights -> FILE.npz
    python hybrid_equiv.py OUT --reference      one device, no tfstrat: writes OUT/init.weights.h5
                                                 and OUT/reference.npz (sparse gradients densified)
    python hybrid_equiv.py OUT [--partitions K] [--vocab-scale S] [--devices N]
                                                 a Hybrid worker: loads OUT/init.weights.h5, trains,
                                                 the chief saves OUT/<optimizer>.weights.h5;
                                                 writes OUT/<task>.json (placement, bytes to the ps)
The model: two embedding tables (ids of two inputs) and a dense head; SGD and Adagrad.
"""

import argparse
import json
import os

import numpy as np

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--reference", action="store_true")
parser.add_argument("--partitions", default="auto")
parser.add_argument("--global-batch", type=int, default=24)
parser.add_argument("--examples", type=int, default=24 * 20)
parser.add_argument("--steps-only", type=int, default=0, help="train this many steps of sgd only")
parser.add_argument("--vocab-scale", type=int, default=1)
parser.add_argument("--load", nargs="*", default=[], help="reference: dump these .weights.h5")
parser.add_argument("--devices", type=int, default=0, help="logical CPUs (replicas) per worker")
parser.add_argument("--spe", type=int, default=1, help="steps_per_execution of the workers' fit")
args = parser.parse_args()

import tfstrat  # noqa: E402

strategy = None
if not args.reference:
    parts = args.partitions if args.partitions == "auto" else int(args.partitions)
    if args.devices:
        tfstrat.split_cpu(args.devices)
    strategy = tfstrat.Hybrid(partitions=parts, timeout=60, devices=args.devices or None)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from common import CLASSES, SEQ, VOCAB, compile_model, data, dump_loaded, optimizer  # noqa: E402

from tfstrat.keras.layers import Embedding  # noqa: E402
from tfstrat.runtime.traffic import tcp_bytes  # noqa: E402

VOCAB_B = 500


def build(stock: bool):
    keras.utils.set_random_seed(11)
    layer = keras.layers.Embedding if stock else Embedding
    a, b = keras.Input((SEQ,), dtype="int32"), keras.Input((SEQ,), dtype="int32")
    ea = layer(VOCAB * args.vocab_scale, 8, name="users")(a)
    eb = layer(VOCAB_B * args.vocab_scale, 8, name="items")(b)
    x = keras.layers.Concatenate()([keras.layers.Flatten()(ea), keras.layers.Flatten()(eb)])
    x = keras.layers.Dense(16, activation="relu")(x)
    return keras.Model([a, b], keras.layers.Dense(CLASSES)(x))


if args.reference and args.load:
    dump_loaded(build, args.load)
    raise SystemExit(0)

x, y = data(args.examples)
inputs = (x, (x * 7 + 3) % VOCAB_B)
scope = (strategy or tf.distribute.get_strategy()).scope
init = os.path.join(args.out, "init.weights.h5")
task = os.environ.get("TFSTRAT_TASK", "reference").replace(":", "_")
report, arrays = {}, {}
for name in ("sgd",) if args.steps_only else ("sgd", "adagrad"):
    with scope():
        model = compile_model(
            build(stock=args.reference),
            optimizer(name, densify=args.reference),
            steps_per_execution=1 if args.reference else args.spe,
        )
    if args.reference:
        model.save_weights(init)
    elif not args.steps_only:
        model.load_weights(init)  # the reference's initial weights, tables included
    if args.steps_only:
        ps_ports = {int(a.rsplit(":", 1)[1]) + 1 for a in strategy.ps_addresses}
        n = args.steps_only * args.global_batch
        model.fit((x[:24], inputs[1][:24]), y[:24], batch_size=24, verbose=0)  # trace first
        before = sum(tcp_bytes(ps_ports))
        model.fit((x[:n], inputs[1][:n]), y[:n], batch_size=args.global_batch, verbose=0)
        report["bytes_per_step"] = (sum(tcp_bytes(ps_ports)) - before) / args.steps_only
        # A stock Embedding's table goes to the ps too (its gradient is sparse): its line says so.
        with scope():
            stock = compile_model(build(stock=True), optimizer("sgd"))
        stock.fit((x[:24], inputs[1][:24]), y[:24], batch_size=24, verbose=0)
        break
    history = model.fit(inputs, y, batch_size=args.global_batch, epochs=2, shuffle=False, verbose=0)
    calls = {} if args.reference else {p: dict(t.calls) for p, t in strategy.tables.items()}
    report[name] = {
        "calls": calls,  # this worker's fetches and pushes of each ps-held table in `fit`
        "loss": history.history["loss"],
        "iterations": int(model.optimizer.iterations.numpy()),
        "evaluate": model.evaluate(inputs, y, batch_size=args.global_batch, verbose=0),
        "predict_rows": int(
            model.predict(inputs, batch_size=args.global_batch, verbose=0).shape[0]
        ),
    }
    if args.reference:
        for i, w in enumerate(v for v in model.weights if v.trainable):
            arrays[f"{name}/w{i}"] = w.numpy()
    elif strategy.extended.should_checkpoint:
        model.save_weights(os.path.join(args.out, f"{name}.weights.h5"))

if args.reference:
    np.savez(os.path.join(args.out, "reference.npz"), **arrays)
    with open(os.path.join(args.out, "reference.json"), "w") as f:  # its losses, evaluate
        json.dump(report, f, indent=1)
else:
    report["placement"] = strategy.placement()
    report["dense_devices"] = {
        # a ps-held table's weight is a stand-in on the worker that shows the table
        w.path: w.value.device
        for w in model.weights
        if not hasattr(w, "_tfstrat_table")
    }
    with open(os.path.join(args.out, f"{task}.json"), "w") as f:
        json.dump(report, f, indent=1)
