"""ModelParallel against single-device training, on logical CPU devices (on GPUs with
TFSTRAT_TEST_MESH_DEVICES=gpu: the GPU tier).

Usage: python model_parallel_equiv.py MODEL MESHES OPTIMIZERS OUT.json [--checkpoints]
  MODEL: mlp | transformer | transformer-fsdp (weights sharded over the batch axis too, with an
  L2 penalty) | llama | gemma | qwen (keras-hub's, under their own layout maps);
  MESHES: e.g. "1x2,2x1,2x2"; OPTIMIZERS: e.g. "sgd,adam".
  Under `tfstrat launch --workers 2` (TF_CONFIG set): MESHES is one mesh over every worker's
  devices (the CPU split alike on each), created first, and each worker writes OUT.<rank>.

For each optimizer, trains the model on one device, then under ModelParallel on each mesh (the
CPU split into 4 logical devices, the mesh over the first ones), from the same initial weights
on the same global batches, and writes per case: the largest difference of the final weights
and of the optimizer's variables, of predict's outputs and evaluate's loss, and the bytes each
device holds of every split variable and slot (read from the devices' own variables).
With --checkpoints (first mesh, first optimizer): model.save loads into plain Keras, plain Keras
weights load into the sharded model, and BackupAndRestore resumes where an uninterrupted run
ends.
"""

import hashlib
import json
import os
import sys
import tempfile

import numpy as np

import tfstrat

