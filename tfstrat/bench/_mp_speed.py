"""One speed row of `tfstrat bench model-parallel`, in its own process: a Transformer block's
training examples/s on one device, or split over a (1, 2) mesh of logical CPUs, on
TensorFlow (`tfstrat.ModelParallel`) or on JAX (Keras's own `keras.distribution.ModelParallel`).

Usage: python -m tfstrat.bench._mp_speed '{"backend": "tensorflow", "mesh": [1, 2], ...}'
Prints one line `RESULT {...}`: examples/s of the epochs after the first (which traces or
compiles), each epoch's seconds, the final loss.

The block: token Embedding (vocab x dim), MultiHeadAttention (heads x dim/heads), residual and
LayerNormalization, Dense dim -> 4 dim (relu) -> dim, residual and LayerNormalization, mean
over the tokens, Dense to 8 classes; Adam. The split (Megatron-LM's): embedding on its feature
axis (None, 'model'), query/key/value by heads (None, 'model', None), attention output
('model', None, None), up (None, 'model'), down ('model', None). TensorFlow runs without XLA
and with its default thread pools; JAX compiles with XLA, as it always does. The one-device
TensorFlow row runs with tfstrat's Keras hooks too (`tfstrat/keras/_shuffle.py`: among them,
each epoch's dataset iterator destroyed off the training thread, as under every tfstrat
strategy), so the ratio between the two TensorFlow rows is the split's alone.
"""

from __future__ import annotations

import json
import os
import sys
import time

CLASSES = 8
RULES = (
    ("tokens/embeddings", (None, "model")),
    ("attention/(query|key|value)/kernel", (None, "model", None)),
    ("attention/(query|key|value)/bias", ("model", None)),
    ("attention/attention_output/kernel", ("model", None, None)),
    ("up/kernel", (None, "model")),
    ("up/bias", ("model",)),
    ("down/kernel", ("model", None)),
)


def build(config: dict):
    import keras

    keras.utils.set_random_seed(1)
    d, heads = config["dim"], config["heads"]
    ids = keras.Input((config["seq"],), dtype="int32")
    x = keras.layers.Embedding(config["vocab"], d, name="tokens")(ids)
    a = keras.layers.MultiHeadAttention(heads, d // heads, name="attention")(x, x)
    x = keras.layers.LayerNormalization(name="norm_a")(x + a)
    f = keras.layers.Dense(4 * d, activation="relu", name="up")(x)
    f = keras.layers.Dense(d, name="down")(f)
    x = keras.layers.LayerNormalization(name="norm_f")(x + f)
    x = keras.layers.GlobalAveragePooling1D()(x)
    model = keras.Model(ids, keras.layers.Dense(CLASSES, name="head")(x))
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=config["backend"] == "jax",
    )
    return model


def _scope(config: dict):
    """The context to build the model in (and for JAX, the distribution set)."""
    import contextlib

    mesh = config.get("mesh")
    if not mesh and config["backend"] == "tensorflow":
        from tfstrat.keras import _shuffle

        _shuffle.seed_shuffles(set_global_seed=False)  # tfstrat's Keras hooks, as under a mesh
    if not mesh:
        return contextlib.nullcontext()
    if config["backend"] == "jax":
        import keras

        devices = keras.distribution.list_devices("cpu")
        device_mesh = keras.distribution.DeviceMesh(tuple(mesh), ["batch", "model"], devices)
        layout_map = keras.distribution.LayoutMap(device_mesh)
        for key, axes in RULES:
            layout_map[key] = axes
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
        )
        return contextlib.nullcontext()
    import tfstrat

    tfstrat.split_cpu(mesh[0] * mesh[1])
    device_mesh = tfstrat.DeviceMesh(tuple(mesh), ["batch", "model"])
    layout_map = tfstrat.LayoutMap(device_mesh)
    for key, axes in RULES:
        layout_map[key] = axes
    return tfstrat.ModelParallel(layout_map=layout_map, batch_dim_name="batch").scope()


def main() -> None:
    config = json.loads(sys.argv[1])
    os.environ["KERAS_BACKEND"] = config["backend"]
    mesh = config.get("mesh")
    if config["backend"] == "jax" and mesh:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={mesh[0] * mesh[1]}"
        ).strip()
    import keras
    import numpy as np

    with _scope(config):
        model = build(config)
    rng = np.random.default_rng(0)
    x = rng.integers(0, config["vocab"], (config["rows"], config["seq"])).astype("int32")
    y = rng.integers(0, CLASSES, (config["rows"],)).astype("int32")

    times: list[float] = []

    class Clock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            times.append(time.perf_counter() - self.start)

    history = model.fit(
        x, y, batch_size=config["batch"], epochs=config["epochs"], shuffle=False, verbose=0,
        callbacks=[Clock()],
    )  # fmt: skip
    timed = times[1:]
    print(
        "RESULT "
        + json.dumps(
            {
                "examples_per_s": config["rows"] * len(timed) / sum(timed),
                "epoch_s": times,
                "loss": float(history.history["loss"][-1]),
                "backend_version": keras.__version__,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
