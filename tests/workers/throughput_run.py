"""tfstrat's Throughput callback in one process; prints one `REPORT {json}` line.

    python throughput_run.py OUT_DIR

Runs, each a `fit` of a small model on 640 rows (batch 64, 10 steps, 2 epochs):

- `explicit`: no strategy, `Throughput()` given after a TensorBoard callback (it must still
  run first, so TensorBoard writes its scalar), on a fake clock of 1 s per batch;
- `partial`: the same with 650 rows (a last batch of 10) and `verbose=1` (the progress bar);
- `auto`: under `tfstrat.MirroredNCCL` with `_throughput.install()` and no callbacks;
- `disabled`: the same with `TFSTRAT_THROUGHPUT=0`;
- `dataset`: a `tf.data` dataset without a static batch dimension (steps_per_s), and the same
  with `Throughput(batch_size=64)`.
"""

import json
import logging
import os
import sys
import time

out = sys.argv[1]
import tfstrat  # noqa: E402

strategy = tfstrat.MirroredNCCL()  # first: one CPU device here
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfstrat.keras import _throughput  # noqa: E402
from tfstrat.keras._throughput import Throughput  # noqa: E402

rng = np.random.default_rng(0)
x = rng.normal(size=(650, 16)).astype("float32")
y = (x[:, 0] > 0).astype("int64")


def model():
    m = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8), keras.layers.Dense(2)])
    m.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m


class FakeTime:
    """Throughput's clock in the `explicit` and `partial` runs: it advances exactly 1 s per
    training batch (Clock below), so the rates are exact, not a measure of this machine."""

    now = 1000.0

    def perf_counter(self):
        return self.now

    def __getattr__(self, name):
        return getattr(time, name)


fake = FakeTime()


class Clock(keras.callbacks.Callback):
    """The epochs' training seconds on the fake clock (last in the list: it ticks after
    Throughput has seen the batch)."""

    def on_epoch_begin(self, epoch, logs=None):
        self.start = fake.now

    def on_train_batch_end(self, batch, logs=None):
        fake.now += 1.0
        self.end = fake.now

    def on_train_begin(self, logs=None):
        self.seconds = []

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(self.end - self.start)


class Remember(logging.Handler):
    def emit(self, record):
        messages.append(record.getMessage())


messages = []
logging.getLogger("tfstrat").addHandler(Remember())
report = {}
tb_dir = os.path.join(out, "tb")
_throughput.time = fake
clock = Clock()
tb = keras.callbacks.TensorBoard(tb_dir)
history = model().fit(
    x[:640], y[:640], batch_size=64, epochs=2, verbose=0, callbacks=[tb, Throughput(), clock]
)
report["explicit"] = {"history": history.history, "seconds": clock.seconds}
tags = {}
for root, _, files in os.walk(tb_dir):
    for name in files:
        for event in tf.compat.v1.train.summary_iterator(os.path.join(root, name)):
            for value in event.summary.value:
                tensor = tf.make_ndarray(value.tensor) if value.HasField("tensor") else None
                if tensor is not None and tensor.size == 1 and tensor.dtype.kind == "f":
                    tags.setdefault(f"{os.path.basename(root)}/{value.tag}", []).append(
                        float(tensor)
                    )
report["tensorboard"] = tags

print("PROGRESS BAR BEGIN", flush=True)
clock = Clock()
history = model().fit(x, y, batch_size=64, epochs=1, verbose=1, callbacks=[Throughput(), clock])
print("PROGRESS BAR END", flush=True)
report["partial"] = {"history": history.history, "seconds": clock.seconds}
_throughput.time = time

_throughput.install()
with strategy.scope():
    m = model()
report["auto"] = m.fit(x, y, batch_size=64, epochs=2, verbose=0).history
os.environ["TFSTRAT_THROUGHPUT"] = "0"
report["disabled"] = m.fit(x, y, batch_size=64, epochs=1, verbose=0).history
del os.environ["TFSTRAT_THROUGHPUT"]

dataset = tf.data.Dataset.from_tensor_slices((x[:640], y[:640])).batch(64)
unknown = dataset.map(lambda a, b: (a, b))  # keeps the None batch dimension
report["dataset"] = model().fit(unknown, epochs=1, verbose=0, callbacks=[Throughput()]).history
report["dataset_sized"] = (
    model().fit(unknown, epochs=1, verbose=0, callbacks=[Throughput(batch_size=64)]).history
)
report["log"] = messages
print("REPORT " + json.dumps(report), flush=True)
