"""MirroredNCCL on N logical CPU devices, or on every GPU over NCCL (N = gpu), against
single-device training, in one process.

Usage: python mirrored_equiv.py N|gpu SPARSE_AS_DENSE OUT.json
(SPARSE_AS_DENSE: auto, true or false; writes per-optimizer relative errors and what was sent)
"""

import json
import sys

import numpy as np

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
# "auto" on GPUs too: NCCL is what it chooses there (what ran is NCCL's own log's to say).
strategy = tfstrat.MirroredNCCL(sparse_as_dense=SPARSE_AS_DENSE, timeout=60)
implementation = strategy.extended._communication_options.implementation
result = {"replicas": strategy.num_replicas_in_sync, "transport": implementation.name.lower()}
for name in ("sgdm", "adam"):
    weights, evaluated, predicted = {}, {}, {}
    for kind, strat in (("ref", tf.distribute.get_strategy()), ("mirrored", strategy)):
        with strat.scope():
            model = compile_model(build_model(), optimizer(name, densify=kind == "ref"))
        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
        weights[kind] = [v.numpy() for v in model.weights]
        evaluated[kind] = model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0)
        predicted[kind] = model.predict(x, batch_size=GLOBAL_BATCH, verbose=0)
        if kind == "mirrored":
            result[f"{name}_iterations"] = int(model.optimizer.iterations.numpy())
            result[f"{name}_predict_rows"] = int(predicted[kind].shape[0])
            # Every replica's copy of every variable, not only the one `numpy()` reads.
            copies = [strategy.experimental_local_results(v.value) for v in model.weights]
            result[f"{name}_replica_copies"] = len(copies[0])
            result[f"{name}_replicas"] = [
                max(relative_errors([c[r].numpy() for c in copies], weights["ref"]))
                for r in range(len(copies[0]))
            ]
    result[name] = relative_errors(weights["mirrored"], weights["ref"])
    result[f"{name}_evaluate"] = relative_errors(
        [np.array(evaluated["mirrored"])], [np.array(evaluated["ref"])]
    )
    result[f"{name}_predict"] = relative_errors([predicted["mirrored"]], [predicted["ref"]])
result["decisions"] = [list(d) for d in strategy.density.decisions]
result["traced"] = getattr(strategy.extended._cross_device_ops, "traced", None)
json.dump(result, open(OUT, "w"))
print("done", json.dumps(result))
