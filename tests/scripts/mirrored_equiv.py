"""MirroredNCCL on N logical CPU devices against single-device training, in one process.

Usage: python mirrored_equiv.py N SPARSE_AS_DENSE OUT.json
(SPARSE_AS_DENSE: auto, true or false; writes per-optimizer relative errors and what was sent)
"""

import json
import sys

import tfstrat

N, OUT = int(sys.argv[1]), sys.argv[3]
SPARSE_AS_DENSE = {"auto": "auto", "true": True, "false": False}[sys.argv[2]]
tfstrat.split_cpu(N)  # before any TensorFlow op runs

import tensorflow as tf  # noqa: E402
from common import build_model, compile_model, data, optimizer, relative_errors  # noqa: E402

GLOBAL_BATCH, STEPS = 8 * N, 24
x, y = data(GLOBAL_BATCH * STEPS)
strategy = tfstrat.MirroredNCCL(sparse_as_dense=SPARSE_AS_DENSE, timeout=60)
result = {"replicas": strategy.num_replicas_in_sync}
for name in ("sgdm", "adam"):
    weights = {}
    for kind, strat in (("ref", tf.distribute.get_strategy()), ("mirrored", strategy)):
        with strat.scope():
            model = compile_model(build_model(), optimizer(name, densify=kind == "ref"))
        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
        weights[kind] = [v.numpy() for v in model.weights]
        if kind == "mirrored":
            result[f"{name}_iterations"] = int(model.optimizer.iterations.numpy())
            result[f"{name}_evaluate"] = model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0)
            result[f"{name}_predict_rows"] = int(
                model.predict(x, batch_size=GLOBAL_BATCH, verbose=0).shape[0]
            )
    result[name] = relative_errors(weights["mirrored"], weights["ref"])
result["decisions"] = [list(d) for d in strategy.density.decisions]
result["traced"] = strategy.extended._cross_device_ops.traced
json.dump(result, open(OUT, "w"))
print("done", json.dumps(result))
