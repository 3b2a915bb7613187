"""One row of `tfstrat bench model-parallel`, in its own process (the CPU is split first).

Usage: python -m tfstrat.bench._mp_worker '{"mesh": [1, 2], "dim": 128, ...}'
Prints one line `RESULT {...}`: the bytes each device holds (read from the devices'
variables), the bytes moved per step per device (tfstrat's record of the traced step), the
median step time of the timed epochs and the final loss.
"""

from __future__ import annotations

import json
import sys
import time


def build(config: dict):
    import keras

    keras.utils.set_random_seed(1)
    d, vocab, heads = config["dim"], config["vocab"], config["heads"]
    ids = keras.Input((config["seq"],), dtype="int32")
    x = keras.layers.Embedding(vocab, d, name="tokens")(ids)
    for i in range(config["layers"]):
        a = keras.layers.MultiHeadAttention(heads, d // heads, name=f"attention_{i}")(
            x, x, use_causal_mask=True
        )
        x = keras.layers.LayerNormalization(name=f"norm_a_{i}")(x + a)
        f = keras.layers.Dense(4 * d, activation="gelu", name=f"ff_up_{i}")(x)
        f = keras.layers.Dense(d, name=f"ff_down_{i}")(f)
        x = keras.layers.LayerNormalization(name=f"norm_f_{i}")(x + f)
    model = keras.Model(ids, keras.layers.Dense(vocab, name="logits")(x))
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def layout(mesh, fsdp: bool = False):
    """Megatron-LM's layout; with `fsdp`, every kernel and the table sharded over the batch
    axis too (on the dimension the model axis leaves whole)."""
    import tfstrat

    b = "batch" if fsdp else None
    layout_map = tfstrat.LayoutMap(mesh)
    layout_map["tokens/embeddings"] = ("model", b)
    layout_map["attention_.*/(query|key|value)/kernel"] = (b, "model", None)
    layout_map["attention_.*/(query|key|value)/bias"] = ("model", None)
    layout_map["attention_.*/attention_output/kernel"] = ("model", None, b)
    layout_map["ff_up_.*/kernel"] = (b, "model")
    layout_map["ff_up_.*/bias"] = ("model",)
    layout_map["ff_down_.*/kernel"] = ("model", b)
    layout_map["logits/kernel"] = (b, "model")
    return layout_map


def held_bytes(model) -> list[int]:
    """Bytes of the model's variables and their optimizer slots on each device."""
    per_device: dict[str, int] = {}
    shapes = {tuple(w.shape) for w in model.trainable_weights}
    variables = list(model.trainable_weights) + [
        v for v in model.optimizer.variables if tuple(v.shape) in shapes
    ]
    for v in variables:
        for part in v._value.values:
            size = int(part.shape.num_elements()) * part.dtype.size
            per_device[part.device] = per_device.get(part.device, 0) + size
    return sorted(per_device.values())


def main() -> None:
    config = json.loads(sys.argv[1])
    mesh_shape = tuple(config["mesh"])
    import numpy as np

    import tfstrat

    tfstrat.split_cpu(int(np.prod(mesh_shape)))
    mesh = tfstrat.DeviceMesh(mesh_shape, ["batch", "model"])
    strategy = tfstrat.ModelParallel(
        layout_map=layout(mesh, config.get("fsdp", False)), batch_dim_name="batch"
    )
    rng = np.random.default_rng(0)
    rows = config["batch"] * config["steps"]  # one epoch: `steps` steps
    x = rng.integers(0, config["vocab"], size=(rows, config["seq"])).astype("int32")
    y = np.roll(x, -1, axis=1)
    with strategy.scope():
        model = build(config)
    import keras

    times, moved = [], []
    traffic = strategy.extended._cross_device_ops.traffic
    traffic.start()

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            times.append((time.perf_counter() - self.start) / config["steps"])
            moved.append(traffic.read())

    history = model.fit(
        x,
        y,
        batch_size=config["batch"],
        epochs=config["repeats"] + 1,  # the first: tracing and warm-up
        shuffle=False,
        verbose=0,
        callbacks=[Timer()],
    )
    steps = config["steps"] * config["repeats"]  # the timed epochs'
    per_step = {k: (moved[-1][k] - moved[0][k]) / steps for k in moved[-1]}
    result = {
        "held_bytes": held_bytes(model),
        "params": int(model.count_params()),
        "step_s": float(np.median(times[1:])),
        "loss": float(history.history["loss"][-1]),
        "model_axis_bytes": per_step["model axis"],
        "batch_axis_bytes": per_step["batch axis"],
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
