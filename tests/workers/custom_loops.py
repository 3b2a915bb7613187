"""TensorFlow's custom-training-loop tutorials, written as their users write them, under one
strategy (run by `tfstrat launch`, or in one process) or on one device (`--strategy none`).

Usage:
    python custom_loops.py OUT --strategy NAME [--cases a,b,...]
writes OUT/<task>.json (one device: OUT/reference.json): for each case, the final trainable weights (as lists), the losses the
loop computed and what the strategy's API said. NAME is none or none-sparse (one device, no
tfstrat; below),
mirrored, collective, hybrid, ps-sync, ps-async, localsgd, localsgd-k, model-parallel (one
process), model-parallel-workers.

The cases (each builds its model and optimizer afresh, from the same seed):
- dataset: `experimental_distribute_dataset(ds.batch(GLOBAL))`, 2 epochs; the last global
  batch is partial; `strategy.gather`, `experimental_local_results`, `num_replicas_in_sync`.
- function: `distribute_datasets_from_function` with the InputContext's per-replica batch and
  shard, 2 epochs.
- inner: several steps per `tf.function` call (`tf.range` over a distributed iterator).
- eval: an evaluation loop (`strategy.run(eval_step)`, metrics built in the scope).
- checkpoint: Adagrad (a slot per variable); after epoch 1 a `tf.train.CheckpointManager` saves (the
  chief into OUT/ckpt, the others into their own scratch directory), a new model and optimizer
  restore it, and epoch 2 trains on.
- two_optimizers: a second optimizer made in the scope after the one the loop applies (Hybrid
  with a ps refuses it by name).
- fit_step: keras.io's "Customizing what happens in fit()": a Model subclass whose own
  `train_step` computes `self.compute_loss` and calls `self.optimizer.apply`, trained by `fit`.
"""

import argparse
import json
import os
import tempfile
import time

import numpy as np

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--strategy", required=True)
parser.add_argument("--lr", type=float, default=0.1, help="the loops' SGD learning rate")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--cases", default="dataset,function,inner,eval,checkpoint,fit_step")
args = parser.parse_args()
CASES = args.cases.split(",")

import tfstrat  # noqa: E402


def make_strategy(name):
    if name in ("none", "none-sparse"):
        return None
    if name == "mirrored":
        tfstrat.split_cpu(2)
        return tfstrat.MirroredNCCL(timeout=60)
    if name == "collective":
        return tfstrat.CollectiveAllReduce(timeout=60)
    if name == "hybrid":
        return tfstrat.Hybrid(timeout=60)
    if name in ("ps-sync", "ps-async"):
        return tfstrat.ParameterServer(mode=name[3:], timeout=60)
    if name == "localsgd":
        return tfstrat.LocalSGD(sync_every=1, timeout=60)
    if name == "localsgd-k":
        return tfstrat.LocalSGD(sync_every=3, timeout=60)
    if name.startswith("model-parallel"):
        if name == "model-parallel":  # one process of four logical CPUs, FSDP too
            tfstrat.split_cpu(4)
            mesh = tfstrat.DeviceMesh((2, 2), ["batch", "model"])
            fsdp = "batch"
        else:  # model-parallel-workers: the batch across 2 workers, the model over 2 CPUs each
            tfstrat.split_cpu(2)
            mesh = tfstrat.DeviceMesh((2, 2), ["batch", "model"])
            fsdp = None  # across workers: not yet
        layout = tfstrat.LayoutMap(mesh)
        layout["tokens/embeddings"] = (fsdp, None)  # the table's rows over the batch axis
        layout["hidden/kernel"] = (fsdp, "model")  # column-parallel
        layout["hidden/bias"] = ("model",)
        layout["logits/kernel"] = ("model", fsdp)  # row-parallel
        return tfstrat.ModelParallel(layout_map=layout, batch_dim_name="batch")
    raise SystemExit(f"unknown strategy {name!r}")


strategy = make_strategy(args.strategy)  # before any other TensorFlow op

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from common import CLASSES, SEQ, VOCAB, data  # noqa: E402

# One device: row gradients densified (tfstrat sums an embedding row's repeats before the
# optimizer sees them, the dense update's semantics; Keras's sparse Adagrad steps each repeat),
# or as Keras has them (`none-sparse`: what ModelParallel reproduces).
DENSIFY = args.strategy == "none"
strategy = strategy or tf.distribute.get_strategy()
SUM = tf.distribute.ReduceOp.SUM
GLOBAL = 16
EXAMPLES = GLOBAL * 6 + 12  # six whole global batches and a partial one (no replica empty)
x, y = data(EXAMPLES)
task = os.environ.get("TFSTRAT_TASK", "reference").replace(":", "_")


