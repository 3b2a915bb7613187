"""Other people's Keras 3 code: keras-hub and keras-rs models built from config (nothing is
downloaded), a keras-hub tokenizer inside tf.data, raw strings, keras.io's convolutional
classifier on a dataset whose last batch has fewer rows than replicas, and XLA.

Every pattern follows `patterns.py`'s contract (weights and logs, compared with the run
without a strategy). Dropout is 0 everywhere: dropout masks are drawn per replica by design.
Datasets have 33 rows (or 17), so that the last batch of 8 holds one row and a replica of
every strategy receives none. The patterns in `PLAIN_SGD` train with plain SGD: LocalSGD with
`sync_every=1` equals one device for them (averaging weights after one SGD step is averaging
gradients); with momentum or Adam it does not, by design.
"""

from __future__ import annotations

import os

import numpy as np
from patterns import result, seeded

BATCH, ROWS = 8, 33  # the last batch holds 1 row
VOCAB, LENGTH = 64, 8


def _fit_eval_predict(model, x, y, sample_weight=None, epochs=2, **fit_kw) -> dict:
    """fit, evaluate and predict on the same arrays; the logs a user reads, by name."""
    history = model.fit(
        x,
        y,
        sample_weight=sample_weight,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        **fit_kw,
    )
    logs = {f"fit/{k}": v[-1] for k, v in history.history.items()}
    evaluated = model.evaluate(
        x, y, sample_weight=sample_weight, batch_size=BATCH, verbose=0, return_dict=True
    )
    logs.update({f"evaluate/{k}": v for k, v in evaluated.items()})
    logs.update(_predicted(model.predict(x, batch_size=BATCH, verbose=0)))
    return logs


def _predicted(outputs) -> dict:
    """Summaries of `predict`'s outputs: every row, in order (a missing or repeated row of an
    empty replica changes them)."""
    flat = np.concatenate(
        [np.asarray(o, np.float64).reshape(len(o), -1) for o in _leaves(outputs)], 1
    )
    weights = np.arange(1, len(flat) + 1, dtype=np.float64)[:, None]
    weighted = float((np.abs(flat) * weights).sum())  # no cancellation: rounding stays relative
    return {"predict/rows": len(flat), "predict/weighted_sum": weighted}


def _leaves(outputs):
    if isinstance(outputs, dict):
        return [outputs[k] for k in sorted(outputs)]
    if isinstance(outputs, (list, tuple)):
        return list(outputs)
    return [outputs]


def _tokens(seed: int, rows: int = ROWS):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, size=(rows, LENGTH)).astype("int32")
    lengths = rng.integers(3, LENGTH + 1, size=rows)
    mask = np.arange(LENGTH)[None, :] < lengths[:, None]
    return np.where(mask, ids, 0).astype("int32"), mask


def _gpt2(num_layers: int):
    """keras-hub's GPT2CausalLM from config: no preset, no preprocessor, no dropout."""
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB,
        num_layers=num_layers,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=LENGTH,
        dropout=0.0,
    )
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def hub_gpt2(ctx):
    """keras-hub's GPT2CausalLM (2 layers) on token ids with a bool padding mask, the mask as
    the sample weight, plain SGD."""
    import keras

    ids, mask = _tokens(3)
    x = {"token_ids": ids, "padding_mask": mask}
    y = np.roll(ids, -1, axis=1)
    with ctx.scope():
        seeded()
        model = _gpt2(num_layers=2)
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=["accuracy"],
        )
    logs = _fit_eval_predict(model, x, y, sample_weight=mask.astype("float32"))
    return result(model, logs)


def hub_bert(ctx):
    """keras-hub's BertTextClassifier (2 layers): token, segment and bool padding-mask inputs,
    per-example sample weights, AdamW with `exclude_from_weight_decay` (as keras-hub's own
    `compile` does)."""
    import keras
    import keras_hub

    ids, mask = _tokens(4)
    segments = (np.arange(LENGTH)[None, :] >= LENGTH // 2).astype("int32") * mask
    x = {"token_ids": ids, "segment_ids": segments.astype("int32"), "padding_mask": mask}
    y = (ids[:, 0] % 3).astype("int32")
    weights = np.linspace(0.5, 1.5, ROWS).astype("float32")
    with ctx.scope():
        seeded()
        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=VOCAB,
            num_layers=2,
            num_heads=2,
            hidden_dim=16,
            intermediate_dim=32,
            max_sequence_length=LENGTH,
            dropout=0.0,
        )
        model = keras_hub.models.BertTextClassifier(
            backbone=backbone, num_classes=3, preprocessor=None, dropout=0.0
        )
        optimizer = keras.optimizers.AdamW(3e-3, weight_decay=0.01)
        optimizer.exclude_from_weight_decay(var_names=["bias", "gamma", "beta"])
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=["accuracy"],
        )
    return result(model, _fit_eval_predict(model, x, y, sample_weight=weights))


