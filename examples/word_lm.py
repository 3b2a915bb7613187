"""A word-level LSTM language model with a large vocabulary and a sampled softmax.

Both big matrices are `tfstrat.keras.layers.Embedding` tables: the input embedding and the
softmax weights (with their bias as one more column). Training uses a sampled softmax: each
step looks up only the rows of its tokens, its targets and 256 sampled words, so under Hybrid
with ps tasks (the NLP case, where Parallax shines) both tables stay on the ps tasks and
only those rows travel, while the LSTM is all-reduced:

    tfstrat launch --workers 2 --ps 1 --threads-per-task 1 -- python examples/word_lm.py --quick
    tfstrat launch --workers 2 -- python examples/word_lm.py --strategy car --quick
    python examples/word_lm.py --quick                          # one process

The held-out perplexity is computed with the full softmax over the whole vocabulary. Data:
Penn Treebank (`ptb_text_only`) from tensorflow-datasets when it is already in its data_dir or
with `--download`; else a generated language (a Zipf vocabulary in which most words are
followed by one of two words of their own), printed with the perplexity of its unigram
distribution (what a model that ignores context reaches) and of the true model (the floor).
"""

from __future__ import annotations

import time

import _common
import numpy as np


def synthetic(vocab: int, sequences: int, steps: int, seed: int = 0):
    """(inputs, targets) int32 (sequences, steps), and the perplexities (unigram, true)."""
    rng = np.random.default_rng(seed)
    unigram = 1.0 / np.arange(1, vocab + 1) ** 1.1
    unigram /= unigram.sum()
    successors = rng.choice(vocab, size=(vocab, 2), p=unigram)  # each word's two followers
    follow = 0.85
    tokens = np.empty((sequences, steps + 1), np.int64)
    tokens[:, 0] = rng.choice(vocab, sequences, p=unigram)
    for t in range(steps):
        pick = successors[tokens[:, t], rng.integers(0, 2, sequences)]
        free = rng.choice(vocab, sequences, p=unigram)
        tokens[:, t + 1] = np.where(rng.random(sequences) < follow, pick, free)
    cur, nxt = tokens[:, :-1].ravel(), tokens[:, 1:].ravel()
    p_true = (
        follow * 0.5 * ((successors[cur, 0] == nxt) + (successors[cur, 1] == nxt))
        + (1 - follow) * unigram[nxt]
    )
    counts = np.bincount(nxt, minlength=vocab) / len(nxt)
    floors = {
        "unigram_perplexity": float(np.exp(-np.log(counts[nxt]).mean())),
        "true_perplexity": float(np.exp(-np.log(p_true).mean())),
    }
    return tokens[:, :-1].astype(np.int32), tokens[:, 1:].astype(np.int32), floors


def penn_treebank(data_dir, download: bool, vocab: int, steps: int):
    """PTB's train and test text as (inputs, targets) windows, word ids sorted by frequency."""
    import collections

    import tensorflow_datasets as tfds

    splits = tfds.load(
        "ptb_text_only", split=["train", "test"], data_dir=data_dir, download=download
    )
    words = {
        name: [w for ex in tfds.as_numpy(ds) for w in ex["sentence"].decode().split() + ["<eos>"]]
        for name, ds in zip(("train", "test"), splits)
    }
    ranked = [w for w, _ in collections.Counter(words["train"]).most_common(vocab - 1)]
    index = {w: i for i, w in enumerate(ranked)}
    unk = len(ranked)  # words outside the vocabulary (PTB has its own <unk> already)

    def windows(ws):
        ids = np.array([index.get(w, unk) for w in ws], np.int32)
        n = (len(ids) - 1) // steps
        return ids[: n * steps].reshape(n, steps), ids[1 : n * steps + 1].reshape(n, steps)

    return windows(words["train"]), windows(words["test"]), len(ranked) + 1


