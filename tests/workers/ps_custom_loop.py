"""A custom training loop (TensorFlow's tutorial) under ParameterServer sync, which must refuse
it by name rather than train it differently from one device. Run by `tfstrat launch --ps 1`."""

import tfstrat

strategy = tfstrat.ParameterServer(mode="sync", timeout=30)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.1)
x = np.ones((8, 4), "float32")
with tf.GradientTape() as tape:
    loss = tf.reduce_mean(model(x) ** 2)
grads = tape.gradient(loss, model.trainable_variables)
optimizer.apply_gradients(zip(grads, model.trainable_variables))
print("TRAINED-ANYWAY")  # never reached
