"""MirroredNCCL on N logical CPU devices, or on every GPU over NCCL (N = gpu), against
single-device training, in one process.

Usage: python mirrored_equiv.py N|gpu SPARSE_AS_DENSE OUT.json
(SPARSE_AS_DENSE: auto, true or false; writes per-optimizer relative errors and what was sent)
"""

import json
import sys

import tfstrat

GPU, OUT = sys.argv[1] == "gpu", sys.argv[3]
SPARSE_AS_DENSE = {"auto": "auto", "true": True, "false": False}[sys.argv[2]]
if GPU:
    N = len(tfstrat.devices().gpus)
else:
    N = int(sys.argv[1])
    tfstrat.split_cpu(N)  # before any TensorFlow op runs

import tensorflow as tf  # noqa: E402

if GPU:  # float32 as on the CPU (TF32 matmuls differ from one device by ~1e-3)
    tf.config.experimental.enable_tensor_float_32_execution(False)
from common import build_model, compile_model, data, optimizer, relative_errors  # noqa: E402

GLOBAL_BATCH, STEPS = 8 * N, 24
x, y = data(GLOBAL_BATCH * STEPS)
strategy = tfstrat.MirroredNCCL(
    sparse_as_dense=SPARSE_AS_DENSE, timeout=60, communication="nccl" if GPU else "auto"
)
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
result["traced"] = getattr(strategy.extended._cross_device_ops, "traced", None)
json.dump(result, open(OUT, "w"))
print("done", json.dumps(result))
