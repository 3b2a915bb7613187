"""Input that cannot train, under CollectiveAllReduce (2 workers) or one plain process.

Usage: python faults_input.py OUT_DIR [--reference]
Writes OUT_DIR/worker_<i>.json (or reference.json):
  empty        the error of fit on 0 rows
  partial      the epoch loss of 33 rows in batches of 16 (the last batch: 1 row, so one
               worker's slice is empty)
  tiny         fit with batch_size=1 (fewer rows than the 2 workers: one worker's slice of
               every batch is empty): the epoch's logs and the weights' norms
"""

import json
import os
import sys

out_dir, reference = sys.argv[1], "--reference" in sys.argv
if not reference:
    import tfstrat

    strategy = tfstrat.CollectiveAllReduce(timeout=30)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

if reference:
    strategy = tf.distribute.get_strategy()

rng = np.random.default_rng(0)
x = rng.normal(size=(33, 6)).astype("float32")
y = (x[:, 0] > 0).astype("int64")


def model_():
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)]
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    return model


def error_of(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 (the test reads the message)
        return f"{type(e).__name__}: {e}"
    return "no error"


result = {}
model = model_()
result["empty"] = error_of(lambda: model.fit(x[:0], y[:0], batch_size=16, verbose=0))
history = model_().fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
result["partial"] = {k: float(v[0]) for k, v in history.history.items()}
tiny = model_()
history = tiny.fit(x[:7], y[:7], batch_size=1, epochs=1, shuffle=False, verbose=0)
result["tiny"] = {k: float(v[0]) for k, v in history.history.items()}
result["tiny"].update({f"w{i}": float(np.linalg.norm(w)) for i, w in enumerate(tiny.get_weights())})
name = "reference" if reference else f"worker_{strategy.worker_index}"
with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
    json.dump(result, f)
print("done", flush=True)
