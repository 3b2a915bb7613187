"""tfstrat.keras.layers.Embedding outside any strategy: a drop-in for keras.layers.Embedding."""

import numpy as np


def _model(layer_cls):
    import keras

    keras.utils.set_random_seed(5)
    keras.backend.clear_session()  # the same layer names in both models
    inputs = keras.Input((4,), dtype="int32")
    x = layer_cls(50, 3, name="embedding")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(x)))


def test_same_weights_outputs_and_saved_format_as_keras(tmp_path):
    import keras

    from tfstrat.keras.layers import Embedding

    ours, stock = _model(Embedding), _model(keras.layers.Embedding)
    assert [w.path for w in ours.weights] == [w.path for w in stock.weights]
    for a, b in zip(ours.get_weights(), stock.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)  # same initial values from the same seed
    ids = np.arange(40, dtype="int32").reshape(10, 4)
    np.testing.assert_allclose(ours.predict(ids, verbose=0), stock.predict(ids, verbose=0))
    ours.layers[1].embeddings.assign(np.ones((50, 3), "float32"))
    ours.save_weights(tmp_path / "ours.weights.h5")
    stock.load_weights(tmp_path / "ours.weights.h5")  # ours -> stock
    np.testing.assert_array_equal(stock.layers[1].embeddings.numpy(), np.ones((50, 3)))
    assert Embedding.from_config(ours.layers[1].get_config()).input_dim == 50


def test_gradient_stays_sparse():
    import tensorflow as tf

    from tfstrat.keras.layers import Embedding

    layer = Embedding(50, 3)
    layer.build()
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(tf.constant([[1, 2, 2]])))
    (grad,) = tape.gradient(loss, layer.trainable_variables)
    assert isinstance(grad, tf.IndexedSlices)
    assert sorted(grad.indices.numpy().tolist()) == [1, 2, 2]


def test_part_bounds_match_embedding_lookup_div_strategy():
    from tfstrat.keras.layers import part_bounds

    assert part_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert part_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
