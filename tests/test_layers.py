"""tfstrat.keras.layers.Embedding outside any strategy: a drop-in for keras.layers.Embedding."""

import re

import numpy as np
import pytest


def _model(layer_cls):
    import keras

    keras.utils.set_random_seed(5)
    keras.backend.clear_session()  # the same layer names in both models
    inputs = keras.Input((4,), dtype="int32")
    x = layer_cls(50, 3, name="embedding")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(x)))


def test_same_weights_outputs_and_saved_format_as_keras(tmp_path):
    import keras

    from tfstrat.keras.layers import Embedding

    ours, stock = _model(Embedding), _model(keras.layers.Embedding)
    assert [w.path for w in ours.weights] == [w.path for w in stock.weights]
    for a, b in zip(ours.get_weights(), stock.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)  # same initial values from the same seed
    ids = np.arange(40, dtype="int32").reshape(10, 4)
    np.testing.assert_allclose(ours.predict(ids, verbose=0), stock.predict(ids, verbose=0))
    ours.layers[1].embeddings.assign(np.ones((50, 3), "float32"))
    ours.save_weights(tmp_path / "ours.weights.h5")
    stock.load_weights(tmp_path / "ours.weights.h5")  # ours -> stock
    np.testing.assert_array_equal(stock.layers[1].embeddings.numpy(), np.ones((50, 3)))
    assert Embedding.from_config(ours.layers[1].get_config()).input_dim == 50


def test_gradient_stays_sparse():
    import tensorflow as tf

    from tfstrat.keras.layers import Embedding

    layer = Embedding(50, 3)
    layer.build()
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(tf.constant([[1, 2, 2]])))
    (grad,) = tape.gradient(loss, layer.trainable_variables)
    assert isinstance(grad, tf.IndexedSlices)
    assert sorted(grad.indices.numpy().tolist()) == [1, 2, 2]


def test_part_bounds_match_embedding_lookup_div_strategy():
    from tfstrat.keras.layers import part_bounds

    assert part_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert part_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]


