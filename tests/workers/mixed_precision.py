"""Loss scaling with one replica's overflow, and bfloat16, under a strategy or on one device.

Usage:
    python mixed_precision.py OUT reference|mirrored|modelparallel POLICY...
                              one process (mirrored: MirroredNCCL on 2 logical CPUs;
                              modelparallel: a (2, 2) mesh of 4, the table split)
    python mixed_precision.py OUT collective|hybrid|ps|localsgd [--sync-every N] POLICY...
                                                                 a worker (tfstrat launch)
    python mixed_precision.py OUT collective-fp16 float32
                              a worker of CollectiveAllReduce(compression="fp16"); row 47
                              holds 5e4, whose scaled gradient is finite in float32 and
                              overflows only the 16-bit wire

POLICY: `mixed_float16` (Keras wraps the optimizer in a LossScaleOptimizer), `float32` (with
a LossScaleOptimizer given explicitly: the same skips, in float32 arithmetic, so a strategy
must equal one device to float32 rounding) or `mixed_bfloat16` (no loss scaling).

The model: Dense(32, relu) beside an Embedding(10, 4), Dense(2), a float32 softmax; SGD(0.05),
global batch 24, 96 rows, 2 epochs, shuffle=False. Row 47 (the last of the second global
batch) holds a feature value large enough to overflow the first Dense (5e4 in float16, 3e38 in
float32) for the replica given that row and no other: one device skips that step each epoch.
Each policy trains with `fit`, then (not under ps and localsgd) the same model again with a
custom loop (TensorFlow's tutorial: `compute_average_loss`, `scale_loss`, `apply`). Writes
OUT/<run>.npz (weights) and OUT/<run>.json (loss scales, iterations, finite).
"""

import argparse
import json
import os

import numpy as np

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument(
    "kind",
    choices=[
        *("reference", "mirrored", "modelparallel", "collective", "collective-fp16"),
        *("hybrid", "ps", "localsgd"),
    ],
)
parser.add_argument("--sync-every", type=int, default=1, help="localsgd: steps between syncs")
parser.add_argument("policies", nargs="+")
args = parser.parse_args()

import tfstrat  # noqa: E402

if args.kind == "mirrored":
    tfstrat.split_cpu(2)
# TFSTRAT_TEST_MESH_DEVICES=gpu: ModelParallel on a (1, 2) mesh of two GPUs (their sums over
# NCCL, bfloat16 carried as float32) instead of (2, 2) logical CPUs.
MESH_GPUS = os.environ.get("TFSTRAT_TEST_MESH_DEVICES") == "gpu"
if args.kind == "modelparallel" and not MESH_GPUS:
    tfstrat.split_cpu(4)


def model_parallel():
    """A (2, 2) mesh: 2 slices of the batch x the table split by rows (vocabulary-parallel);
    (1, 2) of two GPUs under TFSTRAT_TEST_MESH_DEVICES=gpu."""
    if MESH_GPUS:
        mesh = tfstrat.DeviceMesh((1, 2), ["batch", "model"], devices=["gpu:0", "gpu:1"])
    else:
        mesh = tfstrat.DeviceMesh((2, 2), ["batch", "model"])
    layout = tfstrat.LayoutMap(mesh)
    layout["table/embeddings"] = ("model", None)
    return tfstrat.ModelParallel(layout_map=layout, batch_dim_name="batch")


strategy = {
    "reference": lambda: None,
    "mirrored": lambda: tfstrat.MirroredNCCL(timeout=60),
    "modelparallel": model_parallel,
    "collective": lambda: tfstrat.CollectiveAllReduce(timeout=60),
    "collective-fp16": lambda: tfstrat.CollectiveAllReduce(timeout=60, compression="fp16"),
    "hybrid": lambda: tfstrat.Hybrid(timeout=60),
    "ps": lambda: tfstrat.ParameterServer(mode="sync", timeout=60),
    "localsgd": lambda: tfstrat.LocalSGD(sync_every=args.sync_every, timeout=60),
}[args.kind]()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

ROWS, GLOBAL_BATCH, FEATURES = 96, 24, 8
OVERFLOW = {"mixed_float16": 5e4, "float32": 3e38, "mixed_bfloat16": 5e4}
rng = np.random.default_rng(0)
features = rng.normal(size=(ROWS, FEATURES)).astype("float32")
y = (features[:, 0] > 0).astype("int32")
ids = (np.arange(ROWS) % 10).astype("int32")[:, None]
if args.kind == "collective-fp16":
    # Finite in float32 arithmetic; with its label the model gets wrong (a saturated softmax
    # that is right has no gradient), the scaled gradient of row 47 overflows the 16-bit wire.
    OVERFLOW["float32"] = 5e4
    y[47] = 1 - y[47]
