"""Global batches the replicas cannot split evenly, against single-device training.

Usage:
    python uneven_equiv.py OUT mirrored     one process: MirroredNCCL over 2 and 4 logical
                                            CPUs (OUT/mirrored_<N>.npz)
    python uneven_equiv.py OUT model_parallel  one process: ModelParallel on meshes (4, 1)
                                            and (2, 2) of 4 logical CPUs, the MLP split
                                            (OUT/model_parallel_<B>x<M>.npz), and its
                                            reference (OUT/model_parallel_reference.npz)
    python uneven_equiv.py OUT reference    the single-device reference (OUT/reference.npz)
    python uneven_equiv.py OUT collective   a CollectiveAllReduce worker (`tfstrat launch`)
    python uneven_equiv.py OUT hybrid       a Hybrid worker (`tfstrat launch --ps 1`): also the
                                            "table_*" models, whose table is on the ps
    python uneven_equiv.py OUT ps_sync      a ParameterServer(mode="sync") worker (`--ps 1`)
    [--batches 25,30,31]

For each global batch it trains two models for one epoch on 92 examples (so it ends
with a partial batch: 17, 2 and 30 rows; 2 rows over 3 or 4 replicas leaves some empty):
"sgdm" (SGD with momentum, plain loss) and "adam" (Adam, per-example sample_weight and an L2
regularizer). It records the weights, every step's logs (loss, accuracy), and evaluate.
The reference and Hybrid also train "table_sgd" and "table_adagrad" (sample_weight too): the
same model with a `tfstrat.keras.layers.Embedding`, whose table Hybrid puts on the ps task in
2 parts; their weights are set explicitly (a ps-held table draws its own initial values), the
table is read whole (`layer.embeddings`) and Adagrad's accumulator of the table is recorded.
"""

import argparse
import os

import numpy as np

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument(
    "mode", choices=["reference", "mirrored", "model_parallel", "collective", "hybrid", "ps_sync"]
)
parser.add_argument("--batches", default="25,30,31")
args = parser.parse_args()
BATCHES = [int(b) for b in args.batches.split(",")]
EXAMPLES, EPOCHS = 92, 1

import tfstrat  # noqa: E402

# Created before any other TensorFlow op (collectives are configured at program start; the
# CPU is split before the runtime starts).
if args.mode == "collective":
    cluster_strategy = tfstrat.CollectiveAllReduce(timeout=60)
elif args.mode == "hybrid":
    # Only the "table_*" models' tables on the ps (Hybrid would hold the plain models' stock
    # tables there too, with the lazy row-wise rule their dense-rule reference does not take).
    cluster_strategy = tfstrat.Hybrid(partitions=2, sparse=["table"], timeout=60)
elif args.mode == "ps_sync":
    cluster_strategy = tfstrat.ParameterServer(mode="sync", timeout=60)
else:
    tfstrat.split_cpu(4)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from common import CLASSES, SEQ, VOCAB, data, optimizer  # noqa: E402

DEVICES = [f"/device:CPU:{i}" for i in range(4)]  # the logical CPUs of one-process modes
x, y = data(EXAMPLES)
sample_weight = np.random.default_rng(1).uniform(0.2, 2.0, EXAMPLES).astype("float32")


from tfstrat.keras.layers import Embedding  # noqa: E402

PLAIN = ("sgdm", "adam")
ALL = PLAIN + ("table_sgd", "table_adagrad")


def build(regularized: bool, table: bool = False):
    keras.utils.set_random_seed(7)
    inputs = keras.Input((SEQ,), dtype="int32")
    h = (
        Embedding(VOCAB, 8, name="table")(inputs)
        if table
        else keras.layers.Embedding(VOCAB, 8)(inputs)
    )
    h = keras.layers.Conv1D(8, 3, activation="relu")(h)
    h = keras.layers.Flatten()(h)
    reg = keras.regularizers.L2(1e-2) if regularized else None
    h = keras.layers.Dense(16, activation="relu", kernel_regularizer=reg, name="hidden")(h)
    return keras.Model(inputs, keras.layers.Dense(CLASSES, name="logits")(h))


class StepLogs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.rows = []

    def on_train_batch_end(self, batch, logs=None):
        self.rows.append([float(logs["loss"]), float(logs["accuracy"])])