ON_WORKERS = bool(os.environ.get("TF_CONFIG"))
if ON_WORKERS:  # the mesh's devices over the workers: as many on each
    _cluster = json.loads(os.environ["TF_CONFIG"])["cluster"]
    _workers = len(_cluster.get("chief", [])) + len(_cluster.get("worker", []))
    _size = int(np.prod([int(n) for n in sys.argv[2].split("x")]))
    tfstrat.split_cpu(_size // _workers)
elif os.environ.get("TFSTRAT_TEST_MESH_DEVICES") == "gpu":  # the GPU tier: the mesh on GPUs
    pass
else:
    tfstrat.split_cpu(4)

import graphs  # noqa: E402
import keras  # noqa: E402

MODEL, MESHES, OPTIMIZERS, OUT = sys.argv[1:5]
HUB = {}  # keras-hub's backbones with a get_layout_map, built from config: class, LM, arguments
if MODEL in ("llama", "gemma", "qwen"):
    import keras_hub

    HUB = {
        "llama": (keras_hub.models.LlamaBackbone, keras_hub.models.LlamaCausalLM, {}),
        "gemma": (keras_hub.models.GemmaBackbone, keras_hub.models.GemmaCausalLM, {"head_dim": 4}),
        "qwen": (keras_hub.models.QwenBackbone, keras_hub.models.QwenCausalLM, {}),
    }
CHECKPOINTS = "--checkpoints" in sys.argv
BATCH, EPOCHS = 8, 2


def optimizer(name):
    if name == "sgd":
        return keras.optimizers.SGD(0.05, momentum=0.9)
    if name == "adam":
        return keras.optimizers.Adam(0.01)
    if name == "adam-clip":
        return keras.optimizers.Adam(0.01, global_clipnorm=0.5)
    raise ValueError(name)


def data():
    rng = np.random.default_rng(0)
    if MODEL == "mlp":
        x = rng.normal(size=(44, 12)).astype("float32")
        return x, rng.integers(0, 4, size=(44,))
    ids = rng.integers(1, 48, size=(28, 8)).astype("int32")
    y = np.roll(ids, -1, axis=1)
    if MODEL in HUB:
        return {"token_ids": ids, "padding_mask": np.ones_like(ids, dtype=bool)}, y
    return ids, y


def build(opt):
    keras.utils.set_random_seed(1)
    if MODEL == "mlp":
        inputs = keras.Input((12,))
        h = keras.layers.Dense(16, activation="relu", name="up")(inputs)
        h = keras.layers.Dense(12, name="down")(h)
        h = keras.layers.LayerNormalization(name="norm")(h)
        model = keras.Model(inputs, keras.layers.Dense(4, name="head")(h))
    elif MODEL.startswith("transformer"):
        vocab, dim = 48, 16
        penalty = keras.regularizers.L2(1e-3) if MODEL == "transformer-fsdp" else None
        ids = keras.Input((8,), dtype="int32")
        x = keras.layers.Embedding(vocab, dim, name="tokens")(ids)
        a = keras.layers.MultiHeadAttention(4, 4, name="attention")(x, x, use_causal_mask=True)
        x = keras.layers.LayerNormalization(name="norm1")(x + a)
        f = keras.layers.Dense(32, activation="gelu", name="ff_up", kernel_regularizer=penalty)(x)
        f = keras.layers.Dense(dim, name="ff_down")(f)
        x = keras.layers.LayerNormalization(name="norm2")(x + f)
        model = keras.Model(ids, keras.layers.Dense(vocab, name="logits")(x))
    else:
        backbone_class, lm_class, extra = HUB[MODEL]
        backbone = backbone_class(
            vocabulary_size=48,
            num_layers=2,
            num_query_heads=4,
            hidden_dim=16,
            intermediate_dim=32,
            num_key_value_heads=2,
            dropout=0,
            **extra,
        )
        model = lm_class(backbone=backbone, preprocessor=None)
    model.compile(
        optimizer=optimizer(opt),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["accuracy"],
    )
    return model


def layout_map(mesh):
    if MODEL in HUB:  # the backbone's own layout map (keras-hub's FSDP entries included)
        return HUB[MODEL][0].get_layout_map(
            mesh, model_parallel_dim_name="model", data_parallel_dim_name="batch"
        )
    layout = tfstrat.LayoutMap(mesh)
    if MODEL == "mlp":
        layout["up/kernel"] = (None, "model")  # column-parallel
        layout["up/bias"] = ("model",)
        layout["down/kernel"] = ("model", None)  # row-parallel
        return layout
    if MODEL == "transformer-fsdp":  # every weight sharded over the batch axis too
        layout["tokens/embeddings"] = ("model", "batch")
        layout["attention/(query|key|value)/kernel"] = ("batch", "model", None)
        layout["attention/(query|key|value)/bias"] = ("model", None)
        layout["attention/attention_output/kernel"] = ("model", None, "batch")
        layout["norm1/gamma"] = ("batch",)
        layout["ff_up/kernel"] = ("batch", "model")
        layout["ff_up/bias"] = ("model",)
        layout["ff_down/kernel"] = ("model", "batch")
        layout["logits/kernel"] = ("batch", "model")
        layout["logits/bias"] = ("batch",)
        return layout
    layout["tokens/embeddings"] = ("model", None)  # vocabulary-parallel
    layout["attention/(query|key|value)/kernel"] = (None, "model", None)  # by heads
    layout["attention/(query|key|value)/bias"] = ("model", None)
    layout["attention/attention_output/kernel"] = ("model", None, None)
    layout["ff_up/kernel"] = (None, "model")
    layout["ff_up/bias"] = ("model",)
    layout["ff_down/kernel"] = ("model", None)
    layout["logits/kernel"] = (None, "model")
    return layout


def strategy_for(shape):
    """(ModelParallel on a mesh of `shape`, its layout map)."""
    if ON_WORKERS:  # every worker's devices, by rank
        mesh = tfstrat.DeviceMesh(shape, ["batch", "model"])
    else:
        kind = "GPU" if os.environ.get("TFSTRAT_TEST_MESH_DEVICES") == "gpu" else "CPU"
        devices = [f"/device:{kind}:{i}" for i in range(int(np.prod(shape)))]
        mesh = tfstrat.DeviceMesh(shape, ["batch", "model"], devices=devices)
    layout = layout_map(mesh)
    return tfstrat.ModelParallel(layout_map=layout, batch_dim_name="batch"), layout


if ON_WORKERS:  # the strategy first, before any TensorFlow op
    (ONLY,) = MESHES.split(",")
    WORKER_STRATEGY, WORKER_LAYOUT = strategy_for(tuple(int(s) for s in ONLY.split("x")))


def same_weights(opt, model):
    """predict of a model built without the strategy, holding `model`'s weights."""
    plain = build(opt)
    plain.set_weights(model.get_weights())
    return plain.predict(x, batch_size=BATCH, verbose=0)


def diff(a, b) -> float:
    """The largest difference of two lists of arrays or variables, which must be as long and,
    for variables, hold the same paths in the same order (a missing or extra optimizer variable
    is an error, not a shorter comparison). An optimizer variable's path is compared without
    the optimizer's own name (`adam/` and `adam_1/` are two instances' prefixes)."""
    a, b = list(a), list(b)
    names = [[getattr(v, "path", "").split("/", 1)[-1] for v in side] for side in (a, b)]
    if len(a) != len(b) or names[0] != names[1]:
        raise SystemExit(
            f"diff: the lists differ: {len(a)} entries {names[0]}, {len(b)} {names[1]}"
        )
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))


def planned(model, layout, shape) -> list:
    """What the layout map asks for, read from the map alone (its rules matched with
    re.fullmatch, as Keras's LayoutMap does), not from what tfstrat sharded: (path, whole bytes,
    [devices of the model axis, of the batch axis]) of every model variable and optimizer
    variable split at least two ways. An optimizer slot follows its variable (Keras names it
    `<optimizer>/<variable path with _ for />_<slot>`)."""
    import re

    batch, model_axis = shape

    def ways(path):
        rules = [k for k in layout.keys() if re.fullmatch(k, path)]
        if not rules:
            return [1, 1]
        axes = tuple(getattr(layout[rules[0]], "axes", layout[rules[0]]))
        return [model_axis if "model" in axes else 1, batch if "batch" in axes else 1]

    weights = {v.path: ways(v.path) for v in model.weights}
    out = []
    for v in list(model.weights) + list(model.optimizer.variables):
        split = weights.get(v.path)
        if split is None:  # a slot: the variable whose name it carries, the longest match
            name = v.path.split("/", 1)[-1]
            owners = [p for p in weights if name.startswith(p.replace("/", "_") + "_")]
            split = weights[max(owners, key=len)] if owners else [1, 1]
        if split[0] * split[1] > 1:
            out.append([v.path, int(np.prod(v.shape)) * 4, split])
    return out