strategy_ = strategy or tf.distribute.get_strategy()


def build():
    """Dense(32, relu) on the features, beside an Embedding(10, 4) of the ids (a table Hybrid
    holds on its ps); Dense(2); a float32 softmax."""
    keras.utils.set_random_seed(1)
    features, id_input = keras.Input((FEATURES,)), keras.Input((1,), dtype="int32")
    # Weights of mean 0.2: row 47's 8 features of 5e4 give every unit about 8e4, over
    # float16's 65,504 (of 3e38, over float32's 3.4e38).
    init = keras.initializers.RandomNormal(mean=0.2, stddev=0.1)
    hidden = keras.layers.Dense(32, activation="relu", kernel_initializer=init)(features)
    table = keras.layers.Flatten()(keras.layers.Embedding(10, 4, name="table")(id_input))
    logits = keras.layers.Dense(2)(keras.layers.Concatenate()([hidden, table]))
    outputs = keras.layers.Activation("softmax", dtype="float32")(logits)
    return keras.Model([features, id_input], outputs)


def scale_of(optimizer):
    scale = getattr(optimizer, "dynamic_scale", None)
    return None if scale is None else float(scale.numpy())


def optimizer_for(policy):
    sgd = keras.optimizers.SGD(0.05)
    return keras.optimizers.LossScaleOptimizer(sgd) if policy == "float32" else sgd


def trained_with_fit(policy, x):
    with strategy_.scope():
        model = build()
        model.compile(optimizer=optimizer_for(policy), loss="sparse_categorical_crossentropy")
    scales = []
    record = lambda batch, logs: scales.append(scale_of(model.optimizer))  # noqa: E731
    model.fit(
        x,
        y,
        batch_size=GLOBAL_BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=record)],
    )
    return model, model.optimizer, scales


def trained_with_a_loop(policy, x):
    with strategy_.scope():
        model = build()
        optimizer = optimizer_for(policy)
        if policy == "mixed_float16":
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        optimizer.build(model.trainable_variables)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(reduction=None)

    def replica_step(xb, ib, yb):
        with tf.GradientTape() as tape:
            per_example = loss_fn(yb, model((xb, ib), training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
            scaled = optimizer.scale_loss(loss) if hasattr(optimizer, "scale_loss") else loss
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    @tf.function
    def train_step(batch):
        losses = strategy_.run(replica_step, args=batch)
        return strategy_.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    dataset = tf.data.Dataset.from_tensor_slices((*x, y)).batch(GLOBAL_BATCH)
    if strategy is not None:
        options = tf.data.Options()
        policy_ = tf.data.experimental.AutoShardPolicy.DATA
        options.experimental_distribute.auto_shard_policy = policy_
        dataset = strategy.experimental_distribute_dataset(dataset.with_options(options))
    scales = []
    for _ in range(2):
        for batch in dataset:
            train_step(batch)
            scales.append(scale_of(optimizer))
    return model, optimizer, scales


report, arrays = {}, {}
for policy in args.policies:
    keras.mixed_precision.set_global_policy(policy)
    x = features.copy()
    x[47] = OVERFLOW[policy]
    loops = args.kind not in ("ps", "localsgd")  # their custom loops: not their protocol
    runs = [("fit", trained_with_fit)] + ([("loop", trained_with_a_loop)] if loops else [])
    for how, train in runs:
        model, optimizer, scales = train(policy, (x, ids))
        report[f"{policy}/{how}"] = {
            "optimizer": type(optimizer).__name__,
            "scales": scales,
            "iterations": int(optimizer.iterations.numpy()),
            "finite": bool(all(np.isfinite(w).all() for w in model.get_weights())),
        }
        for i, w in enumerate(model.get_weights()):
            arrays[f"{policy}/{how}/w{i}"] = w
keras.mixed_precision.set_global_policy("float32")

task = os.environ.get("TFSTRAT_TASK", args.kind).replace(":", "_")
one_process = ("reference", "mirrored", "modelparallel")
name = args.kind if args.kind in one_process else f"{args.kind}_{task}"
if args.kind == "localsgd":
    name = f"localsgd{args.sync_every}_{task}"
np.savez(os.path.join(args.out, f"{name}.npz"), **arrays)
with open(os.path.join(args.out, f"{name}.json"), "w") as f:
    json.dump(report, f, indent=1)
print("done", json.dumps(report))
