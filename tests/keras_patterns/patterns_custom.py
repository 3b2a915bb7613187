"""The patterns with their own training steps, preprocessing and image layers (see patterns.py)."""

from __future__ import annotations

import numpy as np
from patterns import BATCH, CLASSES, FEATURES, ROWS, data, history_and_eval, result, seeded

LATENT = 4


# --- keras.io "Customizing what happens in fit()" ---------------------------------------------


def _custom_model_class():
    import keras
    import tensorflow as tf

    class CustomModel(keras.Model):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.loss_tracker = keras.metrics.Mean(name="loss")
            self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
            self.loss_fn = keras.losses.MeanSquaredError()

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.loss_fn(y, y_pred)
            gradients = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply(gradients, self.trainable_variables)
            self.loss_tracker.update_state(loss)
            self.mae_metric.update_state(y, y_pred)
            return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

        def test_step(self, data):
            x, y = data
            y_pred = self(x, training=False)
            self.loss_tracker.update_state(self.loss_fn(y, y_pred))
            self.mae_metric.update_state(y, y_pred)
            return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

        @property
        def metrics(self):
            return [self.loss_tracker, self.mae_metric]

    return CustomModel


def custom_steps(ctx):
    import keras

    x, _ = data()
    target = x[:, :1] * 2.0 - x[:, 1:2]
    with ctx.scope():
        seeded()
        inputs = keras.Input((FEATURES,))
        h = keras.layers.Dense(16, activation="relu")(inputs)
        model = _custom_model_class()(inputs, keras.layers.Dense(1)(h))
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9))
    history = model.fit(x, target, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return result(model, history_and_eval(model, history, x, target))


# --- keras.io GAN (custom_train_step_in_tensorflow): no call(), two optimizers ----------------


def _gan_class():
    import keras
    import tensorflow as tf

    class GAN(keras.Model):
        def __init__(self, discriminator, generator, latent_dim):
            super().__init__()
            self.discriminator = discriminator
            self.generator = generator
            self.latent_dim = latent_dim
            self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
            self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

        @property
        def metrics(self):
            return [self.d_loss_tracker, self.g_loss_tracker]

        def compile(self, d_optimizer, g_optimizer, loss_fn):
            super().compile()
            self.d_optimizer = d_optimizer
            self.g_optimizer = g_optimizer
            self.loss_fn = loss_fn

        def train_step(self, data):
            if isinstance(data, tuple):
                data = data[0]
            # The guide draws its noise in the step; here it comes with the data, so one
            # device and every replica see the same numbers for the same rows.
            real_images = data["real"]
            batch_size = tf.shape(real_images)[0]
            generated_images = self.generator(data["z1"])
            combined_images = tf.concat([generated_images, real_images], axis=0)
            labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
            labels += 0.05 * tf.concat([data["noise"][:, :1], data["noise"][:, 1:]], axis=0)
            with tf.GradientTape() as tape:
                predictions = self.discriminator(combined_images)
                d_loss = self.loss_fn(labels, predictions)
            grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
            self.d_optimizer.apply(grads, self.discriminator.trainable_weights)

            misleading_labels = tf.zeros((batch_size, 1))
            with tf.GradientTape() as tape:
                predictions = self.discriminator(self.generator(data["z2"]))
                g_loss = self.loss_fn(misleading_labels, predictions)
            grads = tape.gradient(g_loss, self.generator.trainable_weights)
            self.g_optimizer.apply(grads, self.generator.trainable_weights)

            self.d_loss_tracker.update_state(d_loss)
            self.g_loss_tracker.update_state(g_loss)
            return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}

    return GAN


def gan_data(rows: int = ROWS):
    rng = np.random.default_rng(3)
    return {
        "real": np.tanh(rng.normal(size=(rows, FEATURES))).astype("float32"),
        "z1": rng.normal(size=(rows, LATENT)).astype("float32"),
        "z2": rng.normal(size=(rows, LATENT)).astype("float32"),
        "noise": rng.uniform(size=(rows, 2)).astype("float32"),
    }


