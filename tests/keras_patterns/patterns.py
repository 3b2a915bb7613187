"""Keras programs in the style of keras.io's guides, each a function `pattern(ctx) -> result`.

Every pattern builds its model in `ctx.scope()` (the strategy's scope, or none), trains on
generated data with an even global batch (`BATCH`), and returns
`{"weights": [arrays], "metrics": {name: value}}`: the model's variables after training (Keras
seed-generator states left out: they are per replica by design) and the logs a user reads
(epoch logs, evaluate). Input order is fixed (shuffle=False or an unshuffled tf.data
pipeline): tfstrat draws shuffles from (seed, epoch), stock Keras from TensorFlow's global
seed, so shuffled orders would differ between the runs compared.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np

BATCH, ROWS, FEATURES, CLASSES = 16, 64, 8, 3


class Context:
    """What a pattern needs to know about the run it is in."""

    def __init__(self, strategy, kind: str, work: str):
        self.strategy, self.kind, self.work = strategy, kind, work

    def scope(self):
        return self.strategy.scope() if self.strategy is not None else contextlib.nullcontext()


def data(rows: int = ROWS, seed: int = 0):
    """Features and a learnable 3-class label."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, FEATURES)).astype("float32")
    y = (np.argmax(x[:, :CLASSES] + 0.3 * x[:, CLASSES : 2 * CLASSES], axis=1)).astype("int64")
    return x, y


def seeded():
    import keras

    keras.utils.set_random_seed(1234)


def mlp(outputs: int = CLASSES, name: str | None = None):
    import keras

    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(outputs),
        ],
        name=name,
    )


def result(model, metrics: dict) -> dict:
    """The model's weights (a table Hybrid holds on the ps read whole from there, as its
    weight's `numpy()` does), the metrics, and where each embedding table lives."""
    weights = [v.numpy() for v in model.weights if "seed_generator" not in v.path]
    return {
        "weights": weights,
        "metrics": {k: float(np.mean(v)) for k, v in metrics.items()},
        "placement": placement(model),
    }


def placement(model) -> dict:
    """{table path: ps devices ([] when mirrored)} of the model's Embedding layers, and the
    paths and shapes of every variable the worker holds ("variables")."""
    import keras

    # A ps-held table's weight is a scalar stand-in on the worker (it shows the table).
    held_here = [v for v in model.weights if not hasattr(v, "_tfstrat_table")]
    out = {"variables": {v.path: list(v.shape) for v in held_here}}
    for layer in model._flatten_layers():
        if isinstance(layer, keras.layers.Embedding):
            held = getattr(layer._embeddings, "remote", None)  # a ps-held table (PsTable)
            out[f"{layer.path}/embeddings"] = held.devices if held is not None else []
    return out


def history_and_eval(model, history, x, y, **kw) -> dict:
    """The last epoch's logs and `evaluate`'s, by name."""
    logs = {f"fit/{k}": v[-1] for k, v in history.history.items() if k != "learning_rate"}
    evaluated = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True, **kw)
    logs.update({f"evaluate/{k}": v for k, v in evaluated.items()})
    return logs


def sparse_ce():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def classifier(ctx, optimizer="sgd", **compile_kw):
    import keras

    with ctx.scope():
        seeded()
        model = mlp()
        if optimizer == "sgd":
            optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
        elif callable(optimizer):  # created in the scope, as keras.io's guide does
            optimizer = optimizer()
        model.compile(optimizer=optimizer, loss=sparse_ce(), metrics=["accuracy"], **compile_kw)
    return model


# --- the built-in training loop ----------------------------------------------------------------


def validation_split(ctx):
    x, y = data()
    model = classifier(ctx)
    history = model.fit(
        x, y, batch_size=BATCH, epochs=2, validation_split=0.25, shuffle=False, verbose=0
    )
    return result(model, history_and_eval(model, history, x, y))


def class_weight(ctx):
    x, y = data()
    model = classifier(ctx)
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=2,
        class_weight={0: 1.0, 1: 3.0, 2: 0.5},
        shuffle=False,
        verbose=0,
    )
    return result(model, history_and_eval(model, history, x, y))


def sample_weight(ctx):
    x, y = data()
    weights = np.linspace(0.2, 2.0, len(x)).astype("float32")
    model = classifier(ctx, optimizer="adam", weighted_metrics=["accuracy"])
    history = model.fit(
        x, y, sample_weight=weights, batch_size=BATCH, epochs=2, shuffle=False, verbose=0
    )
    return result(model, history_and_eval(model, history, x, y, sample_weight=weights))


