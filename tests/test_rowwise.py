"""Keras's Adagrad on a sparse gradient, for the touched rows only (tfstrat/keras/_rowwise.py).

In one process: the row-wise step must give what Keras's own step gives (same arithmetic; TF may
round x / sqrt(y) as x * rsqrt(y), an ulp or so), leave untouched rows and their accumulator
bit for bit alone, and leave dense gradients to Keras.
"""

import os
import subprocess
import sys
import types

import numpy as np
import pytest
import tensorflow as tf

import tfstrat.keras  # noqa: F401  (installs the row-wise step)
from tfstrat.keras import _rowwise

keras = pytest.importorskip("keras")
V, D = 50, 4


def _train(rowwise: bool, steps, dense=False):
    rng = np.random.default_rng(0)
    table = keras.Variable(rng.normal(size=(V, D)).astype("float32"))
    opt = keras.optimizers.Adagrad(0.5, initial_accumulator_value=0.1, epsilon=1e-7)
    if not rowwise:
        opt.update_step = types.MethodType(_rowwise.keras_update_step, opt)
    opt.build([table])

    @tf.function
    def step(ids, values):
        grad = tf.IndexedSlices(values, ids, tf.constant([V, D], tf.int64))
        opt.apply([tf.convert_to_tensor(grad) if dense else grad], [table])

    for ids, values in steps:
        step(ids, values)
    return table.numpy(), opt._accumulators[0].numpy()


def _steps(n=6, rows=12):
    rng = np.random.default_rng(1)
    out = []
    for _ in range(n):
        ids = rng.integers(0, V // 2, rows)  # duplicates, and rows V//2.. never touched
        out.append(
            (tf.constant(ids, tf.int64), tf.constant(rng.normal(size=(rows, D)), tf.float32))
        )
    return out


def test_installed_by_importing_tfstrat_keras():
    assert _rowwise._installed and _rowwise.keras_update_step is not None
    assert keras.optimizers.Adagrad.update_step is not _rowwise.keras_update_step


def test_sparse_step_equals_keras_own_and_leaves_untouched_rows_alone():
    steps = _steps()
    ours, ours_acc = _train(True, steps)
    theirs, theirs_acc = _train(False, steps)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ours_acc, theirs_acc, rtol=1e-6, atol=1e-7)
    initial, initial_acc = _train(True, [])
    touched = np.unique(np.concatenate([ids.numpy() for ids, _ in steps]))
    untouched = np.setdiff1d(np.arange(V), touched)
    assert len(untouched) >= V // 2
    np.testing.assert_array_equal(ours[untouched], initial[untouched])
    np.testing.assert_array_equal(ours_acc[untouched], initial_acc[untouched])
    assert not np.allclose(ours[touched], initial[touched])


def test_dense_gradients_take_keras_own_step_bit_for_bit():
    steps = _steps()
    np.testing.assert_array_equal(
        _train(True, steps, dense=True)[0], _train(False, steps, dense=True)[0]
    )


