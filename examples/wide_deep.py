"""Wide & deep click prediction on a Criteo-like schema: 13 counts, 26 hashed categorical ids.

Every categorical feature is hashed into its own range of one big table (DLRM-style offsets);
the wide part is a per-id weight (an Embedding of width 1), the deep part an Embedding of width
8 and a small MLP. With ps tasks, `--strategy hybrid` (or auto) keeps both tables on the ps
tasks and all-reduces the MLP:

    tfstrat launch --workers 2 --ps 1 --threads-per-task 1 -- python examples/wide_deep.py --quick
    tfstrat launch --workers 2 -- python examples/wide_deep.py --strategy car --quick
    python examples/wide_deep.py --quick                       # one process

Criteo's click logs are not in tensorflow-datasets, so the data is generated: Zipf-distributed
raw ids of varying cardinality, and a click probability from hidden per-value effects of some
features, a cross of two features and two of the counts. The script prints the held-out AUC
next to the AUC of the true probabilities (the best any model can do) and examples/s.
"""

from __future__ import annotations

import time

import _common
import numpy as np

DENSE, CATEGORICAL = 13, 26
CARDINALITIES = [int(c) for c in np.geomspace(20, 2_000_000, CATEGORICAL)]
INFORMATIVE = (0, 3, 7, 12, 18, 22)  # categorical features whose values move the click rate


def criteo_like(n: int, buckets: int, seed: int = 0):
    """(dense float32 (n, 13), hashed ids int32 (n, 26) with offsets, clicks (n,), true p)."""
    rng = np.random.default_rng(seed)
    raw = np.stack([(rng.zipf(1.2, n) - 1) % c for c in CARDINALITIES], axis=1).astype(
        np.int64
    )  # a few frequent values per feature, a long tail
    counts = rng.poisson(rng.lognormal(1.0, 1.0, (n, DENSE))).astype(np.float32)
    dense = np.log1p(counts)
    # Hidden effects: one number per raw value of the informative features (from a hash, so
    # no table of 2 million entries), a cross of features 0 and 3, and two counts.
    logit = -1.0 + 0.6 * (dense[:, 0] - dense[:, 0].mean()) - 0.4 * (dense[:, 1] - 1.0)
    for f in INFORMATIVE:
        logit += 0.8 * _effect(raw[:, f], salt=f)
    logit += 0.7 * _effect(raw[:, 0] * 1_000_003 + raw[:, 3], salt=99)
    p = 1 / (1 + np.exp(-logit))
    clicks = (rng.random(n) < p).astype(np.float32)
    hashed = (raw * 2654435761 + np.arange(CATEGORICAL) * 40503) % (1 << 31) % buckets
    ids = (hashed + np.arange(CATEGORICAL) * buckets).astype(np.int32)
    return dense, ids, clicks, p


def _effect(values: np.ndarray, salt: int) -> np.ndarray:
    """A fixed standard-normal-ish number per value (a hash of value and salt)."""
    h = (values * 0x9E3779B1 + salt * 0x85EBCA77) % (1 << 32)
    u = (h + 0.5) / (1 << 32)
    return np.sqrt(2) * _erfinv(2 * u - 1)


def _erfinv(x: np.ndarray) -> np.ndarray:
    a = 0.147  # Winitzki's approximation: plenty for made-up effects
    ln = np.log(1 - x * x)
    t = 2 / (np.pi * a) + ln / 2
    return np.sign(x) * np.sqrt(np.sqrt(t * t - ln / a) - t)


def build(keras, tfstrat, rows: int):
    dense_in = keras.Input((DENSE,), name="counts")
    ids_in = keras.Input((CATEGORICAL,), dtype="int32", name="ids")
    wide = tfstrat.keras.layers.Embedding(rows, 1, name="wide_table")(ids_in)  # (B, 26, 1)
    wide = keras.layers.Flatten()(wide)
    wide = keras.layers.Concatenate()([wide, dense_in])
    wide = keras.layers.Dense(1, name="wide")(wide)
    deep = tfstrat.keras.layers.Embedding(rows, 8, name="deep_table")(ids_in)  # (B, 26, 8)
    deep = keras.layers.Concatenate()([keras.layers.Flatten()(deep), dense_in])
    for width in (128, 64):
        deep = keras.layers.Dense(width, activation="relu")(deep)
    deep = keras.layers.Dense(1, name="deep")(deep)
    logit = keras.layers.Add()([wide, deep])
    return keras.Model([dense_in, ids_in], logit)


def main():
    parser = _common.parser(__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=None, help="examples (train + held out)")
    parser.add_argument("--buckets", type=int, default=None, help="hash buckets per feature")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=256, help="global batch")
    args = parser.parse_args()
    n = args.rows or (60_000 if args.quick else 600_000)
    buckets = args.buckets or (2_000 if args.quick else 40_000)
    epochs = args.epochs or 3

    strategy = _common.make_strategy(args.strategy)  # first, before any other TensorFlow op
    import keras

    import tfstrat

    print("data: Criteo is not in tensorflow-datasets; a generated Criteo-like click log")
    dense, ids, clicks, p = criteo_like(n, buckets)
    split = int(0.8 * n)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build(keras, tfstrat, CATEGORICAL * buckets)
        model.compile(
            optimizer=keras.optimizers.Adagrad(0.2),
            loss=keras.losses.BinaryCrossentropy(from_logits=True),
            metrics=[keras.metrics.AUC(from_logits=True, name="auc")],
        )
    start = time.perf_counter()
    history = model.fit(
        (dense[:split], ids[:split]),
        clicks[:split],
        batch_size=args.batch_size,
        epochs=epochs,
        verbose=2,
        callbacks=[_common.throughput()],
    )
    seconds = time.perf_counter() - start
    results = model.evaluate(
        (dense[split:], ids[split:]), clicks[split:], batch_size=4096, verbose=0, return_dict=True
    )
    best = _auc(p[split:], clicks[split:])
    _common.report(
        args,
        "wide_deep",
        strategy,
        history,
        "held-out AUC",
        results["auc"],
        best_auc=best,
        fit_seconds=seconds,
    )
    print(f"(the true click probabilities reach AUC {best:.4f} on the same rows)")


def _auc(score: np.ndarray, label: np.ndarray) -> float:
    """ROC AUC by ranks (ties averaged)."""
    order = np.argsort(score, kind="mergesort")
    ranks = np.empty(len(score))
    ranks[order] = np.arange(1, len(score) + 1)
    positives = label > 0.5
    n_pos, n_neg = positives.sum(), (~positives).sum()
    return float((ranks[positives].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


if __name__ == "__main__":
    main()
