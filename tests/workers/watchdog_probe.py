"""The collectives' watchdog in one process (tests/test_watchdog.py): MirroredNCCL over two
logical CPUs with `timeout=TIMEOUT`.

Usage: python watchdog_probe.py TIMEOUT

1. "long": one call of a function that runs 8 steps (a `tf.range` loop of `strategy.run`),
   each sleeping TIMEOUT / 4 s then all-reducing: the call lasts twice the timeout, but a step
   begins every TIMEOUT / 4 s, so it must not be aborted.
2. "hang": a collective of the two devices that only device 0 joins (its launcher, alone):
   it must fail after about TIMEOUT s with the watchdog's message.

Prints one line: WATCHDOG {"long": {...}, "hang": {...}, "threads": [before, after]}.
"""

import json
import os
import sys
import time

import tfstrat

timeout = float(sys.argv[1])
tfstrat.split_cpu(2)
strategy = tfstrat.MirroredNCCL(["/cpu:0", "/cpu:1"], timeout=timeout)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def slow_step():
    def sleep():
        time.sleep(timeout / 4)
        return np.float32(1.0)

    one = tf.numpy_function(sleep, [], tf.float32, stateful=True)
    one.set_shape([])
    return tf.distribute.get_replica_context().all_reduce("sum", one)


@tf.function
def long_call():
    total = tf.constant(0.0)
    for _ in tf.range(8):
        total += strategy.experimental_local_results(strategy.run(slow_step))[0]
    return total


report = {"threads": [threads()]}
started = time.monotonic()
try:
    report["long"] = {"value": float(long_call()), "seconds": time.monotonic() - started}
except tf.errors.OpError as e:
    report["long"] = {"error": e.message, "seconds": time.monotonic() - started}

launcher = strategy.extended._cross_device_ops._launchers[0]  # device 0's: its partner never joins


@tf.function
def lone():
    with tf.device("/cpu:0"):
        return launcher.all_reduce(tf.ones([4]))


started = time.monotonic()
try:
    lone()
    report["hang"] = {"error": None, "seconds": time.monotonic() - started}
except tf.errors.OpError as e:
    report["hang"] = {"error": e.message, "seconds": time.monotonic() - started}
report["threads"].append(threads())
print("WATCHDOG " + json.dumps(report), flush=True)
