"""2 workers against a ps started by hand (it outlives them), under Hybrid or ParameterServer
(sync): `fail` ends a run in the middle of step 3, `train` trains 6 steps and prints a digest
of the final weights and the gradients this worker saw dropped.

- hybrid: worker 1 exits at the start of step 3, after worker 0 has pushed that step's rows
  (worker 0 then fails on the ring), so the ps holds a failed step's push. The table starts
  from the ps's own draw, the rest from `keras.utils.set_random_seed(0)`.
- ps: the chief exits at the start of step 3; the test kills worker 1 once it has mailed that
  step, so ps 0 holds a failed step's mail. Variables stay on a ps between runs (as in TF1),
  so `train` sets every weight before it trains, and uses SGD (no optimizer slots to carry).

Usage (TF_CONFIG of 2 workers + 1 ps): python relaunch_run.py hybrid|ps fail|train
"""

import hashlib
import os
import sys

import tfstrat

kind, mode = sys.argv[1:3]
if kind == "hybrid":
    strategy = tfstrat.Hybrid(timeout=20, partitions=1)
else:
    strategy = tfstrat.ParameterServer(mode="sync", timeout=20)

import keras  # noqa: E402
import numpy as np  # noqa: E402

DIES = 1 if kind == "hybrid" else 0  # the worker that exits in `fail`


class Die(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if mode == "fail" and batch == 3 and strategy.worker_index == DIES:
            print(f"worker {DIES} exits before step 3", flush=True)
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
        optimizer="adagrad" if kind == "hybrid" else keras.optimizers.SGD(0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
if kind == "ps":
    model.set_weights([rng.normal(0, 0.1, w.shape).astype("float32") for w in model.weights])
model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[Die()])
digest = hashlib.sha256()
for w in [model.get_layer("table").embeddings.numpy(), *model.get_layer("dense").get_weights()]:
    digest.update(np.ascontiguousarray(w, np.float32).tobytes())
dropped = strategy.dropped if kind == "ps" else 0
print(f"trained: {digest.hexdigest()}, dropped {dropped}", flush=True)
