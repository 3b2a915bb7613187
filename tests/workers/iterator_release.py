"""Which thread destroys the dataset iterators of Keras's `fit` (tests/test_runtime.py).

Two logical CPUs; a small model trained 3 epochs (with validation) under stock
`tf.distribute.MirroredStrategy` before any tfstrat strategy exists (Keras untouched), then
under `tfstrat.ModelParallel` on a (2, 1) mesh. Every iterator a distributed dataset makes has
its resource handles watched: each handle's finalizer records the thread it ran on (the thread
that destroyed the resource). Stock's are collected with `gc.collect()`; tfstrat's run with
Python's cyclic collector off, so a handle held in a reference cycle never goes. Waits (up to
30 s) for every watched handle to go.
Prints one line: RELEASE {"stock": [thread names], "tfstrat": [...], "missing": {...}}.
"""

import gc
import json
import os
import sys
import threading
import weakref

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import tfstrat  # noqa: E402

tfstrat.split_cpu(2)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.distribute import input_lib  # noqa: E402

from tfstrat.keras import _release  # noqa: E402

threads: dict[str, list[str]] = {"stock": [], "tfstrat": []}
watched = {"stock": 0, "tfstrat": 0}
changed = threading.Condition()
run = "stock"
keras_iter = input_lib.DistributedDataset.__iter__


def watching_iter(self):
    iterator = keras_iter(self)
    for handle in _release.handles(iterator):
        watched[run] += 1
        weakref.finalize(handle, record, run)
    return iterator


def record(name: str) -> None:
    with changed:
        threads[name].append(threading.current_thread().name)
        changed.notify_all()


input_lib.DistributedDataset.__iter__ = watching_iter


def fit(scope) -> None:
    with scope:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    model.fit(x, y, batch_size=16, epochs=3, validation_data=(x, y), verbose=0)


fit(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope())
gc.collect()  # stock's iterators in reference cycles (a model and its epoch iterators) go now
# tfstrat's must go without the cyclic collector: one that only it frees is destroyed on
# whichever thread it happens to run (the training thread, or one the training waits for).
gc.disable()
run = "tfstrat"
mesh = tfstrat.DeviceMesh((2, 1), ["batch", "model"])
fit(tfstrat.ModelParallel(layout_map=tfstrat.LayoutMap(mesh), batch_dim_name="batch").scope())
with changed:
    changed.wait_for(lambda: all(len(threads[k]) >= watched[k] for k in threads), timeout=30)
missing = {k: watched[k] - len(threads[k]) for k in threads}
print("RELEASE " + json.dumps({**threads, "missing": missing}), flush=True)
# Not Python's exit: with handles still held (what the report shows), it would wait for their
# destructors, up to a minute each.
sys.stderr.flush()
os._exit(0)
