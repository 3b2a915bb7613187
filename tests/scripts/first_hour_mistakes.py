"""Two mistakes of a first script, run by `tfstrat launch --workers 2`; both must end the run
with an error that names the fix.

Usage (under TF_CONFIG): python first_hour_mistakes.py MODE
    MODE no_scope:    the strategy first, but the model built and fitted outside its scope
                      (each worker would train alone: refused at fit)
    MODE late:        a model built before the strategy (TensorFlow refuses to configure its
                      collectives; tfstrat names the fix)
"""

import sys

import numpy as np

mode = sys.argv[1]
import tfstrat  # noqa: E402

if mode == "no_scope":
    strategy = tfstrat.CollectiveAllReduce(timeout=60)
import keras  # noqa: E402

model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
model.compile(optimizer="sgd", loss="mse")
if mode == "late":
    strategy = tfstrat.CollectiveAllReduce(timeout=60)
x = np.zeros((64, 4), np.float32)
model.fit(x, x[:, :2], batch_size=16, epochs=1, verbose=0)
print("trained, which it must not", flush=True)
