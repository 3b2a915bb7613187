"""Trains a small classifier on handwritten digits with every worker of a cluster.

Run on this machine with two worker processes:

    tfstrat launch --workers 2 --threads-per-task 1 -- python examples/digits.py --epochs 5

or alone (one process, no cluster): `python examples/digits.py`. The code is plain Keras; the only
tfstrat line is the strategy. `--data tfds:mnist` uses TensorFlow Datasets where it can download.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np


def load(data: str):
    """Returns ((x_train, y_train), (x_test, y_test)) as float32 images in [0, 1] and int labels."""
    if data.startswith("tfds:"):
        try:
            import tensorflow_datasets as tfds

            train, test = tfds.load(
                data[5:], split=["train", "test"], batch_size=-1, as_supervised=True
            )
            to_np = lambda d: (np.asarray(d[0], np.float32) / 255.0, np.asarray(d[1], np.int64))
            return to_np(tfds.as_numpy(train)), to_np(tfds.as_numpy(test))
        except Exception as e:  # no network here: fall back to the digits shipped here
            print(f"could not load {data} ({type(e).__name__}); using the digits in examples/data")
    # The UCI handwritten digits (Alpaydin and Kaynak, 1998; CC BY 4.0), as scikit-learn ships
    # them: 1,797 8x8 images of values 0-16.
    with np.load(
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "digits.npz")
    ) as f:
        x = (f["x"].reshape(-1, 8, 8) / 16.0).astype(np.float32)[..., None]  # 8x8x1
        y = f["y"].astype(np.int64)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return (x[:split], y[:split]), (x[split:], y[split:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument("--data", default="digits", help="digits, or tfds:NAME")
    args = parser.parse_args()

    import tfstrat

    # First, before any other TensorFlow op: under `tfstrat launch --workers 2` this is
    # CollectiveAllReduce (TF_CONFIG lists 2 workers); alone, TensorFlow's default strategy.
    strategy = tfstrat.auto()
    import keras

    (x_train, y_train), (x_test, y_test) = load(args.data)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input(x_train.shape[1:]),
                keras.layers.Conv2D(16, 3, activation="relu", padding="same"),
                keras.layers.Flatten(),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(10, activation="softmax"),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )
    start = time.perf_counter()
    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, verbose=2)
    seconds = time.perf_counter() - start
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=args.batch_size, verbose=0)
    examples = len(x_train) * args.epochs
    print(
        f"result: {strategy.num_replicas_in_sync} replica(s), test accuracy {accuracy:.4f}, "
        f"loss {loss:.4f}, {examples / seconds:,.0f} examples/s (global, incl. first-step tracing)"
    )


if __name__ == "__main__":
    main()
