"""Keras's weight APIs on a Hybrid worker whose tables are on a ps, or on one device.

Usage:
    python hybrid_weights_api.py OUT --reference   one device, no tfstrat: OUT/reference.{json,npz}
    python hybrid_weights_api.py OUT               a Hybrid worker (tfstrat launch --ps 1):
                                                   OUT/<task>.{json,npz}
    --models plain,bert (the default) or plain     which of the two models below

Two models, each built and compiled in the strategy's scope: a plain Keras one (Embedding(50, 4),
Flatten, Dense(1); Adagrad, whose accumulator is a slot) and keras-hub's BertTextClassifier
built from a config (its token and segment tables go to the ps; SGD). For each: what
`weights`, `count_params()` and `summary()` say before training; `set_weights()` of seeded
values unlike the initializer's, and `get_weights()` right after; then 2 epochs of `fit` and
`get_weights()`, the table layer's `get_weights()`, `keras.ops.convert_to_numpy(layer.embeddings)`
and `model.optimizer.variables`.
"""

import argparse
import json
import os

import numpy as np

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--reference", action="store_true")
parser.add_argument("--models", default="plain,bert")
args = parser.parse_args()

import tfstrat  # noqa: E402

strategy = None if args.reference else tfstrat.Hybrid(partitions=2, timeout=60)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from common import optimizer  # noqa: E402

ROWS, GLOBAL_BATCH = 96, 24
scope = (strategy or tf.distribute.get_strategy()).scope


def plain():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 50, (ROWS, 3)).astype("int32")
    y = (x.sum(axis=1, keepdims=True) / 75.0 - 1.0).astype("float32")
    with scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential(
            [
                keras.Input((3,), dtype="int32"),
                keras.layers.Embedding(50, 4, name="emb"),
                keras.layers.Flatten(),
                keras.layers.Dense(1),
            ]
        )
        model.compile(
            optimizer=optimizer("adagrad", densify=args.reference, name="adagrad"), loss="mse"
        )
    return model, "emb", x, y


def bert():
    import keras_hub

    rng = np.random.default_rng(2)
    length, vocab = 8, 60
    ids = rng.integers(1, vocab, (ROWS, length)).astype("int32")
    x = {
        "token_ids": ids,
        "segment_ids": (np.arange(length)[None, :] >= length // 2).astype("int32").repeat(ROWS, 0),
        "padding_mask": np.ones((ROWS, length), "int32"),
    }
    y = (ids[:, 0] % 3).astype("int32")
    with scope():
        keras.utils.set_random_seed(4)
        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=vocab,
            num_layers=1,
            num_heads=2,
            hidden_dim=16,
            intermediate_dim=32,
            max_sequence_length=length,
            dropout=0.0,
        )
        model = keras_hub.models.BertTextClassifier(
            backbone=backbone, num_classes=3, preprocessor=None, dropout=0.0
        )
        model.compile(
            optimizer=optimizer("sgd", densify=args.reference, name="sgd"),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return model, "token_embedding", x, y


def summary_counts(model) -> list[str]:
    lines = []
    model.summary(print_fn=lambda line, **kw: lines.append(line))
    return [line.strip() for line in "\n".join(lines).splitlines() if "params" in line]


report, arrays = {}, {}
for name, make in [(m, {"plain": plain, "bert": bert}[m]) for m in args.models.split(",")]:
    model, table_layer, x, y = make()
    model.predict(
        x[:GLOBAL_BATCH] if name == "plain" else {k: v[:2] for k, v in x.items()}, verbose=0
    )
    report[name] = {
        "paths": [w.path for w in model.weights],
        "shapes": [list(w.shape) for w in model.weights],
        "trainable": [w.path for w in model.trainable_weights],
        "count_params": model.count_params(),
        "summary": summary_counts(model),
    }
    rng = np.random.default_rng(5)
    given = [(0.1 * rng.normal(size=w.shape)).astype(w.dtype) for w in model.get_weights()]
    model.set_weights(given)
    after_set = model.get_weights()
    report[name]["set_then_get_equal"] = all(
        a.shape == b.shape and np.array_equal(a, b) for a, b in zip(after_set, given)
    )
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    layer = model.get_layer(table_layer) if name == "plain" else model.backbone.token_embedding
    report[name]["optimizer_paths"] = [v.path for v in model.optimizer.variables]
    report[name]["optimizer_shapes"] = [list(v.shape) for v in model.optimizer.variables]
    report[name]["summary_trained"] = summary_counts(model)
    for i, w in enumerate(model.get_weights()):
        arrays[f"{name}/w{i}"] = w
    for i, w in enumerate(layer.get_weights()):
        arrays[f"{name}/layer{i}"] = w
    arrays[f"{name}/embeddings"] = keras.ops.convert_to_numpy(layer.embeddings)
    for i, v in enumerate(model.optimizer.variables):
        arrays[f"{name}/opt{i}"] = np.asarray(v.numpy())

task = "reference" if args.reference else os.environ["TFSTRAT_TASK"].replace(":", "_")
np.savez(os.path.join(args.out, f"{task}.npz"), **arrays)
with open(os.path.join(args.out, f"{task}.json"), "w") as f:
    json.dump(report, f, indent=1)