@pytest.mark.faults
@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_ps_held_table_saves_its_optimizer_slots_where_a_stock_model_does_not_look(tmp_path):
    """A table on a real ps task (`tfstrat server`), attached to the layer as Hybrid attaches
    it, saves its Adagrad accumulator beside the layer's weights: the file still loads into a
    stock model, and loading it into ours writes table and slots back to the ps."""
    import os
    import subprocess
    import sys
    import types

    import keras
    import tensorflow as tf

    from tfstrat.cluster import TFConfig
    from tfstrat.cluster.ports import free_port_pairs as _free_port_pairs
    from tfstrat.keras._ps_tables import PsTable, TableSlots
    from tfstrat.keras.layers import Embedding
    from tfstrat.ps.connect import wait_for_ps
    from tfstrat.ps.remote import RemoteTable, TableClients

    ps, worker = (f"127.0.0.1:{p}" for p in _free_port_pairs(2))  # tables on port + 1
    config = TFConfig({"ps": [ps], "worker": [worker]}, "ps", 0)
    env = dict(os.environ, **config.to_env())
    server = subprocess.Popen([sys.executable, "-m", "tfstrat", "server"], env=env)
    try:
        wait_for_ps(config, 60, port_offset=1)
        clients = TableClients([ps], timeout=60, worker=0)
        init = {"initializer": keras.initializers.serialize(keras.initializers.Ones())}
        table = RemoteTable(clients, "embedding", 50, 3, [(0, 0, 0, 25), (0, 1, 25, 50)], 1, init)
        hyper = tf.constant(
            [1.0, 0.5, 0.9, 0.999, 1e-7, 0.1, 0.0, 0.0, 0.9, 0.1, 0.001, 0.1, 0.0]
        )  # Adagrad
        table.push(tf.constant([1, 30], tf.int64), tf.ones([2, 3]), tf.constant(0, tf.int64), hyper)

        ours, stock = _model(Embedding), _model(keras.layers.Embedding)
        layer = ours.layers[1]
        strategy = types.SimpleNamespace(_optimizer=None)
        layer._embeddings = PsTable(layer, table, strategy)
        layer.table_slots = TableSlots(table, strategy)
        expected_table, expected_slots = table.numpy(), table.slots({"accumulator": 0.1})
        assert sorted(expected_slots) == ["accumulator"]
        np.testing.assert_allclose(expected_slots["accumulator"][[1, 30, 2], 0], [1.1, 1.1, 0.1])
        ours.save_weights(tmp_path / "ps.weights.h5")

        stock.load_weights(tmp_path / "ps.weights.h5")  # the slots' group is not read
        np.testing.assert_array_equal(stock.layers[1].embeddings.numpy(), expected_table)

        table.assign(np.zeros((50, 3), "float32"))
        table.assign_slots({"accumulator": np.zeros((50, 3), "float32")})
        ours.load_weights(tmp_path / "ps.weights.h5")
        np.testing.assert_array_equal(table.numpy(), expected_table)
        restored = table.slots({})["accumulator"]
        np.testing.assert_array_equal(restored, expected_slots["accumulator"])
    finally:
        server.kill()
        server.wait()


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_ps_table_server_answers_lookups_over_4_mib_and_names_itself_in_errors():
    """The table server (tfstrat/ps/wire.py) on a real ps task: one lookup of 6 MiB of rows in a
    traced step (tf.distribute.experimental.rpc refused messages over 4 MiB), a push whose
    Adagrad update touches only its rows, and a bad id and a stopped ps each failing with an
    error that names the method and the ps task."""
    import os
    import subprocess
    import sys
    import time

    import tensorflow as tf

    from tfstrat.cluster import TFConfig
    from tfstrat.cluster.ports import free_port_pairs as _free_port_pairs
    from tfstrat.errors import TableServerError
    from tfstrat.ps.connect import wait_for_ps
    from tfstrat.ps.remote import RemoteTable, TableClients

    ps, worker = (f"127.0.0.1:{p}" for p in _free_port_pairs(2))
    config = TFConfig({"ps": [ps], "worker": [worker]}, "ps", 0)
    server = subprocess.Popen(
        [sys.executable, "-m", "tfstrat", "server"], env=dict(os.environ, **config.to_env())
    )
    rows, dim = 30_000, 64  # 7.3 MiB
    try:
        wait_for_ps(config, 60, port_offset=1)
        clients = TableClients([ps], timeout=20, worker=0)
        table = RemoteTable(clients, "big", rows, dim, [(0, 0, 0, rows)], 1, {"zeros": True})
        table.assign(np.arange(rows * dim, dtype="float32").reshape(rows, dim))
        ids = tf.constant(np.arange(rows - 1, -1, -1)[:25_000], tf.int64)  # 6.1 MiB of rows

        @tf.function
        def fetch(ids):
            return table.fetch(ids)

        got = fetch(ids).numpy()
        np.testing.assert_array_equal(got, table.numpy()[ids.numpy()])

        hyper = tf.constant(
            [1.0, 0.5, 0.9, 0.999, 1e-7, 0.1, 0.0, 0.0, 0.9, 0.1, 0.001, 0.1, 0.0]
        )  # Adagrad
        before = table.numpy()
        table.push(
            tf.constant([3, 7], tf.int64), tf.ones([2, dim]), tf.constant(0, tf.int64), hyper
        )
        after = table.numpy()
        step = np.float32(0.5) / np.sqrt(np.float32(1.1) + np.float32(1e-7))
        np.testing.assert_allclose(after[[3, 7]], before[[3, 7]] - step, rtol=1e-6)
        np.testing.assert_array_equal(np.delete(after, [3, 7], 0), np.delete(before, [3, 7], 0))

        where = f"on ps:0 (table server at 127.0.0.1:{int(ps.rsplit(':', 1)[1]) + 1})"
        with pytest.raises(Exception, match=r"Table 'big': id 30000 is outside its rows 0..29"):
            fetch(tf.constant([1, rows], tf.int64))  # checked on the worker, naming the table
        with pytest.raises(TableServerError, match=re.escape(where) + ".*table 77 does not exist"):
            clients.call(0, "lookup", np.int64(77), np.array([1], np.int64))  # the ps's error
        np.testing.assert_array_equal(fetch(tf.constant([1], tf.int64)).numpy()[0], after[1])

        server.kill()
        server.wait()
        start = time.monotonic()
        with pytest.raises(Exception, match=r"lookup " + re.escape(where) + ".*(closed|connect)"):
            fetch(ids)
        assert time.monotonic() - start < 20 + 30  # the call's timeout, and start-up slack
    finally:
        server.kill()
        server.wait()