def test_turned_off_by_the_switch():
    code = "import tfstrat.keras, keras; from tfstrat.keras import _rowwise; print(_rowwise._installed)"
    env = {**os.environ, "TFSTRAT_ROWWISE": "0", "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False", out.stdout


def _embedding_step(strategy, vocab=4000, dim=8):
    """One Adagrad step of a tfstrat Embedding model: (table before, table after, graph)."""
    from tfstrat.keras.layers import Embedding

    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((3,), dtype="int32"),
                Embedding(vocab, dim),
                keras.layers.Flatten(),
                keras.layers.Dense(1),
            ]
        )
        opt = keras.optimizers.Adagrad(0.5)
        opt.build(model.trainable_variables)
    before = model.layers[0].embeddings.numpy()

    def replica_step(ids, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(ids) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    step = tf.function(lambda ids, y: strategy.run(replica_step, (ids, y)))
    ids, y = tf.constant([[1, 7, 1], [3, 7, 9]]), tf.constant([[1.0], [-1.0]])
    step(ids, y)
    return before, model.layers[0].embeddings.numpy(), step.get_concrete_function(ids, y).graph


def test_a_distributed_table_is_read_row_wise_by_the_lookup_and_by_adagrad():
    """A `tf.gather` on a tf.distribute variable copies the whole variable first (no
    `sparse_read`): the lookup and Adagrad's accumulator rows must gather from this replica's
    own component (tfstrat/keras/_local.py), and train exactly as without a strategy."""
    vocab, dim = 4000, 8
    before, mirrored, graph = _embedding_step(
        tf.distribute.MirroredStrategy(["/cpu:0"]), vocab, dim
    )
    whole = [
        op.name
        for op in graph.get_operations()
        if op.type == "ReadVariableOp" and op.outputs[0].shape.as_list() == [vocab, dim]
    ]
    assert not whole, f"whole-table reads in the step: {whole}"
    gathers = [op for op in graph.get_operations() if op.type == "ResourceGather"]
    assert len(gathers) >= 2, [op.type for op in graph.get_operations()]  # lookup + accumulator
    _, plain, _ = _embedding_step(tf.distribute.get_strategy(), vocab, dim)
    np.testing.assert_allclose(mirrored, plain, rtol=1e-6, atol=1e-7)
    touched, untouched = [1, 3, 7, 9], [0, 2, 4, 5, 6, 8]
    assert (mirrored[touched] != before[touched]).all(axis=1).all()  # the gradient reached them
    np.testing.assert_array_equal(mirrored[untouched], before[untouched])


# -- lazy updates (Adam, SGD with momentum, RMSprop) for tables marked "lazy" -----------------


def _run(make_optimizer, steps, mode=None):
    """Applies `steps` of IndexedSlices gradients to a V x D table; returns (table, optimizer)."""
    rng = np.random.default_rng(0)
    table = keras.Variable(rng.normal(size=(V, D)).astype("float32"))
    if mode is not None:
        _rowwise.mark(table, mode)
    opt = make_optimizer()
    opt.build([table])

    @tf.function
    def step(ids, values):
        opt.apply([tf.IndexedSlices(values, ids, tf.constant([V, D], tf.int64))], [table])

    for ids, values in steps:
        step(ids, values)
    return table.numpy(), opt


def _lazy_reference(kind, steps, hp):
    """NumPy lazy updates: each step sums an id's repeats, then updates only those rows."""
    f32 = np.float32
    var = np.random.default_rng(0).normal(size=(V, D)).astype("float32")
    m, v = np.zeros_like(var), np.zeros_like(var)
    for t, (ids, values) in enumerate(steps, 1):
        ids, values = ids.numpy(), values.numpy()
        rows = np.unique(ids)
        g = np.stack([values[ids == i].sum(0) for i in rows]).astype("float32")
        lr = f32(hp["lr"])
        if kind == "adam":  # Keras's constants: 1 - beta in Python, beta ** t in float32
            b1, b2, eps = f32(hp["beta_1"]), f32(hp["beta_2"]), f32(hp["epsilon"])
            m[rows] = m[rows] + (g - m[rows]) * f32(1 - hp["beta_1"])
            v[rows] = v[rows] + (g * g - v[rows]) * f32(1 - hp["beta_2"])
            alpha = lr * np.sqrt(f32(1) - b2 ** f32(t)) / (f32(1) - b1 ** f32(t))
            var[rows] -= m[rows] * alpha / (np.sqrt(v[rows]) + eps)
        elif kind == "sgd_momentum":
            mu = f32(hp["momentum"])
            m[rows] = m[rows] * mu - g * lr
            var[rows] += (m[rows] * mu - g * lr) if hp["nesterov"] else m[rows]
        elif kind == "rmsprop":
            rho, eps, mu = f32(hp["rho"]), f32(hp["epsilon"]), f32(hp["momentum"])
            v[rows] = rho * v[rows] + f32(1 - hp["rho"]) * (g * g)
            inc = lr * g / np.sqrt(v[rows] + eps)
            if mu > 0:
                m[rows] = mu * m[rows] + inc
                inc = m[rows]
            var[rows] -= inc
    return var


LAZY_CASES = [
    (
        "adam",
        lambda: keras.optimizers.Adam(0.05),
        dict(lr=0.05, beta_1=0.9, beta_2=0.999, epsilon=1e-7),
    ),
    (
        "adam",
        lambda: keras.optimizers.AdamW(0.05, weight_decay=0.0),
        dict(lr=0.05, beta_1=0.9, beta_2=0.999, epsilon=1e-7),
    ),
    (
        "sgd_momentum",
        lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        dict(lr=0.1, momentum=0.9, nesterov=False),
    ),
    (
        "sgd_momentum",
        lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
        dict(lr=0.1, momentum=0.9, nesterov=True),
    ),
    (
        "rmsprop",
        lambda: keras.optimizers.RMSprop(0.01),
        dict(lr=0.01, rho=0.9, epsilon=1e-7, momentum=0.0),
    ),
    (
        "rmsprop",
        lambda: keras.optimizers.RMSprop(0.01, momentum=0.5),
        dict(lr=0.01, rho=0.9, epsilon=1e-7, momentum=0.5),
    ),
]


@pytest.mark.parametrize(
    "kind,make,hp",
    LAZY_CASES,
    ids=["adam", "adamw", "momentum", "nesterov", "rmsprop", "rmsprop_momentum"],
)
def test_lazy_updates_equal_a_numpy_reference_and_leave_untouched_rows_alone(kind, make, hp):
    steps = _steps()
    ours, opt = _run(make, steps, mode="lazy")
    np.testing.assert_allclose(ours, _lazy_reference(kind, steps, hp), rtol=2e-6, atol=2e-7)
    initial, _ = _run(make, [])
    touched = np.unique(np.concatenate([ids.numpy() for ids, _ in steps]))
    untouched = np.setdiff1d(np.arange(V), touched)
    np.testing.assert_array_equal(ours[untouched], initial[untouched])
    slots = [v for v in opt.variables if tuple(v.shape) == (V, D)]
    assert slots
    for slot in slots:  # untouched rows' slots never left zero
        assert not np.asarray(slot.numpy())[untouched].any(), slot.path


@pytest.mark.parametrize("mode", [None, "exact"])
def test_unmarked_or_exact_tables_keep_keras_own_dense_update(mode):
    steps = _steps()
    ours, _ = _run(lambda: keras.optimizers.Adam(0.05), steps, mode=mode)

    def keras_own():
        opt = keras.optimizers.Adam(0.05)
        opt.update_step = types.MethodType(_rowwise.keras_update_steps[keras.optimizers.Adam], opt)
        return opt

    theirs, _ = _run(keras_own, steps)
    np.testing.assert_array_equal(ours, theirs)
    lazy, _ = _run(lambda: keras.optimizers.Adam(0.05), steps, mode="lazy")
    assert not np.allclose(ours, lazy)  # dense Adam keeps moving rows a step did not touch


def test_embedding_marks_its_table_and_checks_the_mode():
    from tfstrat.keras.layers import Embedding

    lazy, exact = Embedding(10, 2), Embedding(10, 2, sparse_updates="exact")
    lazy.build((None, 3))
    exact.build((None, 3))
    assert lazy.embeddings._tfstrat_sparse_updates == "lazy"
    assert exact.embeddings._tfstrat_sparse_updates == "exact"
    assert Embedding.from_config(exact.get_config()).sparse_updates == "exact"
    with pytest.raises(ValueError, match=r"sparse_updates='dense'.*'lazy'.*'exact'"):
        Embedding(10, 2, sparse_updates="dense")
