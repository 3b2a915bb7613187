"""Two CollectiveAllReduce workers; worker 1 misbehaves at step 5 (run by `tfstrat launch`).

Usage (under TF_CONFIG): python faults_launch_peer.py MODE TIMEOUT [DEVICES]
    MODE sigstop: worker 1 stops itself (SIGSTOP: alive, silent); worker 0 must fail after
                  TIMEOUT naming it
    MODE exit0:   worker 1 exits 0 mid-run (a script that returns early); worker 0 must fail
    MODE late:    worker 1 sleeps in a callback (alive, its gRPC server answers) for 20 x
                  TIMEOUT; worker 0 must fail after TIMEOUT naming it
    DEVICES: logical CPUs per worker (default 1, where the step's gradients go over tfstrat's
    ring); 2: over TensorFlow's collectives, with steps_per_execution 2, which the process's
    watchdog bounds.
"""

import os
import signal
import sys
import time

import tfstrat

mode, timeout = sys.argv[1], float(sys.argv[2])
devices = int(sys.argv[3]) if len(sys.argv) > 3 else 1
if devices > 1:
    tfstrat.split_cpu(devices)
# Two devices: over TensorFlow's collectives (communication="ring"; "auto" sums the devices and
# takes tfstrat's ring), where the process's watchdog bounds each step.
strategy = tfstrat.CollectiveAllReduce(
    timeout=timeout,
    devices=devices if devices > 1 else None,
    communication="ring" if devices > 1 else "auto",
)

import keras  # noqa: E402
from common import build_model, compile_model, data, optimizer  # noqa: E402


class MisbehaveAtStep(keras.callbacks.Callback):
    done = False

    def on_train_batch_end(self, batch, logs=None):
        if self.done or batch < 5 or strategy.worker_index != 1:
            return
        self.done = True
        print(f"worker 1: {mode} now", flush=True)
        if mode == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif mode == "late":
            time.sleep(20 * timeout)
        else:
            os._exit(0)  # sys.exit would unwind through Keras; a returning script is this abrupt


x, y = data(24 * 200)
spe = 2 if devices > 1 else 1
with strategy.scope():
    model = compile_model(build_model(), optimizer("sgd"), steps_per_execution=spe)
model.fit(x, y, batch_size=24, epochs=1, shuffle=False, verbose=0, callbacks=[MisbehaveAtStep()])
print("training finished, which it must not")