def set_weights(model):
    """The same initial weights everywhere (every worker sets the same values)."""
    rng = np.random.default_rng(3)
    for layer in model.layers:
        if isinstance(layer, keras.layers.Embedding):
            layer.load_own_variables({"0": rng.uniform(-0.05, 0.05, (VOCAB, 8)).astype("f4")})
            continue
        for w in layer.weights:
            w.assign(rng.normal(0.0, 0.3, w.shape).astype("f4"))


def weights(model) -> list:
    """Every weight, a table read whole (from the ps if it is there); no anchor."""
    out = []
    for layer in model.layers:
        if isinstance(layer, keras.layers.Embedding):
            out.append(np.asarray(layer.embeddings))
        else:
            out += [w.numpy() for w in layer.weights]
    return out


def table_accumulator(model):
    """Adagrad's accumulator of the table, from the ps if it is there."""
    layer = next(la for la in model.layers if isinstance(la, keras.layers.Embedding))
    if getattr(layer, "table_slots", None) is not None:
        store = {}
        layer.table_slots.save_own_variables(store)
        return store["accumulator"]
    opt = model.optimizer
    return opt._accumulators[opt._get_variable_index(layer.embeddings)].numpy()


def train(strategy, reference: bool, models=PLAIN) -> dict:
    results = {}
    for batch in BATCHES:
        for name in models:
            weighted = name != "sgdm"
            table = name.startswith("table_")
            with (strategy or tf.distribute.get_strategy()).scope():
                model = build(regularized=name == "adam", table=table)
                if table:
                    set_weights(model)
                model.compile(
                    optimizer=optimizer(name.removeprefix("table_"), densify=reference),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=["accuracy"],
                )
            steps = StepLogs()
            model.fit(
                x,
                y,
                sample_weight=sample_weight if weighted else None,
                batch_size=batch,
                epochs=EPOCHS,
                shuffle=False,
                verbose=0,
                callbacks=[steps],
            )
            key = f"{batch}/{name}"
            for i, w in enumerate(weights(model)):
                results[f"{key}/w{i}"] = w
            if name == "table_adagrad":
                results[f"{key}/accumulator"] = table_accumulator(model)
            results[f"{key}/steps"] = np.array(steps.rows)
            results[f"{key}/iterations"] = np.array(int(model.optimizer.iterations.numpy()))
            results[f"{key}/evaluate"] = np.array(model.evaluate(x, y, batch_size=batch, verbose=0))
    return results


if args.mode == "reference":
    np.savez(os.path.join(args.out, "reference.npz"), **train(None, True, ALL))
elif args.mode == "mirrored":
    for n in (2, 4):
        strategy = tfstrat.MirroredNCCL(devices=DEVICES[:n], timeout=60)
        np.savez(os.path.join(args.out, f"mirrored_{n}.npz"), **train(strategy, reference=False))
        print("done mirrored", n, flush=True)
elif args.mode == "model_parallel":
    # ModelParallel concatenates the data group's row gradients, as one device's gradient of
    # the whole batch holds them: Keras's own sparse Adam then steps as on one device (the
    # other strategies deduplicate rows: the dense rule, `reference`'s). Its reference is one
    # device with Keras's optimizers as they are.
    np.savez(os.path.join(args.out, "model_parallel_reference.npz"), **train(None, False))
    for shape in ((4, 1), (2, 2)):
        mesh = tfstrat.DeviceMesh(shape, ["batch", "model"], devices=DEVICES[: shape[0] * shape[1]])
        # Megatron's MLP pair, the table by its columns; and every weight but the convolution's
        # kernel sharded over the batch axis too (FSDP): the table by its rows
        layout = tfstrat.LayoutMap(mesh)
        layout["embedding.*/embeddings"] = ("batch", "model")
        layout["conv1d.*/bias"] = ("batch",)
        layout["hidden/kernel"] = ("batch", "model")
        layout["hidden/bias"] = ("model",)
        layout["logits/kernel"] = ("model", "batch")
        strategy = tfstrat.ModelParallel(layout_map=layout, batch_dim_name="batch")
        name = f"model_parallel_{shape[0]}x{shape[1]}"
        np.savez(os.path.join(args.out, f"{name}.npz"), **train(strategy, reference=False))
        print("done", name, flush=True)
else:
    task = os.environ["TFSTRAT_TASK"].replace(":", "_")
    models = ALL if args.mode == "hybrid" else PLAIN
    np.savez(os.path.join(args.out, f"{task}.npz"), **train(cluster_strategy, False, models))
    print("done", task, flush=True)
