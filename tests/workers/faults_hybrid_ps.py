"""Hybrid, 2 workers + 1 ps: worker 0 SIGKILLs the ps at step 5; every worker must fail with
an error naming the ps task and its table server.

Usage (under TF_CONFIG from `tfstrat launch --workers 2 --ps 1`): python faults_hybrid_ps.py
"""

import os
import signal
import time

import tfstrat

strategy = tfstrat.Hybrid(timeout=20, partitions=1)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from common import ps_pid  # noqa: E402


class KillPs(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 5 and strategy.worker_index == 0:
            print(f"killing ps:0 at {time.time()}", flush=True)  # the fault's wall clock
            os.kill(ps_pid(), signal.SIGKILL)


rng = np.random.default_rng(0)
x = rng.integers(0, 500, (16 * 60, 4)).astype("int32")
y = (x[:, 0] % 2).astype("int64")
with strategy.scope():
    inputs = keras.Input((4,), dtype="int32")
    h = keras.layers.Flatten()(tfstrat.keras.layers.Embedding(500, 8)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2)(h))
    model.compile(
        optimizer="adagrad",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[KillPs()])
print("training finished, which it must not", flush=True)
