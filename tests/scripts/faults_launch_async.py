"""ParameterServer async with 2 workers; worker 1 exits 0 after 3 steps (run by `tfstrat launch`).

Usage (under TF_CONFIG): python faults_launch_async.py
Worker 0 trains on alone (async waits for nobody) and exits 0; the launcher must say that
worker 1 left early.
"""

import os
import time

import tfstrat

strategy = tfstrat.ParameterServer(mode="async", timeout=30)

import keras  # noqa: E402
from common import build_model, compile_model, data, optimizer  # noqa: E402


class LeaveAtStep(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 3 and strategy.worker_index == 1:
            print("worker 1 leaves now", flush=True)
            os._exit(0)


x, y = data(24 * 120)
with strategy.scope():
    model = compile_model(build_model(), optimizer("sgd"))
model.fit(x, y, batch_size=24, epochs=1, shuffle=False, verbose=0, callbacks=[LeaveAtStep()])
print(f"{os.environ['TFSTRAT_TASK']} finished training", flush=True)
time.sleep(3)  # still running well after worker 1 left, whatever the speed of the 117 steps