def rs_ranking(ctx):
    """A DLRM-style ranking model (keras.io's keras-rs example): three `keras.layers.Embedding`
    tables and a dense tower, keras-rs's `DotInteraction` between them, `FeatureCross` on the
    dense features; plain SGD."""
    import keras
    import keras_rs

    rng = np.random.default_rng(5)
    sizes = (20, 30, 12)
    x = {f"c{i}": rng.integers(0, n, size=(ROWS, 1)).astype("int32") for i, n in enumerate(sizes)}
    x["dense"] = rng.normal(size=(ROWS, 4)).astype("float32")
    y = ((x["c0"][:, 0] + x["c1"][:, 0]) % 2).astype("float32")
    with ctx.scope():
        seeded()
        inputs = {k: keras.Input(v.shape[1:], dtype=v.dtype, name=k) for k, v in x.items()}
        dense = keras_rs.layers.FeatureCross()(inputs["dense"], inputs["dense"])
        dense = keras.layers.Dense(4, activation="relu")(dense)
        embedded = [
            keras.layers.Flatten()(keras.layers.Embedding(n, 4)(inputs[f"c{i}"]))
            for i, n in enumerate(sizes)
        ]
        interactions = keras_rs.layers.DotInteraction()([dense, *embedded])
        hidden = keras.layers.Concatenate()([dense, interactions])
        model = _binary_head(inputs, hidden, keras.optimizers.SGD(0.1))
    return result(model, _fit_eval_predict(model, x, y))


def _binary_head(inputs, hidden, optimizer):
    """The ranking models' head (Dense 8 -> 1, logits) on `hidden`, compiled."""
    import keras

    output = keras.layers.Dense(1)(keras.layers.Dense(8, activation="relu")(hidden))
    model = keras.Model(inputs, output)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=["binary_accuracy"],
    )
    return model


def rs_distributed_embedding(ctx):
    """keras-rs's `DistributedEmbedding` (two tables behind feature configs; on CPUs and GPUs
    each table is an `EmbedReduce`, a `keras.layers.Embedding` that averages a bag of 3 ids
    per row), Adam."""
    import keras
    import keras_rs

    rng = np.random.default_rng(6)
    sizes = {"user": 40, "item": 25}
    x = {k: rng.integers(0, n, size=(ROWS, 3)).astype("int32") for k, n in sizes.items()}
    y = ((x["user"][:, 0] + x["item"][:, 0]) % 2).astype("float32")
    with ctx.scope():
        seeded()
        configs = {
            name: keras_rs.layers.FeatureConfig(
                name=name,
                table=keras_rs.layers.TableConfig(
                    name=f"{name}_table",
                    vocabulary_size=n,
                    embedding_dim=4,
                    # Seeded: TableConfig's default initializer is made at import, its seed
                    # drawn before any seed is set, so it differs from process to process.
                    initializer=keras.initializers.RandomUniform(-0.05, 0.05, seed=n),
                    optimizer="adam",
                ),
                input_shape=(BATCH, 3),
                output_shape=(BATCH, 4),
            )
            for name, n in sizes.items()
        }
        inputs = {k: keras.Input((3,), dtype="int32", name=k) for k in x}
        embedded = keras_rs.layers.DistributedEmbedding(configs)(inputs)
        hidden = keras.layers.Concatenate()([embedded["user"], embedded["item"]])
        model = _binary_head(inputs, hidden, keras.optimizers.Adam(0.01))
    return result(model, _fit_eval_predict(model, x, y))


_WORDS = "the a cat dog sat ran on mat log fast slow red big".split()


def _sentences(seed: int, rows: int = ROWS):
    rng = np.random.default_rng(seed)
    texts = [" ".join(rng.choice(_WORDS, size=rng.integers(2, 7))) for _ in range(rows)]
    labels = np.array([("cat" in t) + ("dog" in t) for t in texts], "int32")
    return np.array(texts), labels