def multi_io(ctx):
    """Two inputs, three outputs: one loss per output, weighted, and one output without a loss
    (keras.io "functional API": priority / department / a diagnostic head)."""
    import keras

    x, y = data()
    extra = np.random.default_rng(1).normal(size=(ROWS, 4)).astype("float32")
    target = (x[:, :1] - extra[:, :1]).astype("float32")
    with ctx.scope():
        seeded()
        a = keras.Input((FEATURES,), name="features")
        b = keras.Input((4,), name="extra")
        h = keras.layers.Dense(16, activation="relu")(keras.layers.Concatenate()([a, b]))
        outputs = {
            "score": keras.layers.Dense(1, name="score")(h),
            "label": keras.layers.Dense(CLASSES, name="label")(h),
            "probe": keras.layers.Dense(2, name="probe")(h),
        }
        model = keras.Model({"features": a, "extra": b}, outputs)
        model.compile(
            optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
            loss={"score": "mse", "label": sparse_ce(), "probe": None},
            loss_weights=[2.0, 1.0, 0.5],  # label, probe, score: Keras 3.15 wants a list here
        )
    inputs = {"features": x, "extra": extra}
    targets = {"score": target, "label": y}
    history = model.fit(inputs, targets, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return result(model, history_and_eval(model, history, inputs, targets))


def lr_schedules(ctx):
    """`ExponentialDecay` on one model, a `LearningRateScheduler` callback on another."""
    import keras

    x, y = data()
    decay = keras.optimizers.schedules.ExponentialDecay(0.2, decay_steps=2, decay_rate=0.5)
    decayed = classifier(ctx, optimizer=lambda: keras.optimizers.SGD(decay, momentum=0.9))
    h1 = decayed.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    scheduled = classifier(ctx)
    schedule = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.2 * 0.5**epoch)
    h2 = scheduled.fit(
        x, y, batch_size=BATCH, epochs=3, callbacks=[schedule], shuffle=False, verbose=0
    )
    metrics = {f"decay/{k}": v for k, v in history_and_eval(decayed, h1, x, y).items()}
    metrics.update({f"scheduler/{k}": v for k, v in history_and_eval(scheduled, h2, x, y).items()})
    metrics["scheduler/lr"] = float(scheduled.optimizer.learning_rate.numpy())
    out = result(decayed, metrics)
    out["weights"] += result(scheduled, {})["weights"]
    return out


def early_stop_plateau(ctx):
    """`EarlyStopping` and `ReduceLROnPlateau` on epoch logs, set to fire on schedule
    (min_delta larger than any improvement) so the epochs and rates are known."""
    import keras

    x, y = data()
    model = classifier(ctx)
    callbacks = [
        keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=10.0, patience=2),
        keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=10.0),
    ]
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=10,
        validation_data=(x[:32], y[:32]),
        callbacks=callbacks,
        shuffle=False,
        verbose=0,
    )
    metrics = history_and_eval(model, history, x, y)
    metrics["epochs"] = len(history.history["loss"])
    metrics["lr"] = float(model.optimizer.learning_rate.numpy())
    return result(model, metrics)


def steps_per_execution(ctx):
    x, y = data()
    model = classifier(ctx, steps_per_execution=2)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return result(model, history_and_eval(model, history, x, y))


def scalar_loss(ctx):
    """A custom loss function that returns the batch mean (a scalar), as many users write."""
    import keras
    import tensorflow as tf

    def mean_squared(y_true, y_pred):
        return tf.reduce_mean(tf.square(tf.cast(y_true, y_pred.dtype) - y_pred))

    x, y = data()
    target = x[:, :1] * 2.0 - x[:, 1:2]
    with ctx.scope():
        seeded()
        model = mlp(outputs=1)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss=mean_squared)
    history = model.fit(x, target, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return result(model, history_and_eval(model, history, x, target))


def sequence_dense(ctx):
    """A Dense on 3-D input (as in sequence models): TF 2.21 gives its kernel's gradient an
    unknown static shape, (None, units), which once crashed tfstrat's reduction."""
    import keras

    x, y = data()
    x = x.reshape(ROWS, 4, FEATURES // 4)
    with ctx.scope():
        seeded()
        inputs = keras.Input((4, FEATURES // 4))
        hidden = keras.layers.Dense(16, activation="relu")(inputs)
        hidden = keras.layers.GlobalAveragePooling1D()(hidden)
        model = keras.Model(inputs, keras.layers.Dense(CLASSES)(hidden))
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=sparse_ce())
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return result(model, history_and_eval(model, history, x, y))


def mixed_float16(ctx):
    import keras

    x, y = data()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with ctx.scope():
            seeded()
            inputs = keras.Input((FEATURES,))
            h = keras.layers.Dense(16, activation="relu")(inputs)
            logits = keras.layers.Dense(CLASSES)(h)
            outputs = keras.layers.Activation("linear", dtype="float32")(logits)
            model = keras.Model(inputs, outputs)
            model.compile(optimizer="adam", loss=sparse_ce(), metrics=["accuracy"])
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        return result(model, history_and_eval(model, history, x, y))
    finally:
        keras.mixed_precision.set_global_policy("float32")


def save_load_resume(ctx):
    """keras.io "save and load": fit, `model.save("m.keras")`, `load_model`, fit on. Every
    task saves to the same path, as an unchanged single-machine program does."""
    import keras

    x, y = data()
    model = classifier(ctx, optimizer="adam")
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    os.makedirs(ctx.work, exist_ok=True)
    path = os.path.join(ctx.work, "m.keras")
    model.save(path)
    with ctx.scope():
        restored = keras.models.load_model(path)
    history = restored.fit(
        x, y, batch_size=BATCH, epochs=2, initial_epoch=1, shuffle=False, verbose=0
    )
    metrics = history_and_eval(restored, history, x, y)
    metrics["iterations"] = int(restored.optimizer.iterations.numpy())
    return result(restored, metrics)


from patterns_custom import (  # noqa: E402
    batchnorm_dropout,
    batchnorm_sync,
    custom_steps,
    gan,
    preprocessing,
)

PATTERNS = {
    f.__name__: f
    for f in (
        validation_split,
        class_weight,
        sample_weight,
        multi_io,
        custom_steps,
        gan,
        mixed_float16,
        save_load_resume,
        lr_schedules,
        early_stop_plateau,
        preprocessing,
        batchnorm_dropout,
        batchnorm_sync,
        steps_per_execution,
        scalar_loss,
        sequence_dense,
    )
}
