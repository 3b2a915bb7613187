"""Reports the CPU allocator TensorFlow uses in this process (tests/test_runtime.py).

Usage: python runtime_probe.py fit | late | create | import | bare
  fit:    import tfstrat, create the strategies first (as the docs say), then fit and evaluate a small model under CollectiveAllReduce (one
          worker), MirroredNCCL (one CPU device) and no strategy; also reports the iterator
          class each strategy feeds its steps from, and each model's largest weight
          difference from the model trained without a strategy.
  late:   run a TensorFlow op before the first strategy (too late to choose the allocator).
  create: import tfstrat and create a MirroredNCCL on /cpu:0 only.
  import: import tfstrat only (which must change nothing: no variable, no TensorFlow import).
  bare:   TensorFlow without tfstrat (what a task gets from its environment alone).
Prints one line: PROBE {"env": ..., "switch": ..., "allocator": "bfc"|"default", "peak": ...}.
"""

import json
import os
import sys

mode = sys.argv[1]
extra = {}
ALLOCATOR, SWITCH = "TF_CPU_ALLOCATOR_USE_BFC", "TFSTRAT_CPU_ALLOCATOR"
if mode != "bare":
    before = dict(os.environ)
    import tfstrat

    extra["import_changed_env"] = sorted(
        k for k in os.environ if os.environ.get(k) != before.get(k)
    )
    extra["import_imported_tensorflow"] = "tensorflow" in sys.modules
if mode == "late":
    import tensorflow as tf

    tf.constant(1.0)
    tfstrat.MirroredNCCL(devices=["/cpu:0"])

if mode == "fit":
    import keras
    import numpy as np
    import tensorflow as tf

    strategies = {
        "car": tfstrat.CollectiveAllReduce(),
        "mirrored": tfstrat.MirroredNCCL(devices=["/cpu:0"]),
        "none": None,
    }
    rng = np.random.default_rng(0)
    x, y = rng.random((40, 4), np.float32), rng.random((40, 1), np.float32)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)  # a partial last batch too
    init = [np.full((4, 1), 0.1, np.float32), np.zeros((1,), np.float32)]
    weights, iterators = {}, {}
    for name, strategy in strategies.items():
        with strategy.scope() if strategy else tf.init_scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.set_weights(init)
            model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse")
        model.fit(ds, epochs=2, verbose=0)
        model.evaluate(ds, verbose=0)
        weights[name] = np.concatenate([w.ravel() for w in model.get_weights()])
        if strategy is not None:  # what feeds a step: a plain iterator or a MultiDeviceIterator
            it = iter(strategy.experimental_distribute_dataset(ds))
            iterators[name] = type(it._iterators[0]._iterator).__name__
    extra = {
        "iterators": iterators,
        "max_diff": {k: float(np.abs(w - weights["none"]).max()) for k, w in weights.items()},
    }
elif mode == "create":
    tfstrat.MirroredNCCL(devices=["/cpu:0"])

import tensorflow as tf  # noqa: E402

try:  # only TensorFlow's BFC allocator keeps statistics
    peak, allocator = tf.config.experimental.get_memory_info("CPU:0")["peak"], "bfc"
except ValueError:
    peak, allocator = None, "default"
report = {
    "env": os.environ.get(ALLOCATOR),
    "switch": os.environ.get(SWITCH),
    "allocator": allocator,
    "peak": peak,
    **extra,
}
print("PROBE " + json.dumps(report), flush=True)
