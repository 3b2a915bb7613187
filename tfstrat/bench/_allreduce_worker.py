"""One all-reduce benchmark process: times SUM all-reduces of float32 tensors of many sizes.

    python -m tfstrat.bench._allreduce_worker '{"impl": "tfstrat", "sizes": [4, 1024], "iters": 10}'

`impl`: "tfstrat" (CollectiveAllReduce's replica-context all-reduce, the path gradients take:
its own ring on CPU workers; shared memory between two workers on one machine), "tfstrat-tcp"
(the same with TFSTRAT_RING_SHARED_MEMORY=0: TCP alone, as between two machines), "tfstrat-grpc" (the same over TensorFlow's collectives,
`communication="ring"`) or "stock" (tf.distribute.MultiWorkerMirroredStrategy). One thread in
each TensorFlow pool, as in the training benchmarks. Prints `RESULT {json}`.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time


def main(config: dict) -> dict:
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    if config["impl"].startswith("tfstrat"):
        import tfstrat

        communication = "ring" if config["impl"] == "tfstrat-grpc" else "auto"  # -tcp: env
        strategy = tfstrat.CollectiveAllReduce(timeout=120, communication=communication)
    else:
        # TensorFlow's defaults: timeout_seconds would start a thread per collective op.
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    results = []
    empty = tf.function(lambda: tf.numpy_function(lambda: np.int32(0), [], tf.int32, stateful=True))
    for _ in range(3):
        empty()
    seconds = []
    for _ in range(200):
        start = time.perf_counter()
        empty().numpy()
        seconds.append(time.perf_counter() - start)
    empty_step = statistics.median(seconds)
    for size in config["sizes"]:
        with strategy.scope():
            value = tf.ones([max(1, size // 4)], tf.float32)

        def replica_fn(v=value):
            summed = tf.distribute.get_replica_context().all_reduce("SUM", tf.identity(v))
            return summed[-1]  # waits for the whole sum without copying it out of TensorFlow

        step = tf.function(lambda fn=replica_fn: strategy.run(fn))

        for _ in range(3):  # trace and warm up
            step()
        seconds = []
        for _ in range(int(config["iters"])):
            start = time.perf_counter()
            out = step()
            last = strategy.experimental_local_results(out)[0].numpy()
            seconds.append(time.perf_counter() - start)
        if last != strategy.num_replicas_in_sync:  # a sum of ones: one per replica
            raise SystemExit(f"{config['impl']}: the sum of {size} bytes of ones ended in {last}")
        results.append({"bytes": size, "seconds": statistics.median(seconds)})
    return {
        "impl": config["impl"],
        "workers": strategy.num_replicas_in_sync,
        "sizes": results,
        "empty_step_s": empty_step,
    }


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    result["task"] = os.environ.get("TFSTRAT_TASK", "worker:0")
    print("RESULT " + json.dumps(result), flush=True)