def gan(ctx):
    import keras

    with ctx.scope():
        seeded()
        discriminator = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(16),
                keras.layers.LeakyReLU(negative_slope=0.2),
                keras.layers.Dense(1),
            ],
            name="discriminator",
        )
        generator = keras.Sequential(
            [
                keras.Input((LATENT,)),
                keras.layers.Dense(16),
                keras.layers.LeakyReLU(negative_slope=0.2),
                keras.layers.Dense(FEATURES, activation="tanh"),
            ],
            name="generator",
        )
        model = _gan_class()(discriminator, generator, LATENT)
        model.compile(
            d_optimizer=keras.optimizers.Adam(learning_rate=0.003),
            g_optimizer=keras.optimizers.Adam(learning_rate=0.003),
            loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
        )
    history = model.fit(gan_data(), batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    metrics = {f"fit/{k}": v[-1] for k, v in history.history.items()}
    metrics["d_iterations"] = int(model.d_optimizer.iterations.numpy())
    metrics["g_iterations"] = int(model.g_optimizer.iterations.numpy())
    out = result(model, metrics)
    out["weights"] += [v.numpy() for v in model.d_optimizer.variables]
    out["weights"] += [v.numpy() for v in model.g_optimizer.variables]
    return out


# --- preprocessing layers in tf.data (keras.io "Working with preprocessing layers") ----------

WORDS = [f"w{i}" for i in range(20)]


def _texts(rows: int):
    rng = np.random.default_rng(5)
    texts = [" ".join(rng.choice(WORDS, size=rng.integers(2, 7))) for _ in range(rows)]
    labels = np.array([int("w3" in t.split() or "w7" in t.split()) for t in texts], "int64")
    return np.array(texts), labels


def preprocessing(ctx):
    """TextVectorization and Normalization adapted outside the scope, applied in `tf.data`."""
    import keras
    import tensorflow as tf

    texts, labels = _texts(ROWS)
    numbers = np.random.default_rng(6).normal(3.0, 2.0, size=(ROWS, 2)).astype("float32")
    vectorize = keras.layers.TextVectorization(max_tokens=24, output_sequence_length=6)
    vectorize.adapt(texts)
    normalize = keras.layers.Normalization()
    normalize.adapt(numbers)

    def prepare(inputs, y):
        return {"tokens": vectorize(inputs["text"]), "numbers": normalize(inputs["numbers"])}, y

    dataset = (
        tf.data.Dataset.from_tensor_slices(({"text": texts, "numbers": numbers}, labels))
        .batch(BATCH)
        .map(prepare)
    )
    with ctx.scope():
        seeded()
        tokens = keras.Input((6,), dtype="int64", name="tokens")
        nums = keras.Input((2,), name="numbers")
        h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(24, 4)(tokens))
        h = keras.layers.Dense(8, activation="relu")(keras.layers.Concatenate()([h, nums]))
        model = keras.Model({"tokens": tokens, "numbers": nums}, keras.layers.Dense(2)(h))
        model.compile(
            optimizer=keras.optimizers.SGD(0.2, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    history = model.fit(dataset, epochs=3, verbose=0)
    metrics = {f"fit/{k}": v[-1] for k, v in history.history.items()}
    evaluated = model.evaluate(dataset, verbose=0, return_dict=True)
    metrics.update({f"evaluate/{k}": v for k, v in evaluated.items()})
    return result(model, metrics)


# --- image layers ----------------------------------------------------------------------------


def _images(rows: int = ROWS):
    rng = np.random.default_rng(8)
    x = rng.normal(size=(rows, 4, 4, 1)).astype("float32")
    x[::2] += 1.0  # every replica's slice has its own batch statistics
    y = (x.mean(axis=(1, 2, 3)) > 0.5).astype("int64") + (x[:, 0, 0, 0] > 1).astype("int64")
    return x, np.minimum(y, CLASSES - 1)


def _conv_model(ctx, *, dropout: bool, synchronized: bool):
    import keras

    with ctx.scope():
        seeded()
        layers = [
            keras.Input((4, 4, 1)),
            keras.layers.Conv2D(4, 3, padding="same", use_bias=False),
            keras.layers.BatchNormalization(synchronized=synchronized),
            keras.layers.ReLU(),
            keras.layers.Flatten(),
        ]
        if dropout:
            layers.append(keras.layers.Dropout(0.3, seed=7))
        model = keras.Sequential([*layers, keras.layers.Dense(CLASSES)])
        model.compile(
            optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    return model


def _train_images(model):
    x, y = _images()
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return result(model, history_and_eval(model, history, x, y))


def batchnorm_dropout(ctx):
    """BatchNormalization (per-replica statistics, as Keras defines it) and Dropout (per-replica
    masks): not expected to be exact; the difference is measured."""
    return _train_images(_conv_model(ctx, dropout=True, synchronized=False))


def batchnorm_sync(ctx):
    """BatchNormalization(synchronized=True): batch statistics over the global batch."""
    return _train_images(_conv_model(ctx, dropout=False, synchronized=True))


__all__ = ["custom_steps", "gan", "preprocessing", "batchnorm_dropout", "batchnorm_sync", "ROWS"]
