"""A model under MirroredNCCL on 2 logical CPUs, in a process where TF_USE_LEGACY_KERAS=1 and
tf-keras is importable (as Ray Train's TensorflowTrainer leaves a worker): built from
`tf.keras` (tf-keras, Keras 2) or from `import keras` (Keras 3).

Usage: python legacy_keras_run.py tf|keras      prints TRAINED <the model's module> when it trained
"""

import sys

import numpy as np

import tfstrat

tfstrat.split_cpu(2)
strategy = tfstrat.MirroredNCCL(["/cpu:0", "/cpu:1"])
if sys.argv[1] == "tf":
    import tensorflow as tf

    K = tf.keras
else:
    import keras as K
with strategy.scope():
    model = K.Sequential([K.Input((4,)), K.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
model.fit(np.ones((8, 4), "float32"), np.ones((8, 1), "float32"), batch_size=4, verbose=0)
print("TRAINED", type(model).__module__, flush=True)
