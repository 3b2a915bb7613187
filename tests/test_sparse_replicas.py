"""Adam on an Embedding whose ids repeat in a batch: two replicas train to one device's weights.

Keras 3's Adam squares a sparse gradient's rows before it sums repeated ids, so on one device a
word seen k times got a step up to sqrt(k) times Adam's, which no strategy can reproduce (the
replicas' rows are summed before Adam sees them). examples/word_lm.py learned to perplexity 15
on one device and 99 on two replicas. `tfstrat.keras.layers.Embedding` now hands Keras one row
per id (the repeats' sum; the repeats zero), so every strategy applies the same Adam step.

The replicas run in a fresh interpreter: the CPU must be split before TensorFlow's runtime
starts.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

TOLERANCE = 1e-5

SCRIPT = r"""
import json, sys
import tfstrat
tfstrat.split_cpu(2)
import keras, numpy as np, tensorflow as tf

VOCAB, WIDTH, BATCH, STEPS = 50, 4, 16, 4
rng = np.random.default_rng(0)
# Zipf-like ids: the first few repeat many times in every batch, on every replica.
ids = np.minimum(rng.zipf(1.5, (BATCH * STEPS, 6)) - 1, VOCAB - 1).astype(np.int32)
y = rng.normal(size=(BATCH * STEPS, 1)).astype(np.float32)


def train(strategy, updates):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((6,), dtype="int32"),
            tfstrat.keras.layers.Embedding(VOCAB, WIDTH, sparse_updates=updates),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1),
        ])
        model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    model.fit(ids, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return [w.numpy() for w in model.weights]


# The reference, without tfstrat's layer or strategies: keras.layers.Embedding in a
# GradientTape loop, its gradient densified (each id's repeats summed). exact: Keras's Adam on
# every weight; lazy: the table's touched rows step by Adam's rule written out in NumPy (rows
# outside the batch keep their values and moments), the Dense layer by Keras's Adam.
def plain(updates):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((6,), dtype="int32"),
        keras.layers.Embedding(VOCAB, WIDTH),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(1),
    ])
    table, dense = model.trainable_variables[0], model.trainable_variables[1:]
    adam = keras.optimizers.Adam(0.05)
    w = table.numpy().astype(np.float64)
    m, v = np.zeros_like(w), np.zeros_like(w)
    for step in range(STEPS):
        batch = slice(step * BATCH, (step + 1) * BATCH)
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(y[batch], model(ids[batch], training=True))
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, model.trainable_variables)]
        if updates == "exact":
            adam.apply(grads, model.trainable_variables)
            continue
        adam.apply(grads[1:], dense)
        rows = np.unique(ids[batch])
        g = grads[0].numpy().astype(np.float64)[rows]
        m[rows] += (g - m[rows]) * 0.1
        v[rows] += (g * g - v[rows]) * 0.001
        # beta ** t in float32, as Keras computes it (1 - 0.999 ** t moves by 1e-5 otherwise)
        t = np.float32(step + 1)
        alpha = 0.05 * np.sqrt(1 - np.float32(0.999) ** t) / (1 - np.float32(0.9) ** t)
        w[rows] -= m[rows] * alpha / (np.sqrt(v[rows]) + 1e-7)
        table.assign(w.astype(np.float32))
    return [v.numpy() for v in model.weights]


def errors(want, got):
    return [float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-12)) for a, b in zip(want, got)]


# lazy (the default): Adam steps the batch's rows only, and the gradient stays sparse even
# when sparse_as_dense asks otherwise; exact: Keras's dense Adam, densified or not.
result = {}
reference = {updates: plain(updates) for updates in ("lazy", "exact")}
for name, updates, dense in (
    ("lazy", "lazy", False), ("lazy, sparse_as_dense", "lazy", True),
    ("exact", "exact", False), ("exact, sparse_as_dense", "exact", True),
):
    one = train(tf.distribute.get_strategy(), updates)
    two = train(tfstrat.MirroredNCCL(sparse_as_dense=dense), updates)
    result[name] = errors(reference[updates], two)
    result[f"{name}: one device"] = errors(reference[updates], one)
json.dump(result, open(sys.argv[1], "w"))
"""


def test_embedding_gradient_has_one_row_per_id():
    import keras
    import tensorflow as tf

    import tfstrat

    layer = tfstrat.keras.layers.Embedding(10, 3)
    ids = tf.constant([[1, 4, 1], [1, 7, 4]])
    with tf.GradientTape() as tape:
        out = layer(ids)
        loss = tf.reduce_sum(out * tf.reshape(tf.range(18, dtype=tf.float32), [2, 3, 3]))
    (grad,) = tape.gradient(loss, [layer.embeddings])
    assert isinstance(grad, tf.IndexedSlices)
    values = grad.values.numpy().reshape(6, 3)
    # Positions 0, 1 and 4 are the first of ids 1, 4 and 7; the repeats are zero.
    assert np.all(values[[2, 3, 5]] == 0)
    stock = keras.layers.Embedding(10, 3)
    stock.build()
    stock.embeddings.assign(layer.embeddings)
    with tf.GradientTape() as tape:
        out = stock(ids)
        loss = tf.reduce_sum(out * tf.reshape(tf.range(18, dtype=tf.float32), [2, 3, 3]))
    (want,) = tape.gradient(loss, [stock.embeddings])
    np.testing.assert_allclose(tf.convert_to_tensor(grad), tf.convert_to_tensor(want))


@pytest.mark.timeout(120)
def test_adam_with_repeated_ids_matches_one_device(tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(out)],
        capture_output=True,
        text=True,
        timeout=110,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for name, errors in result.items():
        assert max(errors) <= TOLERANCE, (name, errors)
