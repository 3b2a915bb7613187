"""One worker of the strategy-twice and save-on-every-worker cluster tests, or the reference.

Usage: python reuse_save.py OUT_DIR [--strategy collective|ps] [--reference] [--stock-save]

keras.io's distributed guide calls `run_training()`, which creates the strategy, more than once
per process. This script does it three times (the third with TensorFlow's collectives under
CollectiveAllReduce), each time with one worker arriving 2 s late (what broke stock
MultiWorkerMirroredStrategy), keeps the first strategy and its model and trains that model
again afterwards, and checks that a strategy of another TF_CONFIG is refused. Then every
worker saves in a row (`model.save`, `save_weights`, Keras's own `ModelCheckpoint`), each save
after a change of the weights, and loads each file at once: the loaded model must predict what
the saving model predicts, on every worker. `--stock-save` uses Keras's savers unchanged (to
measure the race they have). Writes OUT_DIR/<task>.npz (weights, evaluations) and
OUT_DIR/<task>.json (save outcomes).
"""

import argparse
import json
import os
import time

import numpy as np

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--strategy", default="collective", choices=["collective", "ps"])
parser.add_argument("--reference", action="store_true")
parser.add_argument("--stock-save", action="store_true")
parser.add_argument("--saves", type=int, default=4)
args = parser.parse_args()

import tfstrat  # noqa: E402

config = None if args.reference else tfstrat.TFConfig.from_env()
index = 0 if config is None else config.task_index
task = "reference" if config is None else f"{config.task_type}_{index}"
BATCH, LATE = 24, 2.0


def make_strategy(**kw):
    if args.reference:
        return None
    if args.strategy == "ps":
        return tfstrat.ParameterServer(timeout=60, **kw)
    return tfstrat.CollectiveAllReduce(timeout=60, **kw)


# Created before any other TensorFlow op: collectives are configured at program start.
first = make_strategy()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from common import build_model, compile_model, data, optimizer  # noqa: E402

if args.stock_save:
    from tfstrat.keras import _saving

    _saving.uninstall()

x, y = data(BATCH * 21)
probe = x[:40]
results, outcomes = {}, {}


def run_training(strategy, late_worker, run="", **kw):
    """keras.io's run_training(): a strategy (made here unless given), a model, a fit. The
    late worker starts its strategy LATE seconds after the other has started its own (a
    marker file says when), and records by how much it was late."""
    if strategy is None and not args.reference:
        mark = os.path.join(args.out, f"{run}.started")
        if index == late_worker:
            other = _started(mark)
            time.sleep(LATE)  # the other worker's strategy is ready and exchanging first
            outcomes[f"{run}/late_by"] = time.time() - other
        else:
            with open(mark + ".tmp", "w") as f:
                f.write(str(time.time()))
            os.replace(mark + ".tmp", mark)
        strategy = make_strategy(**kw)
    with (strategy or tf.distribute.get_strategy()).scope():
        model = compile_model(build_model(), optimizer("sgdm", densify=args.reference))
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return strategy, model


def _started(mark: str, timeout: float = 120) -> float:
    """When the other worker started its strategy (its marker file), waiting up to `timeout`."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(mark):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other worker did not start its strategy ({mark})")
        time.sleep(0.05)
    with open(mark) as f:
        return float(f.read())


def keep(name, model):
    for i, w in enumerate(model.weights):
        results[f"{name}/w{i}"] = w.numpy()
    results[f"{name}/iterations"] = np.array(model.optimizer.iterations.numpy())


s1, m1 = run_training(first, None)
keep("run1", m1)
s2, m2 = run_training(None, 1, "run2")
keep("run2", m2)
extra = {"communication": "ring"} if args.strategy == "collective" else {}
s3, m3 = run_training(None, 0, "run3", **extra)
keep("run3", m3)
# The first strategy is still referenced and still works: its model trains a third epoch.
m1.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
keep("first_again", m1)
results["first_again/evaluate"] = np.array(m1.evaluate(x, y, batch_size=BATCH, verbose=0))

if not args.reference and args.strategy == "collective":  # ParameterServer: not guarded
    other = dict(config.cluster)
    other["worker"] = [f"127.0.0.1:{1 + i}" for i in range(len(other["worker"]))]
    try:
        make_strategy(tf_config=tfstrat.TFConfig(other, config.task_type, index))
        outcomes["other_tf_config"] = "created"
    except ValueError as e:
        outcomes["other_tf_config"] = str(e)


def attempt(what, load, expected):
    """Loads a file just saved; records the largest prediction difference or the error."""
    try:
        got = load().predict(probe, verbose=0)
        outcomes.setdefault(what, []).append(float(np.abs(got - expected).max()))
    except Exception as e:  # a torn or missing file (stock Keras)
        outcomes.setdefault(what, []).append(f"{type(e).__name__}: {str(e)[:200]}")


def saved(save, path):
    """tfstrat's saves must not fail; stock Keras's may (h5py's file lock): recorded."""
    if not args.stock_save:
        return save(path)
    try:
        save(path)
    except Exception as e:
        outcomes.setdefault("save_errors", []).append(f"{type(e).__name__}: {str(e)[:120]}")


def fresh_model():
    return compile_model(build_model(), optimizer("sgdm"))


def chief_predictions(values):
    """What the chief's model predicts with `values` (computed here, no strategy)."""
    model = build_model()
    model.set_weights(values)
    return np.asarray(model(probe, training=False))


if not args.reference:
    base = [w.numpy() for w in m2.weights]
    model_path = os.path.join(args.out, "m.keras")
    weights_path = os.path.join(args.out, "m.weights.h5")
    for k in range(args.saves):
        # Each worker's weights differ (as BatchNormalization statistics do),
        # so two writers of one file interleave different bytes; no collective between saves.
        for w, b in zip(m2.weights, base):
            w.assign(b + 0.01 * (k + 1) + 0.001 * index)
        expected = chief_predictions([b + 0.01 * (k + 1) for b in base])
        saved(m2.save, model_path)
        attempt("save", lambda: keras.saving.load_model(model_path), expected)
        saved(m2.save_weights, weights_path)

        def load_weights():
            model = fresh_model()
            model.load_weights(weights_path)
            return model

        attempt("save_weights", load_weights, expected)
    with open(os.path.join(args.out, f"{task}.json"), "w") as f:
        json.dump(outcomes, f)  # kept if stock Keras's ModelCheckpoint fails below
    print(f"{task}: saved in a row", json.dumps(outcomes)[-1500:], flush=True)
    # Keras's own ModelCheckpoint (it calls model.save / save_weights) on a shared path.
    checkpoints = [
        keras.callbacks.ModelCheckpoint(os.path.join(args.out, "ck.keras")),
        keras.callbacks.ModelCheckpoint(
            os.path.join(args.out, "ck.weights.h5"), save_weights_only=True
        ),
    ]
    m3.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=checkpoints)
    expected = m3.predict(probe, verbose=0)
    attempt("checkpoint", lambda: keras.saving.load_model(checkpoints[0].filepath), expected)

    def load_checkpoint_weights():
        model = fresh_model()
        model.load_weights(checkpoints[1].filepath)
        return model

    attempt("checkpoint_weights", load_checkpoint_weights, expected)
    outcomes["files"] = sorted(os.listdir(args.out))

np.savez(os.path.join(args.out, f"{task}.npz"), **results)
with open(os.path.join(args.out, f"{task}.json"), "w") as f:
    json.dump(outcomes, f)
print(f"{task}: done", json.dumps(outcomes)[:2000], flush=True)
