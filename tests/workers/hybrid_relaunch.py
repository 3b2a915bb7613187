"""Hybrid, 2 workers against a ps started by hand (it outlives them): `fail` makes worker 1
exit at the start of step 3, after worker 0 has pushed that step's rows (worker 0 then fails on
the ring), so the ps holds a failed step's push; `train` trains 6 steps from a fresh start and
prints a digest of the final table and weights.

Usage (TF_CONFIG of 2 workers + 1 ps): python hybrid_relaunch.py fail|train
"""

import hashlib
import os
import sys

import tfstrat

mode = sys.argv[1]
strategy = tfstrat.Hybrid(timeout=20, partitions=1)

import keras  # noqa: E402
import numpy as np  # noqa: E402


class Die(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if mode == "fail" and batch == 3 and strategy.worker_index == 1:
            print("worker 1 exits before step 3", flush=True)
            os._exit(3)


keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x = rng.integers(0, 500, (16 * 6, 4)).astype("int32")
y = (x[:, 0] % 2).astype("int64")
with strategy.scope():
    inputs = keras.Input((4,), dtype="int32")
    h = keras.layers.Flatten()(keras.layers.Embedding(500, 8, name="table")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2)(h))
    model.compile(
        optimizer="adagrad", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[Die()])
digest = hashlib.sha256()
for w in [model.get_layer("table").embeddings.numpy(), *model.get_layer("dense").get_weights()]:
    digest.update(np.ascontiguousarray(w, np.float32).tobytes())
print(f"trained: {digest.hexdigest()}", flush=True)