def _lazy_reference(name, start, steps):
    """Keras's update rule of each optimizer applied to the touched rows only, in float64 NumPy:
    rows outside a step keep their values and slots; Adam's bias correction counts steps."""
    w = start.astype("float64")
    m, v = np.zeros_like(w), np.zeros_like(w)
    accumulator = np.full_like(w, 0.1)  # Adagrad's initial_accumulator_value
    for t, (ids, grads) in enumerate(steps):
        rows, position = np.unique(ids, return_inverse=True)
        g = np.zeros((len(rows), w.shape[1]))
        np.add.at(g, position, grads.astype("float64"))
        if name == "adam":  # Adam(0.05), beta_1 0.9, beta_2 0.999, epsilon 1e-7
            m[rows] += (g - m[rows]) * 0.1
            v[rows] += (g * g - v[rows]) * 0.001
            # beta ** t in float32, as Keras computes it (1 - 0.999 ** t moves by 1e-5 otherwise)
            power = np.float32(t + 1)
            alpha = 0.05 * np.sqrt(1 - np.float32(0.999) ** power) / (1 - np.float32(0.9) ** power)
            w[rows] -= m[rows] * alpha / (np.sqrt(v[rows]) + 1e-7)
        elif name == "nesterov":  # SGD(0.1, momentum=0.9, nesterov=True)
            m[rows] = 0.9 * m[rows] - 0.1 * g
            w[rows] += 0.9 * m[rows] - 0.1 * g
        elif name == "rmsprop_momentum":  # RMSprop(0.01, momentum=0.5), rho 0.9, epsilon 1e-7
            v[rows] = 0.9 * v[rows] + 0.1 * g * g
            m[rows] = 0.5 * m[rows] + 0.01 * g / np.sqrt(v[rows] + 1e-7)
            w[rows] -= m[rows]
        else:  # Adagrad(0.5), epsilon 1e-7
            accumulator[rows] += g * g
            w[rows] -= 0.5 * g / np.sqrt(accumulator[rows] + 1e-7)
    return w


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_a_ps_table_steps_as_a_lazy_mirrored_table_for_every_optimizer():
    """Pushes to a real table server (the ps's NumPy steps) and a worker's Keras optimizer on a
    lazily updated mirrored table (tfstrat/keras/_rowwise.py) give the rows of Keras's update
    rules written out in NumPy. Both share `tfstrat/ps/rowmath.py`, so neither is the other's
    reference."""
    import os
    import subprocess
    import sys

    import keras
    import tensorflow as tf

    import tfstrat.keras  # noqa: F401  (installs the row-wise steps)
    from tfstrat.cluster import TFConfig
    from tfstrat.cluster.ports import free_port_pairs as _free_port_pairs
    from tfstrat.keras import _rowwise
    from tfstrat.ps.connect import wait_for_ps
    from tfstrat.ps.remote import RemoteTable, TableClients, optimizer_hyper

    rows, dim = 40, 3
    rng = np.random.default_rng(0)
    start = rng.normal(size=(rows, dim)).astype("float32")
    steps = [
        (rng.integers(0, 20, 9), rng.normal(size=(9, dim)).astype("float32")) for _ in range(4)
    ]
    optimizers = {
        "adam": lambda: keras.optimizers.Adam(0.05),
        "nesterov": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
        "rmsprop_momentum": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5),
        "adagrad": lambda: keras.optimizers.Adagrad(0.5),
    }
    ps, worker = (f"127.0.0.1:{p}" for p in _free_port_pairs(2))
    config = TFConfig({"ps": [ps], "worker": [worker]}, "ps", 0)
    server = subprocess.Popen(
        [sys.executable, "-m", "tfstrat", "server"], env=dict(os.environ, **config.to_env())
    )
    try:
        wait_for_ps(config, 60, port_offset=1)
        clients = TableClients([ps], timeout=30, worker=0)
        for number, (name, make) in enumerate(optimizers.items()):
            mirrored = keras.Variable(start.copy())
            _rowwise.mark(mirrored, "lazy")
            opt = make()
            opt.build([mirrored])
            table = RemoteTable(
                clients, name, rows, dim, [(0, number, 0, rows)], 1, {"zeros": True}
            )
            table.assign(start)
            for t, (ids, grads) in enumerate(steps):
                # One row per distinct id, as a tfstrat Embedding's gradient has (the worker
                # sums repeats before a push, too).
                unique, position = np.unique(ids, return_inverse=True)
                summed = np.zeros((len(unique), dim), "float32")
                np.add.at(summed, position, grads)
                gradient = tf.IndexedSlices(tf.constant(summed), tf.constant(unique))
                opt.apply([gradient], [mirrored])
                hyper = optimizer_hyper(opt)
                table.push(
                    tf.constant(unique), tf.constant(summed), tf.constant(t, tf.int64), hyper
                )
            np.testing.assert_allclose(
                table.numpy(), mirrored.numpy(), rtol=1e-6, atol=1e-7, err_msg=name
            )
            np.testing.assert_allclose(
                mirrored.numpy(), _lazy_reference(name, start, steps), rtol=1e-5, err_msg=name
            )
            np.testing.assert_array_equal(table.numpy()[20:], start[20:])
    finally:
        server.kill()
        server.wait()


