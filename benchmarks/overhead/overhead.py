"""One variant of a small Keras CNN's `fit`, timed on request: a worker process of `run.py`.

Usage: python overhead.py --variant tfmir --threads 1 [--batch 64]
Then, on stdin, one line per measurement: "run STEPS". For each, the process fits STEPS steps
and prints one line "RESULT {json}" with the clock, CPU times and page faults of the steps
after the first (the window leaves out the per-fit iterator set-up and its first prefetch).

Why a process per variant: the allocator state is process-wide. With TensorFlow's default CPU
allocator, a strategy's input thread in a process slows the steps of every model in it, so
"no strategy" must run in a process of its own. `run.py` keeps all variants' processes alive
and asks them in turn, so that the load other processes put on the machine falls on all alike.

Variants: none (no strategy), tfmir (tfstrat.MirroredNCCL on /cpu:0), car
(tfstrat.CollectiveAllReduce, one worker), one (tf.distribute.OneDeviceStrategy), mirrored
(tf.distribute.MirroredStrategy on /cpu:0).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import numpy as np


def build(keras):
    m = keras.Sequential(
        [
            keras.Input((32, 32, 3)),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    m.compile(
        keras.optimizers.SGD(0.01, momentum=0.9),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return m


def strategy(variant: str):
    import tensorflow as tf

    if variant in ("car", "tfmir"):  # "none" is plain Keras: tfstrat not even imported
        import tfstrat

    return {
        "none": lambda: None,
        "car": lambda: tfstrat.CollectiveAllReduce(),
        "tfmir": lambda: tfstrat.MirroredNCCL(devices=["/cpu:0"]),
        "one": lambda: tf.distribute.OneDeviceStrategy("/cpu:0"),
        "mirrored": lambda: tf.distribute.MirroredStrategy(["/cpu:0"]),
    }[variant]()


def setup(variant: str, threads: int, batch: int):
    """(model, dataset), the model compiled under `variant`'s strategy and warmed up."""
    import tensorflow as tf

    if threads:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    import keras

    s = strategy(variant)
    if s is None:
        model = build(keras)
    else:
        with s.scope():
            model = build(keras)
    rng = np.random.default_rng(0)
    x = rng.random((batch * 40, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, batch * 40)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat()
    model.fit(ds, steps_per_epoch=10, epochs=1, verbose=0)  # trace, warm up
    return model, ds


def _now():
    return time.perf_counter(), os.times(), resource.getrusage(resource.RUSAGE_SELF)


def measure(model, ds, steps: int, batch: int) -> dict:
    """Examples/s, CPU ms/step, system ms/step and minor faults/step of steps 2..`steps`,
    and the process's peak resident memory so far."""
    import keras

    class Window(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                self.start = _now()

        def on_train_end(self, logs=None):
            self.end = _now()

    w = Window()
    model.fit(ds, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[w])
    (t0, c0, f0), (t1, c1, f1) = w.start, w.end
    n = steps - 1
    return {
        "ex_s": batch * n / (t1 - t0),
        "cpu_ms": (c1.user + c1.system - c0.user - c0.system) / n * 1000,
        "sys_ms": (c1.system - c0.system) / n * 1000,
        "faults": (f1.ru_minflt - f0.ru_minflt) / n,
        "max_rss_mb": f1.ru_maxrss / 1024,
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variant", required=True)
    p.add_argument("--threads", type=int, default=1, help="intra/inter-op threads; 0 = default")
    p.add_argument("--batch", type=int, default=64)
    a = p.parse_args()
    model, ds = setup(a.variant, a.threads, a.batch)
    print("READY", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd and cmd[0] == "run":
            print("RESULT " + json.dumps(measure(model, ds, int(cmd[1]), a.batch)), flush=True)


if __name__ == "__main__":
    main()