def build(keras, tfstrat, vocab: int, steps: int, width: int, sampled: int):
    """(train model: per-token sampled-softmax loss, eval model: full-softmax logits)."""
    import tensorflow as tf

    class SampledSoftmaxLoss(keras.layers.Layer):
        """Each token's loss over its target and `sampled` words drawn log-uniformly (Zipf:
        ids are ranked by frequency), corrected for how often each is drawn, accidental hits
        masked: tf.nn.sampled_softmax_loss, with the weights looked up from a table layer so
        that only these rows are read. The draws come from a Keras SeedGenerator (its state
        advances every step under every strategy)."""

        def __init__(self, table, **kwargs):
            super().__init__(**kwargs)
            self.table = table
            self.seed = keras.random.SeedGenerator(1)

        def call(self, hidden, targets):
            d = hidden.shape[-1]
            h = tf.reshape(hidden, [-1, d])
            t = tf.reshape(tf.cast(targets, tf.int32), [-1])
            log_range = float(np.log(vocab + 1))
            u = keras.random.uniform((sampled,), seed=self.seed)
            words = tf.clip_by_value(tf.cast(tf.exp(u * log_range), tf.int32) - 1, 0, vocab - 1)

            def log_expected(ids):  # log(sampled * Q(id)), Q(id) = log((id+2)/(id+1))/log(V+1)
                ids = tf.cast(ids, tf.float32)
                return tf.math.log(sampled * tf.math.log((ids + 2) / (ids + 1)) / log_range)

            rows = self.table(tf.concat([t, words], 0))
            n = tf.shape(h)[0]
            true_rows, word_rows = rows[:n], rows[n:]
            true_logit = tf.reduce_sum(h * true_rows[:, :d], -1) + true_rows[:, d]
            true_logit -= log_expected(t)
            logits = tf.matmul(h, word_rows[:, :d], transpose_b=True) + word_rows[:, d]
            logits -= log_expected(words)[None, :]
            hit = tf.equal(t[:, None], words[None, :])
            logits = tf.where(hit, tf.fill(tf.shape(logits), -1e9), logits)
            logits = tf.concat([true_logit[:, None], logits], 1)
            loss = tf.nn.sparse_softmax_cross_entropy_with_logits(tf.zeros([n], tf.int32), logits)
            return tf.reshape(loss, tf.shape(targets))

    class FullSoftmax(keras.layers.Layer):
        """Logits over the whole vocabulary (every row of the table: evaluation only)."""

        def __init__(self, table, **kwargs):
            super().__init__(**kwargs)
            self.table = table

        def call(self, hidden):
            # In chunks of 4,096 rows: under Hybrid one lookup's reply must stay under gRPC's
            # 4 MiB message limit (the whole 20,000 x 65 table is 5.2 MB).
            rows = tf.concat(
                [self.table(tf.range(a, min(a + 4096, vocab))) for a in range(0, vocab, 4096)], 0
            )
            return tf.einsum("btd,vd->btv", hidden, rows[:, :-1]) + rows[:, -1]

    tokens = keras.Input((steps,), dtype="int32", name="tokens")
    targets = keras.Input((steps,), dtype="int32", name="targets")
    x = tfstrat.keras.layers.Embedding(vocab, width, name="words")(tokens)
    # The LSTM's outputs feed the softmax directly. (A Dense on these 3-D outputs has a kernel
    # gradient of unknown static shape in TF 2.21, which tfstrat's multi-worker all-reduce
    # does not take yet.)
    hidden = keras.layers.LSTM(width, return_sequences=True)(x)
    softmax = tfstrat.keras.layers.Embedding(vocab, width + 1, name="softmax")
    # Built now, eagerly: under Hybrid building places the table on the ps, which cannot be
    # done while Keras traces the layers that call it.
    softmax.build((None,))
    loss = SampledSoftmaxLoss(softmax, name="sampled_softmax")(hidden, targets)
    train = keras.Model([tokens, targets], loss)
    evaluate = keras.Model(tokens, FullSoftmax(softmax, name="full_softmax")(hidden))
    return train, evaluate


def main():
    parser = _common.parser(__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--sequences", type=int, default=None, help="training windows")
    parser.add_argument("--steps", type=int, default=None, help="words per window")
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--sampled", type=int, default=256, help="sampled words per step")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument("--learning-rate", type=float, default=0.05, help="Adam's")
    args = parser.parse_args()
    vocab = args.vocab or (20_000 if args.quick else 100_000)
    steps = args.steps or (20 if args.quick else 35)
    width = args.width or (64 if args.quick else 128)
    epochs = args.epochs or (3 if args.quick else 4)

    strategy = _common.make_strategy(args.strategy)  # first, before any other TensorFlow op
    import keras

    import tfstrat

    floors, data = {}, "synthetic"
    if not args.quick and _common.tfds_available("ptb_text_only", args.data_dir, args.download):
        train, test, vocab = penn_treebank(args.data_dir, args.download, min(vocab, 10_000), steps)
        data = "ptb_text_only"
    else:
        if not args.quick:
            print("data: a generated language instead of Penn Treebank")
        n = args.sequences or (8_000 if args.quick else 100_000)
        x, y, floors = synthetic(vocab, n + max(n // 10, 256), steps)
        train, test = (x[:n], y[:n]), (x[n:], y[n:])
        print(
            f"data: {vocab:,} words; unigram perplexity {floors['unigram_perplexity']:.1f}, "
            f"true model {floors['true_perplexity']:.1f}"
        )
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model, full = build(keras, tfstrat, vocab, steps, width, args.sampled)
        # Adam steps on the tables' true gradient (tfstrat's Embedding sums a word's repeats in
        # a batch, under every strategy): --quick reaches held-out perplexity ~22-27 with 0.05,
        # ~97 with 0.01, and diverges with 0.2.
        optimizer = keras.optimizers.Adam(args.learning_rate)
        model.compile(optimizer=optimizer, loss=lambda _, loss: loss)
        full.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    start = time.perf_counter()
    history = model.fit(
        (train[0], train[1]),
        np.zeros(train[1].shape, np.float32),  # the model's output is the loss
        batch_size=args.batch_size,
        epochs=epochs,
        verbose=2,
        callbacks=[_common.throughput()],
    )
    seconds = time.perf_counter() - start
    held_out = test[0][:512], test[1][:512]  # the full softmax reads the whole table a step
    cross_entropy = full.evaluate(*held_out, batch_size=16, verbose=0)
    _common.report(
        args,
        "word_lm",
        strategy,
        history,
        "held-out perplexity",
        float(np.exp(cross_entropy)),
        data=data,
        vocab=vocab,
        fit_seconds=seconds,
        **floors,
    )


if __name__ == "__main__":
    main()