def hub_tokenizer(ctx):
    """keras-hub's WordPieceTokenizer, built from an in-memory vocabulary, inside a tf.data
    pipeline of raw strings; an Embedding classifier on its token ids; Adam."""
    import keras
    import keras_hub
    import tensorflow as tf

    texts, labels = _sentences(6)
    vocabulary = ["[PAD]", "[UNK]", *_WORDS]
    tokenizer = keras_hub.tokenizers.WordPieceTokenizer(vocabulary=vocabulary, sequence_length=6)
    data = tf.data.Dataset.from_tensor_slices((texts, labels)).batch(BATCH)
    data = data.map(lambda t, y: (tokenizer(t), y))
    with ctx.scope():
        seeded()
        inputs = keras.Input((6,), dtype="int32")
        hidden = keras.layers.Embedding(len(vocabulary), 8, mask_zero=True)(inputs)
        hidden = keras.layers.GlobalAveragePooling1D()(hidden)
        model = keras.Model(inputs, keras.layers.Dense(3)(hidden))
        model.compile(
            optimizer=keras.optimizers.Adam(1e-2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    history = model.fit(data, epochs=2, verbose=0)
    logs = {f"fit/{k}": v[-1] for k, v in history.history.items()}
    logs.update(
        {f"evaluate/{k}": v for k, v in model.evaluate(data, verbose=0, return_dict=True).items()}
    )
    logs.update(_predicted(model.predict(data.map(lambda t, y: t), verbose=0)))
    return result(model, logs)


def raw_strings(ctx):
    """keras.io's end-to-end text classifier: `TextVectorization` inside the model, which
    takes raw strings (a string input, where MirroredStrategy's symbolic build once failed)."""
    import keras
    import tensorflow as tf

    texts, labels = _sentences(7)
    vectorize = keras.layers.TextVectorization(max_tokens=20, output_sequence_length=6)
    vectorize.adapt(texts)
    with ctx.scope():
        seeded()
        inputs = keras.Input((1,), dtype="string")
        ids = vectorize(inputs)
        hidden = keras.layers.Embedding(20, 8)(ids)
        hidden = keras.layers.GlobalAveragePooling1D()(hidden)
        model = keras.Model(inputs, keras.layers.Dense(3)(hidden))
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    return result(model, _fit_eval_predict(model, tf.constant(texts)[:, None], labels))


def _image_classifier(norm: str):
    """keras.io "Image classification from scratch", scaled down: residual blocks of
    SeparableConv2D + a normalization whose shortcut is a strided Conv2D, joined by `Add`.
    `norm`: "batch" (keras.io's), "sync" (BatchNormalization(synchronized=True)) or "layer"."""
    import keras
    from keras import layers

    def normalization():
        if norm == "layer":
            return layers.LayerNormalization()
        return layers.BatchNormalization(synchronized=norm == "sync")

    inputs = keras.Input((16, 16, 3))
    x = layers.Rescaling(1.0 / 255)(inputs)
    # No bias before BatchNormalization: its gradient is 0, its value rounding noise.
    x = layers.Conv2D(8, 3, strides=2, padding="same", use_bias=False)(x)
    x = normalization()(x)
    x = layers.Activation("relu")(x)
    previous = x
    for size in (8, 16, 16):
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(size, 3, padding="same", use_bias=False)(x)
        x = normalization()(x)
        x = layers.MaxPooling2D(3, strides=2, padding="same")(x)
        residual = layers.Conv2D(size, 1, strides=2, padding="same")(previous)
        x = layers.add([x, residual])
        previous = x
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(1)(x))


def _images(seed: int, rows: int):
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 255, size=(rows, 16, 16, 3)).astype("float32")
    y = rng.integers(0, 2, size=rows).astype("float32")  # unlearnable: the loss stays near 0.7
    return x, y


def conv_small_last_batch(ctx):
    """The image classifier with `BatchNormalization(synchronized=True)` (unsynchronized
    statistics differ per replica by design), on a tf.data dataset of unknown length whose
    last batch holds one row, with a validation set of 3 rows (batches of 2 and 1)."""
    return _small_last_batch(ctx, "sync")


def conv_layernorm_small_last_batch(ctx):
    """As `conv_small_last_batch`, with LayerNormalization: no collective in the forward
    pass, so a replica with no rows skips it (where oneDNN's Conv2D of 0 rows fails)."""
    return _small_last_batch(ctx, "layer")


