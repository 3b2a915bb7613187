"""Two mistakes of a first script, run by `tfstrat launch --workers 2`; each must be named
with its fix.

Usage (under TF_CONFIG): python first_hour_mistakes.py MODE
    MODE no_scope:    the strategy first, but the model built and fitted outside its scope
                      (each worker trains alone: a warning at fit, once per model)
    MODE late:        a model built before the strategy (TensorFlow refuses to configure its
                      collectives; tfstrat names the fix)
    MODE late_outer:  LocalSGD given a Keras optimizer object created before it (the same
                      cause; the fix is to pass its config)
"""

import sys

import numpy as np

mode = sys.argv[1]
import tfstrat  # noqa: E402

if mode == "no_scope":
    strategy = tfstrat.CollectiveAllReduce(timeout=60)
import keras  # noqa: E402

if mode == "late_outer":
    outer = keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)
    strategy = tfstrat.LocalSGD(sync_every=4, outer_optimizer=outer, timeout=60)

model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
model.compile(optimizer="sgd", loss="mse")
if mode == "late":
    strategy = tfstrat.CollectiveAllReduce(timeout=60)
x = np.zeros((64, 4), np.float32)
model.fit(x, x[:, :2], batch_size=16, epochs=1, verbose=0)
model.fit(x, x[:, :2], batch_size=16, epochs=1, verbose=0)  # warned about once, not twice
print("trained", flush=True)
