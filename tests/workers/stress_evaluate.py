"""Many short `evaluate` calls under CollectiveAllReduce (run by `tfstrat launch`).

Usage: python stress_evaluate.py CALLS
Keras reads one batch before each evaluate to build the model, then drops that iterator;
deleting a TF 2.21 MultiDeviceIterator whose background thread is still prefetching crashed a
worker (SIGSEGV) about once in 50 calls. tfstrat skips that read once the model is built, and
a worker whose one device is the CPU no longer reads through a MultiDeviceIterator at all.
Prints "iterator <class>" (of the worker's input iterator) and "done CALLS <loss>".
"""

import sys

import numpy as np

import tfstrat

strategy = tfstrat.CollectiveAllReduce(timeout=60)

import keras  # noqa: E402

calls = int(sys.argv[1])
rng = np.random.default_rng(0)
x = rng.normal(size=(200, 6)).astype("float32")
y = (x[:, 0] > 0).astype("int64")
with strategy.scope():
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)]
    )
    model.compile(
        optimizer="sgd",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
import tensorflow as tf  # noqa: E402

batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(24)
it = iter(strategy.experimental_distribute_dataset(batches))
sys.stdout.write(f"iterator {type(it._iterators[0]._iterator).__name__}\n")  # one write(2)
del it
model.fit(x, y, batch_size=24, epochs=1, verbose=0)
losses = {round(float(model.evaluate(x, y, batch_size=24, verbose=0)[0]), 6) for _ in range(calls)}
sys.stdout.write(f"done {calls} {sorted(losses)}\n")