def conv_keras_io_small_last_batch(ctx):
    """keras.io's own normalization (unsynchronized BatchNormalization): its replicas'
    statistics differ from one device's by design, so what counts is that it trains,
    evaluates and predicts every row where a replica gets none."""
    return _small_last_batch(ctx, "batch")


def _small_last_batch(ctx, norm: str):
    import keras
    import tensorflow as tf

    x, y = _images(8, 17)
    vx, vy = _images(9, 3)
    # filter() hides the length, as a TFRecord file's dataset does.
    train = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True).batch(BATCH)
    validation = tf.data.Dataset.from_tensor_slices((vx, vy)).batch(2)
    with ctx.scope():
        seeded()
        model = _image_classifier(norm)
        model.compile(
            optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
            loss=keras.losses.BinaryCrossentropy(from_logits=True),
            metrics=["binary_accuracy"],
        )
    history = model.fit(train, validation_data=validation, epochs=2, verbose=0)
    logs = {f"fit/{k}": v[-1] for k, v in history.history.items()}
    logs.update(
        {
            f"evaluate/{k}": v
            for k, v in model.evaluate(validation, verbose=0, return_dict=True).items()
        }
    )
    logs.update(_predicted(model.predict(train.map(lambda a, b: a), verbose=0)))
    return result(model, logs)


def jit_compiled(ctx):
    """`compile(jit_compile=True)`: the step compiled by XLA (the exchange between workers
    runs outside the compiled part), on a dense model with an Embedding; plain SGD."""
    import keras

    ids, mask = _tokens(10)
    dense = np.random.default_rng(11).normal(size=(ROWS, 4)).astype("float32")
    y = (ids[:, 0] % 3).astype("int32")
    with ctx.scope():
        seeded()
        tokens = keras.Input((LENGTH,), dtype="int32")
        features = keras.Input((4,))
        hidden = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(VOCAB, 8)(tokens))
        hidden = keras.layers.Concatenate()([hidden, keras.layers.Dense(8)(features)])
        hidden = keras.layers.Dense(16, activation="relu")(hidden)
        model = keras.Model([tokens, features], keras.layers.Dense(3)(hidden))
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            jit_compile=True,
        )
    return result(model, _fit_eval_predict(model, [ids, dense], y))


def hub_save_resume(ctx):
    """keras-hub's GPT2CausalLM: fit, `model.save` to a path every task names the same,
    `load_model` (keras-hub's registered classes), fit on from where it stopped; then each
    task saves to a directory of its own and loads its own file back."""
    import tempfile

    import keras

    ids, mask = _tokens(12)
    x = {"token_ids": ids, "padding_mask": mask}
    y = np.roll(ids, -1, axis=1)
    with ctx.scope():
        seeded()
        model = _gpt2(num_layers=1)
        # Momentum, not Adam: Adam turns the rounding noise of the key bias's gradient
        # (zero in exact arithmetic: softmax ignores it) into full-size steps.
        model.compile(
            optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    os.makedirs(ctx.work, exist_ok=True)
    shared = os.path.join(ctx.work, "gpt2.keras")
    model.save(shared)
    with ctx.scope():
        restored = keras.models.load_model(shared)
    logs = _fit_eval_predict(restored, x, y, epochs=2, initial_epoch=1)
    logs["iterations"] = int(restored.optimizer.iterations.numpy())
    own = os.path.join(tempfile.mkdtemp(prefix="tfstrat-own-"), "gpt2.keras")
    restored.save(own)
    again = keras.models.load_model(own)
    differences = [np.abs(a - b).max() for a, b in zip(again.get_weights(), restored.get_weights())]
    logs["own_file/max_difference"] = float(max(differences))
    # One more collective: the chief (which never waits for a save) stays until every worker
    # has read its outcome.
    logs["evaluate_after_save/loss"] = restored.evaluate(x, y, batch_size=BATCH, verbose=0)
    return result(restored, logs)


PATTERNS = {
    f.__name__: f
    for f in (
        hub_gpt2,
        hub_bert,
        rs_ranking,
        rs_distributed_embedding,
        hub_tokenizer,
        raw_strings,
        conv_small_last_batch,
        conv_layernorm_small_last_batch,
        conv_keras_io_small_last_batch,
        jit_compiled,
        hub_save_resume,
    )
}
PLAIN_SGD = ("hub_gpt2", "rs_ranking", "raw_strings", "jit_compiled")
