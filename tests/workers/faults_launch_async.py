"""ParameterServer async with 2 workers; worker 1 exits 0 after 3 steps (run by `tfstrat launch`).

Usage (under TF_CONFIG): python faults_launch_async.py REPORTED
Worker 0 trains on alone (async waits for nobody), then waits for the file REPORTED (the test
creates it when the launcher says that worker 1 left early) and exits 0.
"""

import os
import sys
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
# Worker 0 must still run when the launcher notices worker 1 gone, however fast its own
# steps were; the bound only ends a run whose launcher never says so (the test then fails).
reported, deadline = sys.argv[1], time.monotonic() + 120
while not os.path.exists(reported) and time.monotonic() < deadline:
    time.sleep(0.1)
print(f"worker:0 saw the launcher's report: {os.path.exists(reported)}", flush=True)
