"""LocalSGD with DiLoCo's outer step, one worker, against the algorithm written out by hand.

Inner SGD with momentum for `sync_every` = 3 steps, then the outer Nesterov step on the
pseudo-gradient (weights at the last sync minus the average; with one worker the average is
the worker's weights: the average itself is tested with two workers by test_localsgd's
sync_every=1 equality), a sync at each epoch's end after a partial period, and none at an
epoch's end that falls on a sync. The reference
trains a plain Keras copy on the same batches (no strategy) and applies the outer rule in
NumPy (common.diloco_outer_step).
"""

import json
import sys

import tfstrat

strategy = tfstrat.LocalSGD(sync_every=3, outer_optimizer="diloco", timeout=60)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from common import diloco_outer_step  # noqa: E402

keras.utils.set_random_seed(0)
x = np.random.default_rng(0).normal(size=(80, 4)).astype("float32")
y = np.tanh(x @ np.arange(4, dtype="float32")[:, None])


def build():
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)]
    )


with strategy.scope():
    model = build()
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
initial = [w.copy() for w in model.get_weights()]
model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)  # 10 steps an epoch
model.fit(x[:72], y[:72], batch_size=8, epochs=1, shuffle=False, verbose=0)  # 9: ends on a sync

reference = build()
reference.set_weights(initial)
reference.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
anchor = [w.copy() for w in initial]
outer_m = [np.zeros_like(w) for w in initial]


def outer_step():
    global anchor
    anchor = diloco_outer_step(anchor, outer_m, reference.get_weights())
    reference.set_weights(anchor)


since = syncs = 0
for steps in (10, 10, 9):  # the three epochs above
    for step in range(steps):
        reference.train_on_batch(x[8 * step : 8 * step + 8], y[8 * step : 8 * step + 8])
        since += 1
        if since == 3:  # every 3 steps
            outer_step()
            since, syncs = 0, syncs + 1
    if since:  # and at an epoch's end after a partial period (only then)
        outer_step()
        since, syncs = 0, syncs + 1
errors = [
    float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))
    for a, b in zip(model.get_weights(), reference.get_weights(), strict=True)
]
moved = max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), initial))
json.dump({"errors": errors, "moved": moved, "syncs": syncs, **strategy.sync_state(model)},
          open(sys.argv[1], "w"))  # fmt: skip