def test_a_ps_held_table_refuses_settings_it_cannot_apply_and_takes_weight_decay():
    """A ps updates only the batch's rows: Keras's dense Adam (sparse_updates="exact") and
    clipping over every gradient would silently differ from the same model mirrored, so they
    are refused at the first lookup; AdamW's decay is applied on the ps (tests/test_tables.py),
    and reaches the table unless excluded by name, as Keras decides for a mirrored one."""
    import types

    import keras
    import tensorflow as tf

    from tfstrat.keras import _ps_tables
    from tfstrat.keras.layers import Embedding

    def called(optimizer, **kwargs):
        layer = Embedding(10, 2, name="items", **kwargs)
        layer._anchor = layer.add_weight(shape=(), initializer="zeros", name="embeddings_anchor")
        layer.built = True
        strategy = types.SimpleNamespace(_optimizer=optimizer)
        layer._embeddings = _ps_tables.PsTable(layer, object(), strategy)  # no table behind
        layer._tfstrat_strategy = strategy
        optimizer.build([layer._anchor])
        layer(tf.constant([[1, 2]]))

    # Past the checks: the lookup reached the stand-in table, which has no `lookup`.
    with pytest.raises(AttributeError, match="'object' object has no attribute 'lookup'"):
        called(keras.optimizers.AdamW())
    with pytest.raises(ValueError, match=r"sparse_updates='exact' on 'items'.*Adam"):
        called(keras.optimizers.Adam(), sparse_updates="exact")
    with pytest.raises(ValueError, match=r"SGD\(global_clipnorm=1.0\) with 'items'.*Drop"):
        called(keras.optimizers.SGD(global_clipnorm=1.0))
    # A LossScaleOptimizer's inner optimizer is checked.
    with pytest.raises(ValueError, match=r"SGD\(clipnorm=1.0\) with 'items'"):
        called(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(clipnorm=1.0)))

    layer = Embedding(10, 2, name="items")
    layer._anchor = layer.add_weight(shape=(), initializer="zeros", name="embeddings_anchor")
    assert _ps_tables.uses_weight_decay(keras.optimizers.AdamW(), layer)
    assert not _ps_tables.uses_weight_decay(keras.optimizers.Adam(), layer)
    excluded = keras.optimizers.AdamW()
    excluded.exclude_from_weight_decay(var_names=["embeddings"])
    assert not _ps_tables.uses_weight_decay(excluded, layer)
    biases_only = keras.optimizers.AdamW()  # keras-hub's recipe: the tables decay
    biases_only.exclude_from_weight_decay(var_names=["bias", "gamma", "beta"])
    assert _ps_tables.uses_weight_decay(biases_only, layer)


def test_a_slot_the_ps_cannot_keep_is_refused_when_the_optimizer_builds():
    """Adam(amsgrad=True)'s velocity_hat, EMA's average: Keras would make each the size of
    the whole table on every worker; refused at build, naming the table and the fix."""
    import types

    import keras

    from tfstrat.keras import _ps_tables
    from tfstrat.keras._ps_weights import SlotWeight, TableWeight

    _ps_tables.install()
    layer = types.SimpleNamespace(name="items")
    held = types.SimpleNamespace(shape=(100_000, 64), layer=layer, remote=None)
    with keras.name_scope("items"):
        weight = TableWeight(held, trainable=True, name="embeddings")
    assert tuple(weight.shape) == (100_000, 64) and weight.value.shape == ()
    adam = keras.optimizers.Adam()
    adam.build([weight])
    assert all(isinstance(v, SlotWeight) for v in adam.variables[2:])  # scalars on the worker
    assert all(v.value.shape == () for v in adam.variables[2:])
    for optimizer in (keras.optimizers.Adam(amsgrad=True), keras.optimizers.SGD(use_ema=True)):
        with pytest.raises(ValueError, match=r"slot for items/embeddings.*sparse=\['!items'\]"):
            optimizer.build([weight])
