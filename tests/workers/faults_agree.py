"""Workers that disagree: every worker must fail before training, naming the difference.

Usage (under TF_CONFIG, 2 workers): python faults_agree.py CASE [communication]
CASE: model    worker 1 builds Dense(9) where worker 0 builds Dense(8)
      options  worker 1 creates the strategy with sparse_as_dense=True
"""

import json
import os
import sys
import time

import tfstrat

case = sys.argv[1]
communication = sys.argv[2] if len(sys.argv) > 2 else "auto"
me = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
dense = "auto" if case != "options" or me == 0 else True
print(f"strategy starts at {time.time()}", flush=True)  # the test's clock starts here
strategy = tfstrat.CollectiveAllReduce(
    timeout=30, sparse_as_dense=dense, communication=communication
)

import keras  # noqa: E402
import numpy as np  # noqa: E402

units = 9 if case == "model" and me == 1 else 8
with strategy.scope():
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(units, name="hidden"), keras.layers.Dense(2)]
    )
    model.compile(optimizer="sgd", loss="mse")
x = np.zeros((64, 6), "float32")
model.fit(x, np.zeros((64, 2), "float32"), batch_size=16, epochs=1, verbose=0)
print("trained, which it must not", flush=True)