def dataset():
    return tf.data.Dataset.from_tensor_slices((x, y))


def build_model():
    """common.build_model's model (the same initial weights), its layers named for the layout."""
    keras.utils.set_random_seed(7)
    inputs = keras.Input((SEQ,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 8, name="tokens")(inputs)
    h = keras.layers.Conv1D(8, 3, activation="relu", name="conv")(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(16, activation="relu", name="hidden")(h)
    return keras.Model(inputs, keras.layers.Dense(CLASSES, name="logits")(h))


def build(optimizer):
    with strategy.scope():
        model = build_model()
        return model, optimizer()


def loss_fn(labels, logits):
    per_example = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
    return tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL)


def trainer(model, optimizer):
    """The tutorial's `train_step` and the `tf.function` that runs it on every replica."""

    def train_step(inputs):
        features, labels = inputs
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(features, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        if DENSIFY:
            grads = [
                tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads
            ]
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def distributed_train_step(inputs):
        per_replica = strategy.run(train_step, args=(inputs,))
        return strategy.reduce(SUM, per_replica, axis=None)

    return train_step, distributed_train_step


def weights(model):
    return [np.asarray(w.numpy()).tolist() for w in model.trainable_weights]


def epochs(step, make_input, n=2):
    losses = []
    for _ in range(n):
        total = 0.0
        for batch in make_input():
            total += float(step(batch))
        losses.append(total)
    return losses


def wait_for_checkpoint(directory, timeout=60):
    """The chief's checkpoint, once it is written (the other workers reach here first)."""
    deadline = time.monotonic() + timeout
    while (path := tf.train.latest_checkpoint(directory)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no checkpoint from the chief in {directory} after {timeout} s")
        time.sleep(0.1)
    return path


def sgd():
    return keras.optimizers.SGD(args.lr)


report = {"num_replicas_in_sync": strategy.num_replicas_in_sync}


def mean_loss(model):
    """The model's mean loss over every example (eagerly)."""
    per_example = keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True)
    return float(tf.reduce_mean(per_example))


if "dataset" in CASES:
    model, optimizer = build(sgd)
    _, step = trainer(model, optimizer)
    initial_loss = mean_loss(model)
    losses = epochs(
        step, lambda: strategy.experimental_distribute_dataset(dataset().batch(GLOBAL)), args.epochs
    )
    first = next(iter(strategy.experimental_distribute_dataset(dataset().batch(GLOBAL))))
    gathered = strategy.gather(first[1], axis=0)
    report["dataset"] = {
        "weights": weights(model),
        "losses": losses,
        "iterations": int(optimizer.iterations.numpy()),
        "gathered_labels": np.asarray(gathered).tolist(),
        "local_results": len(strategy.experimental_local_results(first[1])),
    }
    if args.strategy == "ps-async":  # the ps's count, once every worker's steps are in
        deadline = time.monotonic() + 60
        expected = strategy.num_workers * -(-EXAMPLES // GLOBAL) * len(losses)
        while int(optimizer.iterations.numpy()) < expected and time.monotonic() < deadline:
            time.sleep(0.1)
        report["dataset"]["final_iterations"] = int(optimizer.iterations.numpy())
        report["dataset"]["loss_before_after"] = [initial_loss, mean_loss(model)]

if "function" in CASES:
    model, optimizer = build(sgd)
    _, step = trainer(model, optimizer)
    contexts = []

    def dataset_fn(input_context):
        contexts.append(
            (
                input_context.num_input_pipelines,
                input_context.input_pipeline_id,
                input_context.get_per_replica_batch_size(GLOBAL),
            )
        )
        ds = dataset().shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        return ds.batch(input_context.get_per_replica_batch_size(GLOBAL))

    losses = epochs(step, lambda: strategy.distribute_datasets_from_function(dataset_fn))
    report["function"] = {"weights": weights(model), "losses": losses, "contexts": contexts}

if "inner" in CASES:
    model, optimizer = build(sgd)
    train_step, _ = trainer(model, optimizer)

    @tf.function
    def multi_step(iterator, steps):
        total = tf.constant(0.0)
        for _ in tf.range(steps):
            per_replica = strategy.run(train_step, args=(next(iterator),))
            total += strategy.reduce(SUM, per_replica, axis=None)
        return total

    whole = GLOBAL * 6
    ds = tf.data.Dataset.from_tensor_slices((x[:whole], y[:whole])).batch(GLOBAL)
    losses = []
    for _ in range(2):
        iterator = iter(strategy.experimental_distribute_dataset(ds))
        losses.append(float(multi_step(iterator, tf.constant(3))))
        losses.append(float(multi_step(iterator, tf.constant(3))))
    report["inner"] = {"weights": weights(model), "losses": losses}

if "eval" in CASES:
    model, optimizer = build(sgd)
    _, step = trainer(model, optimizer)
    with strategy.scope():
        accuracy = keras.metrics.SparseCategoricalAccuracy()
        mean_loss = keras.metrics.Mean()

    @tf.function
    def distributed_eval_step(inputs):
        def eval_step(inputs):
            features, labels = inputs
            logits = model(features, training=False)
            accuracy.update_state(labels, logits)
            mean_loss.update_state(
                keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
            )

        strategy.run(eval_step, args=(inputs,))

    epochs(step, lambda: strategy.experimental_distribute_dataset(dataset().batch(GLOBAL)), n=1)
    for batch in strategy.experimental_distribute_dataset(dataset().batch(GLOBAL)):
        distributed_eval_step(batch)
    report["eval"] = {
        "weights": weights(model),
        "accuracy": float(accuracy.result()),
        "loss": float(mean_loss.result()),
    }

if "checkpoint" in CASES:

    def adagrad():  # with a slot; a ps updates a table's rows with it exactly (SGD too)
        return keras.optimizers.Adagrad(0.1)

    def distributed():
        return strategy.experimental_distribute_dataset(dataset().batch(GLOBAL))

    model, optimizer = build(adagrad)
    _, step = trainer(model, optimizer)
    losses = epochs(step, distributed, n=1)
    saved = weights(model)
    directory = os.path.join(args.out, "ckpt")
    if not strategy.extended.should_checkpoint:  # the tutorial's pattern: a scratch copy
        directory = tempfile.mkdtemp(prefix=f"ckpt-{task}-")
    manager = tf.train.CheckpointManager(
        tf.train.Checkpoint(model=model, optimizer=optimizer), directory, max_to_keep=1
    )
    manager.save()
    model, optimizer = build(adagrad)  # as a restarted job would
    _, step = trainer(model, optimizer)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    if not strategy.extended.should_checkpoint:
        # A worker that restores late: the chief's first step waits for it, and no write of
        # that step (the iteration counter's neither) may land before this restore does.
        time.sleep(1.0)
    checkpoint.restore(wait_for_checkpoint(os.path.join(args.out, "ckpt")))
    restored = weights(model)
    losses += epochs(step, distributed, n=1)
    report["checkpoint"] = {
        "weights": weights(model),
        "losses": losses,
        "restored_equal_saved": all(
            np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(saved, restored)
        ),
        "iterations": int(optimizer.iterations.numpy()),
    }

if "two_optimizers" in CASES:  # the table's optimizer is not the latest made in the scope
    with strategy.scope():
        model = build_model()
        optimizer = keras.optimizers.SGD(args.lr, name="first")
        later = keras.optimizers.SGD(args.lr, name="second")  # noqa: F841 (kept alive)
    _, step = trainer(model, optimizer)
    epochs(step, lambda: strategy.experimental_distribute_dataset(dataset().batch(GLOBAL)), 1)

if "fit_step" in CASES:  # keras.io "Customizing what happens in fit()": its own train_step

    class CustomModel(keras.Model):
        def train_step(self, data):
            features, labels = data
            with tf.GradientTape() as tape:
                predictions = self(features, training=True)
                loss = self.compute_loss(y=labels, y_pred=predictions)
            gradients = tape.gradient(loss, self.trainable_variables)
            if DENSIFY:
                gradients = [
                    tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                    for g in gradients
                ]
            self.optimizer.apply(gradients, self.trainable_variables)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(labels, predictions)
            return {m.name: m.result() for m in self.metrics}

    with strategy.scope():
        plain = build_model()
        model = CustomModel(plain.inputs, plain.outputs)
        model.compile(
            optimizer=keras.optimizers.SGD(args.lr),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    model.fit(x, y, batch_size=GLOBAL, epochs=2, shuffle=False, verbose=0)
    report["fit_step"] = {
        "weights": weights(model),
        "iterations": int(model.optimizer.iterations.numpy()),
    }

with open(os.path.join(args.out, f"{task}.json"), "w") as f:
    json.dump(report, f)
print("CUSTOM-LOOPS-DONE", task)
