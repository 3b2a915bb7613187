"""One task of the soak: a small embedding model trained for STEPS steps under STRATEGY
("hybrid": the table on the ps; "ps-async": ParameterServer, asynchronous).

    tfstrat launch --workers 2 --ps 1 -- python benchmarks/soak/worker.py hybrid 50000
"""

import sys

import tfstrat

kind, steps = sys.argv[1], int(sys.argv[2])
strategy = (
    tfstrat.Hybrid(timeout=120)
    if kind == "hybrid"
    else tfstrat.ParameterServer(mode="async", timeout=120)
)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

VOCAB, BATCH, PER_EPOCH = 50_000, 64, 1000
rng = np.random.default_rng(0)
ids = rng.zipf(1.2, size=(8192, 8)) % VOCAB
y = (ids.sum(axis=1) % 2).astype("float32")
data = tf.data.Dataset.from_tensor_slices((ids, y)).repeat().batch(BATCH * 2)

with strategy.scope():
    model = keras.Sequential(
        [
            keras.Input((8,), dtype="int64"),
            keras.layers.Embedding(VOCAB, 16),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adagrad(0.05), loss="mse")
model.fit(data, steps_per_epoch=PER_EPOCH, epochs=max(1, steps // PER_EPOCH), verbose=2)
print("soak: done", flush=True)
