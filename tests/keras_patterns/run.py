"""Runs keras.io-style patterns under one strategy and writes what they trained.

Usage: python run.py PATTERN[,PATTERN...] STRATEGY OUT_DIR

STRATEGY is one of `STRATEGIES` (below). Single-process strategies run as they are; the
multi-worker ones run under `tfstrat launch` (see `table.py`, which starts the right cluster).
Each task writes OUT_DIR/PATTERN/STRATEGY.TASK.npz (the model's weights w0, w1, ... and
metrics m:NAME) or, when the pattern raised, OUT_DIR/PATTERN/STRATEGY.TASK.error (its last
line). A pattern that fails on every task the same way leaves the others to run.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

# One process, two replicas: the CPU is split before TensorFlow's runtime starts.
SPLIT = {"mirrored": 2, "stock-mirrored": 2}
# What `tfstrat launch` starts for each strategy: (workers, ps tasks).
CLUSTERS = {
    "collective": (2, 0),
    "hybrid": (2, 1),
    "hybrid-nops": (2, 0),
    "localsgd": (2, 0),
    "ps": (2, 1),
    "stock-mwms": (2, 0),
}
STRATEGIES = (
    "none",
    "none-dense",
    "none-lazy",
    "mirrored",
    "collective",
    "hybrid",
    "hybrid-nops",
    "localsgd",
    "ps",
    "stock-mirrored",
    "stock-mwms",
)
TIMEOUT = 60  # every collective and ps wait of the strategies (seconds)


def make_strategy(kind: str):
    """The strategy of `kind`, created before any other TensorFlow op (multi-worker ones
    configure collectives at program start)."""
    import tfstrat

    if kind in SPLIT:
        tfstrat.split_cpu(SPLIT[kind])
    if kind == "none":
        return None
    if kind == "none-dense":
        densify_sparse_gradients()
        return None
    if kind == "none-lazy":
        lazy_tables()
        return None
    if kind == "mirrored":
        return tfstrat.MirroredNCCL(timeout=TIMEOUT)
    if kind == "collective":
        return tfstrat.CollectiveAllReduce(timeout=TIMEOUT)
    if kind in ("hybrid", "hybrid-nops"):
        return tfstrat.Hybrid(timeout=TIMEOUT)
    if kind == "localsgd":  # equals one device with plain SGD only
        return tfstrat.LocalSGD(sync_every=1, timeout=TIMEOUT)
    if kind == "ps":
        return tfstrat.ParameterServer(mode="sync", timeout=TIMEOUT)
    import tensorflow as tf

    if kind == "stock-mirrored":
        return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    if kind == "stock-mwms":
        options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=TIMEOUT)
        return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    raise ValueError(f"Received: strategy={kind!r}. Use one of {', '.join(STRATEGIES)}.")


def densify_sparse_gradients() -> None:
    """One device, every optimizer given dense gradients: the reference where Adam-like
    optimizers meet an Embedding's repeated ids. Keras 3's own sparse Adam squares each
    repeat of a row separately; tfstrat sums a row's repeats first (its replicas' rows must
    be summed anyway), which is the dense gradient's step (README, "Sparse gradients")."""
    import tensorflow as tf
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    keras_apply = BaseOptimizer.apply

    def apply(self, grads, trainable_variables=None):
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        return keras_apply(self, grads, trainable_variables)

    BaseOptimizer.apply = apply


def lazy_tables() -> None:
    """One device, every Embedding's table updated row by row (lazy Adam, the repeats of an id
    summed): the update rule Hybrid's ps applies to the tables it holds, so the reference for
    a run whose tables live on the ps. Weight decay stays Keras's: every row, every step."""
    import keras

    from tfstrat.keras import _rowwise

    keras_build = keras.layers.Embedding.build

    def build(self, input_shape=None):
        keras_build(self, input_shape)
        if getattr(self, "_embeddings", None) is not None:
            _rowwise.mark(self._embeddings, "lazy")

    keras.layers.Embedding.build = build


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    names, kind, out = argv[0].split(","), argv[1], argv[2]
    strategy = make_strategy(kind)
    import numpy as np

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ecosystem import PATTERNS as ECOSYSTEM
    from patterns import PATTERNS, Context

    known = {**PATTERNS, **ECOSYSTEM}

    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"Received: patterns {unknown}. Known: {', '.join(known)}.")
    task = os.environ.get("TFSTRAT_TASK", "main").replace(":", "")
    for name in names:
        where = os.path.join(out, name)
        os.makedirs(where, exist_ok=True)
        base = os.path.join(where, f"{kind}.{task}")
        ctx = Context(strategy, kind, os.path.join(where, f"{kind}.work"))
        try:
            result = known[name](ctx)
        except BaseException as e:  # noqa: BLE001 - every failure is a table cell
            traceback.print_exc()
            line = f"{type(e).__name__}: {e}".strip().splitlines()
            with open(base + ".error", "w") as f:
                f.write(" ".join(line)[:300])
            if not isinstance(e, Exception):
                raise
            continue
        with open(base + ".placement.json", "w") as f:
            why = getattr(strategy, "mirrored_why", {})
            json.dump({**result["placement"], "mirrored_why": why}, f)
        arrays = {f"w{i}": np.asarray(w) for i, w in enumerate(result["weights"])}
        arrays.update({f"m:{k}": np.asarray(v, np.float64) for k, v in result["metrics"].items()})
        np.savez(base + ".npz", **arrays)
        print(f"pattern {name} under {kind} on {task}: done", flush=True)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # Every result is written. A failed pattern can leave TensorFlow threads waiting that
    # keep the interpreter from exiting (seen: steps_per_execution under MirroredNCCL).
    os._exit(code)
