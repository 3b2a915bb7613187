"""Trains a two-table click model (user, item -> clicked?) on generated data.

With ps tasks, `tfstrat.auto()` is Hybrid: the dense layers are all-reduced among the workers
and both embedding tables live on the ps tasks, so a step moves only the rows it looks up:

    tfstrat launch --workers 2 --ps 1 --threads-per-task 1 -- python examples/recommender.py

Without ps tasks the same script runs CollectiveAllReduce (`--workers 2`) or one process. The
model code is plain Keras; tfstrat's lines are the strategy and its Embedding layer.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np


def clicks(n: int, users: int, items: int, seed: int = 0):
    """(user, item) pairs and whether the user clicked: each user and item has a hidden appeal,
    and a click is likelier the more the two add up to."""
    rng = np.random.default_rng(seed)
    user_appeal, item_appeal = rng.normal(size=users), rng.normal(size=items)
    u = (rng.zipf(1.3, n) - 1) % users  # a few heavy users, a long tail
    i = rng.integers(0, items, n)
    p = 1 / (1 + np.exp(-3 * (user_appeal[u] + item_appeal[i])))
    y = rng.random(n) < p
    return u.astype("int32"), i.astype("int32"), y.astype("float32")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=100_000)
    parser.add_argument("--items", type=int, default=5_000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256, help="global batch")
    args = parser.parse_args()

    import tfstrat

    strategy = tfstrat.auto()  # first, before any other TensorFlow op
    import keras

    u, i, y = clicks(200_000, args.users, args.items)
    split = 180_000
    keras.utils.set_random_seed(0)
    with strategy.scope():
        user, item = keras.Input((), dtype="int32"), keras.Input((), dtype="int32")
        eu = tfstrat.keras.layers.Embedding(args.users, 16, name="users")(user)
        ei = tfstrat.keras.layers.Embedding(args.items, 16, name="items")(item)
        x = keras.layers.Concatenate()([eu, ei, eu * ei])
        x = keras.layers.Dense(64, activation="relu")(x)
        model = keras.Model([user, item], keras.layers.Dense(1)(x))
        model.compile(
            optimizer=keras.optimizers.Adagrad(0.1),
            loss=keras.losses.BinaryCrossentropy(from_logits=True),
            metrics=[keras.metrics.BinaryAccuracy(threshold=0.0)],
        )
    # Under `tfstrat launch --backup-dir DIR` (TFSTRAT_BACKUP_DIR): a restart resumes from DIR.
    backup = (
        [tfstrat.keras.callbacks.BackupAndRestore()] if os.environ.get("TFSTRAT_BACKUP_DIR") else []
    )
    start = time.time()
    model.fit(
        (u[:split], i[:split]),
        y[:split],
        batch_size=args.batch_size,
        epochs=args.epochs,
        verbose=2,
        callbacks=backup,
    )
    seconds = time.time() - start
    _, accuracy = model.evaluate((u[split:], i[split:]), y[split:], batch_size=1024, verbose=0)
    print(
        f"{type(strategy).__name__}: held-out accuracy {accuracy:.3f} "
        f"({split * args.epochs / seconds:,.0f} examples/s)"
    )


if __name__ == "__main__":
    main()
