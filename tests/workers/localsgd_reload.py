"""LocalSGD with an outer optimizer, one worker: weights loaded between two fits are what the
next period starts from (its anchors), not the weights the first fit ended with.

With the inner learning rate at 0 the second fit's inner steps change nothing, so its sync
must leave the loaded weights exactly as loaded: anchor - 0.5 * (anchor - weights) = weights
when the anchor is the loaded weights (a stale anchor A gives (A + weights) / 2).
"""

import json
import sys

import tfstrat

strategy = tfstrat.LocalSGD(
    sync_every=2,
    outer_optimizer={"class_name": "SGD", "config": {"learning_rate": 0.5}},
    timeout=60,
)

import keras  # noqa: E402
import numpy as np  # noqa: E402

keras.utils.set_random_seed(0)
x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
y = x @ np.arange(4, dtype="float32")[:, None]
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
initial = [w.copy() for w in model.get_weights()]
model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)  # 4 steps, 2 syncs
moved = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), initial))
model.set_weights(initial)
model.optimizer.learning_rate.assign(0.0)
model.fit(x[:32], y[:32], batch_size=16, epochs=1, shuffle=False, verbose=0)  # 2 steps, 1 sync
after = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), initial))
json.dump({"moved": moved, "after": after, **strategy.sync_state(model)}, open(sys.argv[1], "w"))
