"""A 2-worker run in which worker 1 kills itself mid-training (SIGKILL, no goodbye).

Usage (under TF_CONFIG): python peer_killed.py TIMEOUT_SECONDS
Worker 0 must then fail on its own, within the collective timeout, naming the dead peer.
"""

import os
import signal
import sys
import time

import tfstrat

strategy = tfstrat.CollectiveAllReduce(timeout=float(sys.argv[1]))

import keras  # noqa: E402
from common import build_model, compile_model, data, optimizer  # noqa: E402


class DieAtStep(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 5 and strategy.worker_index == 1:
            print(f"worker 1 dies now, at {time.time()}", flush=True)  # the fault's wall clock
            os.kill(os.getpid(), signal.SIGKILL)


x, y = data(24 * 200)
with strategy.scope():
    model = compile_model(build_model(), optimizer("sgdm"))
model.fit(x, y, batch_size=24, epochs=1, shuffle=False, verbose=0, callbacks=[DieAtStep()])
print("training finished, which it must not")