def held(model) -> list:
    """(path, whole bytes, [[device, bytes it holds]], [devices of the model axis, of the batch
    axis it is sharded over]) of every sharded variable and slot, read from the devices' own
    variables."""
    from tfstrat.mesh.variables import is_sharded

    out = []
    for v in list(model.weights) + list(model.optimizer.variables):
        if is_sharded(v):
            parts = v._value.values
            out.append(
                [
                    v.path,
                    int(np.prod(v.shape)) * 4,
                    [[p.device, int(np.prod(p.shape)) * 4] for p in parts],
                    [v.sharding.parts, v.sharding.batch_parts],
                ]
            )
    return out


x, y = data()
results = {"cases": []}
for opt in OPTIMIZERS.split(","):
    reference = build(opt)
    initial = reference.get_weights()
    reference.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    ref_predict = reference.predict(x, batch_size=BATCH, verbose=0)
    ref_loss = reference.evaluate(x, y, batch_size=BATCH, verbose=0)[0]
    for text in MESHES.split(","):
        shape = tuple(int(s) for s in text.split("x"))
        strategy, layout = (WORKER_STRATEGY, WORKER_LAYOUT) if ON_WORKERS else strategy_for(shape)
        with strategy.scope():
            model = build(opt)
        start = model.get_weights()
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
        results["cases"].append(
            {
                "mesh": text,
                "optimizer": opt,
                "initial": diff(initial, start),
                "weights": diff(reference.get_weights(), model.get_weights()),
                "slots": diff(reference.optimizer.variables, model.optimizer.variables),
                "iterations": int(model.optimizer.iterations.numpy()),
                # predict against one device holding the same (trained) weights: the forward
                # pass alone, without training's float32 drift (which a deep model amplifies)
                "predict": float(
                    np.max(
                        np.abs(
                            same_weights(opt, model) - model.predict(x, batch_size=BATCH, verbose=0)
                        )
                    )
                ),
                "predict_scale": float(np.max(np.abs(ref_predict))),
                "evaluate": abs(ref_loss - model.evaluate(x, y, batch_size=BATCH, verbose=0)[0]),
                "held": held(model),
                "planned": planned(model, layout, shape),
                "graph": graphs.summary(model),
                "digest": hashlib.sha1(
                    b"".join(np.asarray(w).tobytes() for w in model.get_weights())
                ).hexdigest(),
            }
        )
        if CHECKPOINTS and len(results["cases"]) == 1:
            tmp = tempfile.mkdtemp()
            path = os.path.join(tmp, "sharded.keras")
            model.save(path)
            plain = keras.models.load_model(path)
            results["saved_to_plain"] = diff(model.get_weights(), plain.get_weights())
            results["saved_slots_to_plain"] = diff(
                model.optimizer.variables, plain.optimizer.variables
            )
            reference.save(os.path.join(tmp, "plain.keras"))
            with strategy.scope():
                loaded = keras.models.load_model(os.path.join(tmp, "plain.keras"))
            results["plain_to_sharded"] = diff(reference.get_weights(), loaded.get_weights())
            results["plain_to_sharded_slots"] = diff(
                reference.optimizer.variables, loaded.optimizer.variables
            )
            results["loaded_held"] = held(loaded)
            results["loaded_planned"] = planned(loaded, layout, shape)

            class Interrupt(keras.callbacks.Callback):
                def on_epoch_end(self, epoch, logs=None):
                    if epoch == 0:
                        raise KeyboardInterrupt

            backup = os.path.join(tmp, "backup")
            with strategy.scope():
                first = build(opt)
            try:
                first.fit(
                    x,
                    y,
                    batch_size=BATCH,
                    epochs=EPOCHS,
                    shuffle=False,
                    verbose=0,
                    callbacks=[keras.callbacks.BackupAndRestore(backup), Interrupt()],
                )
            except KeyboardInterrupt:
                pass
            with strategy.scope():
                resumed = build(opt)
            trained = []  # the epochs the resumed run trains: [1] if it resumed, [0, 1] if not
            record = keras.callbacks.LambdaCallback(
                on_epoch_begin=lambda e, _, t=trained: t.append(e)
            )
            resumed.fit(
                x,
                y,
                batch_size=BATCH,
                epochs=EPOCHS,
                shuffle=False,
                verbose=0,
                callbacks=[keras.callbacks.BackupAndRestore(backup), record],
            )
            results["resumed_epochs"] = trained
            results["resumed"] = diff(model.get_weights(), resumed.get_weights())
            results["resumed_slots"] = diff(model.optimizer.variables, resumed.optimizer.variables)

if ON_WORKERS:
    OUT = f"{OUT}.{WORKER_STRATEGY.worker_index}"
with open(OUT, "w") as f:
    json.dump(results, f)
