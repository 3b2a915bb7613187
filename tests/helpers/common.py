"""Model, data and reference training shared by the worker scripts of the cluster tests.

The reference is single-device Keras training on the same global batches in the same order,
with sparse gradients densified: tfstrat deduplicates an Embedding's gradient rows, which is the
dense update's semantics; Keras's own sparse Adam/Adagrad treat duplicate rows separately.
"""

from __future__ import annotations

import numpy as np

VOCAB, SEQ, CLASSES = 1000, 8, 4


def data(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCAB, (n, SEQ)).astype("int32")
    y = (x[:, 0] % CLASSES).astype("int64")  # learnable, so the loss moves
    return x, y


def digits():
    """The UCI handwritten digits (1,797 8x8 images of 0-16, CC BY 4.0; Alpaydin and Kaynak,
    1998) that examples/data ships, as rows of 64: (x / 16 as float32, y)."""
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "data", "digits.npz")
    with np.load(path) as f:
        return (f["x"] / 16.0).astype("float32"), f["y"].astype("int64")


def build_model():
    """Embedding + Conv1D + Dense, with weights fixed by the random seed."""
    import keras

    keras.utils.set_random_seed(7)
    inputs = keras.Input((SEQ,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, 8)(inputs)
    x = keras.layers.Conv1D(8, 3, activation="relu")(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(16, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(CLASSES)(x))


def optimizer(kind: str, /, densify: bool = False, **kw):
    """`sgdm` (SGD with momentum), `adam`, `sgd` or `adagrad`; `densify=True` for the
    single-device reference; `kw` go to the optimizer (`name=` too)."""
    import keras
    import tensorflow as tf

    cls = {
        "sgdm": keras.optimizers.SGD,
        "adam": keras.optimizers.Adam,
        "sgd": keras.optimizers.SGD,
        "adagrad": keras.optimizers.Adagrad,
    }[kind]
    args = {
        "sgdm": dict(learning_rate=0.05, momentum=0.9),
        "adam": dict(learning_rate=0.01),
        "sgd": dict(learning_rate=0.1),
        "adagrad": dict(learning_rate=0.1),
    }
    args = {**args[kind], **kw}
    if not densify:
        return cls(**args)

    class Densified(cls):
        def apply(self, grads, trainable_variables=None):
            grads = [
                tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads
            ]
            return super().apply(grads, trainable_variables)

    return Densified(**args)


def compile_model(model, opt, **kw):
    """`model.compile` with the suite's loss and metric; `jit_compile` False unless given,
    for the reference and the strategies alike (Keras's "auto" is XLA wherever a GPU is
    listed, a difference from the strategies' runs that is not theirs)."""
    import keras

    kw.setdefault("jit_compile", False)
    model.compile(
        **kw,
        optimizer=opt,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def diloco_outer_step(anchor, momentum, weights) -> list:
    """DiLoCo's outer step written out: Keras's SGD(0.7, momentum=0.9, nesterov=True) on the
    pseudo-gradient anchor - weights (float32). Updates `momentum` in place; returns the new
    weights, which are also the next anchor."""
    new = []
    for k, (a, w) in enumerate(zip(anchor, weights, strict=True)):
        g = a - w
        momentum[k] = np.float32(0.9) * momentum[k] - np.float32(0.7) * g
        new.append(a + np.float32(0.9) * momentum[k] - np.float32(0.7) * g)
    return new


def relative_errors(weights, reference) -> list[float]:
    """||w - w_ref|| / ||w_ref|| per variable (0 where the reference is all zeros and w equals it)."""
    errs = []
    for w, r in zip(weights, reference, strict=True):
        denom = np.linalg.norm(r)
        errs.append(float(np.linalg.norm(w - r) / denom) if denom else float(np.abs(w).max()))
    return errs


def dump_loaded(build, paths) -> None:
    """Loads each .weights.h5 into `build(stock=True)` (plain Keras) and writes its trainable
    weights to <path>.npz: how the tests read a checkpoint a tfstrat cluster wrote."""
    for path in paths:
        model = build(stock=True)
        model.load_weights(path)
        np.savez(path + ".npz", *[w.numpy() for w in model.weights if w.trainable])


def ps_pid() -> int:
    """The process of ps:0 of this task's cluster (the one whose TF_CONFIG names it ps:0)."""
    import json
    import os

    address = json.loads(os.environ["TF_CONFIG"])["cluster"]["ps"][0]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        for item in environ:
            if item.startswith(b"TF_CONFIG="):
                config = json.loads(item[len(b"TF_CONFIG=") :])
                task = config.get("task", {})
                if task.get("type") == "ps" and config["cluster"]["ps"][0] == address:
                    return int(pid)
    raise RuntimeError(f"no process serves ps:0 at {address}")


def npz_weights(npz, name) -> list:
    """The weights `collective_equiv.py` saved for run `name` (NAME/w0, NAME/w1, ...)."""
    keys = sorted(
        (k for k in npz.files if k.startswith(f"{name}/w")), key=lambda k: int(k[len(name) + 2 :])
    )
    return [npz[k] for k in keys]


def check_collective_equiv(results: list, ref, tolerance: float) -> None:
    """Every worker's `collective_equiv.py` results against the one-device reference `ref`:
    the tf.data run with steps_per_execution=3 (weights, 12 steps), and the SGD+momentum and
    Adam runs (weights, iterations, evaluate, predict, val_loss); each example seen as often as
    on one device in a shuffled epoch; the workers' weights within 1e-6 of each other."""
    for i, r in enumerate(results):  # tf.data, steps_per_execution=3
        errs = relative_errors(npz_weights(r, "dataset"), npz_weights(ref, "dataset"))
        assert max(errs) <= tolerance, ("dataset", i, errs)
        assert int(r["dataset/iterations"]) == 12
    seen = ref["shuffle/times_seen"]
    np.testing.assert_allclose(seen, seen[0], rtol=1e-5)  # one device: each example alike
    for name in ("sgdm", "adam"):
        for i, r in enumerate(results):
            errs = relative_errors(npz_weights(r, name), npz_weights(ref, name))
            assert max(errs) <= tolerance, (name, i, errs)
            assert int(r[f"{name}/iterations"]) == int(ref[f"{name}/iterations"])
            np.testing.assert_allclose(r[f"{name}/evaluate"], ref[f"{name}/evaluate"], rtol=1e-5)
            np.testing.assert_allclose(r[f"{name}/predict"], ref[f"{name}/predict"], atol=1e-5)
            np.testing.assert_allclose(r[f"{name}/val_loss"], ref[f"{name}/val_loss"], rtol=1e-5)
    # Every example seen as often as on one device in a shuffled epoch: the workers drew one
    # shared permutation (else some examples are seen twice and others never).
    for r in results:
        np.testing.assert_allclose(r["shuffle/times_seen"], seen, rtol=1e-5)
    for name in ("sgdm", "adam"):
        # The workers agree with each other too.
        for r in results[1:]:
            errs = relative_errors(npz_weights(r, name), npz_weights(results[0], name))
            assert max(errs) <= 1e-6, (name, errs)


# Two replicas sum a batch's halves, one device the whole: float16 and bfloat16 round them
# differently (measured: 2.0e-4 and 4.2e-3 after 8 steps).
MIXED_TOLERANCE = {"float32": 1e-5, "mixed_float16": 1e-3, "mixed_bfloat16": 2e-2}


def check_mixed_precision(out, run: str, reference) -> dict:
    """`mixed_precision.py` run `run`'s report (loss scales, skips, finite) equal to one
    device's and its weights within the policy's rounding of one device's (OUT/RUN.json and
    .npz against REFERENCE/reference.*); returns its weights."""
    import json

    report = json.loads((out / f"{run}.json").read_text())
    expected = json.loads((reference / "reference.json").read_text())
    arrays, ref = np.load(out / f"{run}.npz"), np.load(reference / "reference.npz")
    assert report, run
    for key, mine in report.items():
        assert mine == expected[key], (run, key, mine, expected[key])  # scales, skips, finite
        assert mine["finite"], (run, key)
        names = [k for k in arrays.files if k.startswith(key + "/")]
        errs = relative_errors([arrays[k] for k in names], [ref[k] for k in names])
        assert names and max(errs) <= MIXED_TOLERANCE[key.split("/")[0]], (run, key, errs)
    skipped = expected.get("mixed_float16/fit")
    if skipped:  # 2 skipped: one each epoch
        assert skipped["iterations"] == 6 and skipped["scales"][-1] == 8192.0, skipped
    return {k: arrays[k] for k in arrays.files}
