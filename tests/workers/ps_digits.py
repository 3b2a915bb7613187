"""scikit-learn's digits under ParameterServer (run by `tfstrat launch`); sync or async.

Usage (under TF_CONFIG): python ps_digits.py OUT MODE     (MODE: sync | async)
Writes OUT/<task>.json with the test accuracy after training.
"""

import json
import os
import sys

import tfstrat

out, mode = sys.argv[1], sys.argv[2]
EPOCHS = 4
strategy = tfstrat.ParameterServer(mode=mode, timeout=60)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from common import digits  # noqa: E402

x, y = digits()
order = np.random.default_rng(0).permutation(len(x))
x, y = x[order], y[order]
x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]

keras.utils.set_random_seed(3)
with strategy.scope():
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
model.fit(x_train, y_train, batch_size=40, epochs=EPOCHS, verbose=0)
_, accuracy = model.evaluate(x_test, y_test, batch_size=100, verbose=0)
task = os.environ["TFSTRAT_TASK"].replace(":", "_")
with open(os.path.join(out, f"{task}.json"), "w") as f:
    json.dump({"accuracy": accuracy, "iterations": int(model.optimizer.iterations.numpy())}, f)
