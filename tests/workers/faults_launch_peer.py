"""Two CollectiveAllReduce workers; worker 1 misbehaves at step 5 (run by `tfstrat launch`).

Usage (under TF_CONFIG): python faults_launch_peer.py MODE TIMEOUT
    MODE sigstop: worker 1 stops itself (SIGSTOP: alive, silent); worker 0 must fail after
                  TIMEOUT naming it
    MODE exit0:   worker 1 exits 0 mid-run (a script that returns early); worker 0 must fail
"""

import os
import signal
import sys

import tfstrat

mode, timeout = sys.argv[1], float(sys.argv[2])
strategy = tfstrat.CollectiveAllReduce(timeout=timeout)

import keras  # noqa: E402
from common import build_model, compile_model, data, optimizer  # noqa: E402


class MisbehaveAtStep(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch != 5 or strategy.worker_index != 1:
            return
        print(f"worker 1: {mode} now", flush=True)
        if mode == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            os._exit(0)  # sys.exit would unwind through Keras; a returning script is this abrupt


x, y = data(24 * 200)
with strategy.scope():
    model = compile_model(build_model(), optimizer("sgd"))
model.fit(x, y, batch_size=24, epochs=1, shuffle=False, verbose=0, callbacks=[MisbehaveAtStep()])
print("training finished, which it must not")
