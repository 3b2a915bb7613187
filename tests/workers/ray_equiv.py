"""Ray Train running tfstrat strategies, against single-device training (tests/test_ray.py).

Usage: python ray_equiv.py OUT_DIR STRATEGY [STRATEGY ...]
    STRATEGY: collective, hybrid (no ps tasks: Ray starts workers only) or localsgd
Starts a local Ray cluster, runs Ray Train's TensorflowTrainer with 2 workers once per strategy
(Ray writes each worker's TF_CONFIG; the loop creates the strategy first), and writes
OUT_DIR/<strategy>-<worker>.npz (final weights) and OUT_DIR/reference.npz: the same model,
initial weights, batches and SGD on one device, no strategy.
"""

import os
import shutil
import sys
import tempfile

import numpy as np

OUT, STRATEGIES = sys.argv[1], sys.argv[2:]
GLOBAL_BATCH, EPOCHS, VOCAB, SEQ = 32, 2, 50, 4


def data():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, size=(256, SEQ)).astype("int32")
    dense = rng.normal(size=(256, 3)).astype("float32")
    y = (ids.sum(axis=1, keepdims=True) / VOCAB + dense[:, :1]).astype("float32")
    return ids, dense, y


def build():
    """An embedding table (sparse gradients: all-gathered under Hybrid with no ps) and a dense
    head; initial weights from a fixed seed, the same in every process."""
    import keras

    ids = keras.Input((SEQ,), dtype="int32")
    dense = keras.Input((3,))
    table = keras.layers.Embedding(VOCAB, 4, name="table")(ids)
    joined = keras.layers.Concatenate()([keras.layers.Flatten()(table), dense])
    hidden = keras.layers.Dense(8, activation="tanh", name="hidden")(joined)
    model = keras.Model([ids, dense], keras.layers.Dense(1, name="out")(hidden))
    rng = np.random.default_rng(1)
    model.set_weights(
        [rng.normal(scale=0.3, size=w.shape).astype("float32") for w in model.weights]
    )
    model.compile(keras.optimizers.SGD(0.05), "mse")
    return model


def train(model):
    ids, dense, y = data()
    model.fit([ids, dense], y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return {f"w{k}": w for k, w in enumerate(model.get_weights())}


def loop(config):
    import json

    import tfstrat

    kind = config["strategy"]
    if kind == "collective":
        strategy = tfstrat.CollectiveAllReduce(timeout=120)  # first: before any other TF op
    elif kind == "hybrid":
        strategy = tfstrat.Hybrid(timeout=120)
    else:
        strategy = tfstrat.LocalSGD(sync_every=1, timeout=120)  # plain SGD: = synchronous
    with strategy.scope():
        model = build()
    weights = train(model)
    worker = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    np.savez(os.path.join(config["out"], f"{kind}-{worker}.npz"), **weights)


def main():
    np.savez(os.path.join(OUT, "reference.npz"), **train(build()))
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    scratch = tempfile.mkdtemp(prefix="tfsray")  # short: Ray's socket paths live under it
    here = os.path.dirname(os.path.abspath(__file__))
    helpers = os.path.join(os.path.dirname(here), "helpers")
    # The workers' path replaces the inherited one: keep it (scripts/test's ray directory).
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        _temp_dir=scratch,
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([here, helpers, *inherited])}},
    )
    try:
        for kind in STRATEGIES:
            trainer = TensorflowTrainer(
                loop,
                train_loop_config={"strategy": kind, "out": OUT},
                scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
                run_config=RunConfig(storage_path=os.path.join(scratch, "results"), name=kind),
            )
            trainer.fit()
            print(f"ray_equiv: {kind} done", flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
