"""ParameterServer under faults (run by `tfstrat launch`).

Usage (under TF_CONFIG):
    python ps_faults.py OUT kill-ps TIMEOUT   worker 0 SIGKILLs ps:0 after 5 steps; every
                                              worker must then fail, naming the ps
    python ps_faults.py OUT backup            sync, 2 of 3 gradients per step; worker 2
                                              pushes each gradient only after its step was
                                              applied without it (so never in time)
Writes OUT/<task>.json (iterations, dropped, loss) when training ends; in backup, worker 0
also writes OUT/steps.npz: the weights before and after each step, and the gradient of each
worker's rows at the weights before it, from a plain Keras copy of the model.
"""

import json
import os
import signal
import sys
import time

import numpy as np

import tfstrat

out, scenario = sys.argv[1], sys.argv[2]
timeout = float(sys.argv[3]) if len(sys.argv) > 3 else 60
strategy = tfstrat.ParameterServer(
    replicas_to_aggregate=2 if scenario == "backup" else None, timeout=timeout
)

import keras  # noqa: E402
from common import build_model, compile_model, data, optimizer, ps_pid  # noqa: E402

if scenario == "backup" and strategy.worker_index == 2:
    # Held back: each push waits, in the step's graph, until that step was applied without it,
    # so the test of backup workers does not depend on timing.
    import tensorflow as tf

    sync, push = strategy.sync, strategy.sync.push

    def held_push(grads_and_vars, rows=None, asks=None):
        step = sync._step
        left_out, _ = sync.steps.wait_applied(
            step, lambda s, _: f"held worker 2: step {s} never applied"
        )
        with tf.control_dependencies([left_out]):  # every op of the push, its mail included
            return push(grads_and_vars, rows, asks)

    sync.push = held_push


class KillPsAtStep(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 5 and strategy.worker_index == 0:
            print(f"worker 0 kills ps:0 now, at {time.time()}", flush=True)  # the fault's clock
            os.kill(ps_pid(), signal.SIGKILL)


# Reading by file is not supported under ParameterServer: an explicit FILE policy is refused.
import tensorflow as tf  # noqa: E402

by_file = tf.data.Options()
by_file.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.FILE
try:
    strategy.experimental_distribute_dataset(
        tf.data.Dataset.range(8).batch(4).with_options(by_file)
    )
    file_policy_error = None
except ValueError as e:
    file_policy_error = str(e)


class RecordSteps(keras.callbacks.Callback):
    """On worker 0, whose own gradient every step waits for: the weights at a batch's begin
    are those the step reads, at its end those the step wrote."""

    def __init__(self):
        super().__init__()
        self.plain = build_model()  # outside the scope: one device, no tfstrat
        self.loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.arrays = {}

    def on_train_batch_begin(self, batch, logs=None):
        weights = self.model.get_weights()
        self.plain.set_weights(weights)
        for w in range(3):  # worker w trains on rows [8w, 8w + 8) of each batch of 24
            at = batch * 24 + w * 8
            with tf.GradientTape() as tape:
                loss = self.loss(y[at : at + 8], self.plain(x[at : at + 8], training=True))
            grads = tape.gradient(loss, self.plain.trainable_variables)
            for k, g in enumerate(grads):
                self.arrays[f"step{batch}/grad{w}/{k}"] = tf.convert_to_tensor(g).numpy()
        for k, value in enumerate(weights):
            self.arrays[f"step{batch}/before/{k}"] = value

    def on_train_batch_end(self, batch, logs=None):
        for k, value in enumerate(self.model.get_weights()):
            self.arrays[f"step{batch}/after/{k}"] = value


steps = 200 if scenario == "kill-ps" else 20
x, y = data(24 * steps)
with strategy.scope():
    model = compile_model(build_model(), optimizer("sgd"))
callbacks = [KillPsAtStep()] if scenario == "kill-ps" else []
record = RecordSteps() if scenario == "backup" and strategy.worker_index == 0 else None
callbacks += [record] if record else []
history = model.fit(x, y, batch_size=24, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
if scenario == "kill-ps":
    print("training finished, which it must not")
task = os.environ["TFSTRAT_TASK"].replace(":", "_")
if record is not None:
    np.savez(os.path.join(out, "steps.npz"), **record.arrays)
with open(os.path.join(out, f"{task}.json"), "w") as f:
    json.dump(
        {
            "iterations": int(model.optimizer.iterations.numpy()),
            "dropped": strategy.dropped,
            "loss": history.history["loss"],
            "file_policy_error": file_policy_error,
        },
        f,
    )
