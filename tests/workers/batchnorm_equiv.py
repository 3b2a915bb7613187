"""BatchNormalization under a tfstrat strategy against one device, on the same global batches.

Usage: python batchnorm_equiv.py STRATEGY OUT_DIR
STRATEGY: mirrored (2 logical CPUs, one process), collective, hybrid or ps (under `tfstrat
launch`). Each global batch's halves come from different distributions, so unsynchronized
replicas see different statistics.

Trains two models, one with `BatchNormalization(synchronized=True)` and one without, and writes
OUT_DIR/<task>.npz: every weight by path (moving statistics included), evaluate results, and
every replica's copy of each moving statistic (`copies/...`, MirroredNCCL). The chief also
trains the same models on one device (`ref/...`) and saves the distributed models' weights
(`sync.weights.h5`, `local.weights.h5`), as a user's checkpoint would.
"""

import os
import sys

import numpy as np

import tfstrat

KIND, OUT = sys.argv[1], sys.argv[2]
if KIND == "mirrored":
    tfstrat.split_cpu(2)  # before any TensorFlow op runs
strategy = {
    "mirrored": lambda: tfstrat.MirroredNCCL(timeout=60),
    "collective": lambda: tfstrat.CollectiveAllReduce(timeout=60),
    "hybrid": lambda: tfstrat.Hybrid(partitions=1, timeout=60),
    "ps": lambda: tfstrat.ParameterServer(timeout=60),
}[KIND]()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

GLOBAL_BATCH, STEPS, VOCAB = 16, 10, 200


def data():
    rng = np.random.default_rng(3)
    n = GLOBAL_BATCH * STEPS
    features = rng.normal(0.0, 1.0, (n, 6)).astype("float32")
    second_half = (np.arange(n) % GLOBAL_BATCH) >= GLOBAL_BATCH // 2
    features[second_half] = features[second_half] * 1.5 + 2.0
    ids = rng.integers(0, VOCAB, (n, 2)).astype("int32")
    y = (features[:, :1] + 0.01 * ids[:, :1] > 1.0).astype("float32")
    return (features, ids), y


def build(synchronized: bool):
    keras.utils.set_random_seed(11)
    features = keras.Input((6,), name="features")
    ids = keras.Input((2,), dtype="int32", name="ids")
    x = keras.layers.Dense(8, use_bias=False, name="dense1")(features)
    bn = dict(synchronized=synchronized, beta_initializer="ones")  # betas away from 0
    x = keras.layers.BatchNormalization(momentum=0.8, name="bn1", **bn)(x)
    # Hybrid's tables: tfstrat's and a plain Keras one with a sparse gradient on the ps; a
    # plain one with a dense gradient (l2) mirrored.
    tables = [
        tfstrat.keras.layers.Embedding(VOCAB, 4, name="table"),
        keras.layers.Embedding(VOCAB, 2, embeddings_regularizer="l2", name="movie"),
        keras.layers.Embedding(VOCAB, 1, name="movie_bias"),
    ]
    flat = [keras.layers.Flatten(name=f"flat_{t.name}")(t(ids)) for t in tables]
    joined = keras.layers.Concatenate(name="join")([x, *flat])
    x = keras.layers.Dense(8, "relu", use_bias=False, name="dense2")(joined)
    x = keras.layers.BatchNormalization(momentum=0.9, name="bn2", **bn)(x)
    model = keras.Model([features, ids], keras.layers.Dense(1, name="out")(x))
    loss = keras.losses.BinaryCrossentropy(from_logits=True)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=loss)
    return model


def train(scope, synchronized: bool, steps: int = 2 * STEPS):
    with scope():
        model = build(synchronized)
    x, y = data()
    if steps < STEPS:
        x, y = [t[: steps * GLOBAL_BATCH] for t in x], y[: steps * GLOBAL_BATCH]
    epochs = max(1, steps // STEPS)
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0)
    return model, model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0)


def weights(model) -> dict:
    # Hybrid's ps-held tables are read from the ps whole (a weight's numpy(), layer.embeddings).
    out = {v.path: v.numpy() for v in model.weights}
    for name in ("table", "movie_bias"):
        out[f"{name}/embeddings"] = np.asarray(model.get_layer(name).embeddings)
    return out


task = os.environ.get("TFSTRAT_TASK", "mirrored:0").replace(":", "_")
chief = task.endswith("_0")
results = {}
# Unsynchronized replicas train another model (each normalizes its own slice), so only one
# step, from the same weights, compares with one device: "local1".
RUNS = (("sync", True, 2 * STEPS), ("local", False, 2 * STEPS), ("local1", False, 1))
for name, synchronized, steps in RUNS:
    model, evaluated = train(strategy.scope, synchronized, steps)
    for path, value in weights(model).items():
        results[f"{name}/{path}"] = value
    results[f"{name}/evaluate"] = np.array(evaluated)
    for layer in ("bn1", "bn2"):
        for stat in ("moving_mean", "moving_variance"):
            variable = getattr(model.get_layer(layer), stat).value
            copies = getattr(variable, "values", (variable,))
            results[f"copies/{name}/{layer}/{stat}"] = np.stack([c.numpy() for c in copies])
    model.save_weights(os.path.join(OUT, f"{name}.weights.h5"))  # every worker; the chief writes
if KIND == "hybrid":  # a regularizer gives every row a gradient: the table stays mirrored
    with strategy.scope():
        reg = tfstrat.keras.layers.Embedding(VOCAB, 3, embeddings_regularizer="l2", name="reg")
        reg(keras.Input((1,), dtype="int32"))
    print(
        "regularized table:",
        "on the ps"
        if strategy.tables.get("reg/embeddings")
        else f"mirrored: {strategy.mirrored_why.get('reg/embeddings')}",
    )
if chief:  # after the distributed runs: the other workers do not wait for it
    for name, synchronized, steps in RUNS:
        ref, ref_evaluated = train(tf.distribute.get_strategy().scope, synchronized, steps)
        for path, value in weights(ref).items():
            results[f"ref/{name}/{path}"] = value
        results[f"ref/{name}/evaluate"] = np.array(ref_evaluated)
np.savez(os.path.join(OUT, f"{task}.npz"), **results)
print("wrote", task, {k: v.tolist() for k, v in results.items() if "evaluate" in k})
