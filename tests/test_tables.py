"""The ps's table (tfstrat/ps/tables.py) in one process: how it collects a step's pushes."""

import numpy as np
import pytest

from tfstrat.ps.tables import KINDS, Table

SGD = np.array(
    [KINDS.index("sgd"), 0.5, 0.9, 0.999, 1e-7, 0.1, 0, 0, 0.9, 0.1, 0.001, 0.1, 0], "f4"
)


def _table(workers=2):
    return Table(6, 2, workers, {"zeros": True})


def test_a_step_applies_once_every_replica_pushed_summing_in_replica_order():
    t = _table()
    ones = np.ones((2, 2), "f4")
    assert t.push(0, [1, 2], ones, SGD, 1.0, replica=1) == 0  # waits for replica 0
    np.testing.assert_array_equal(t.value, 0)
    assert t.push(0, [2, 3], 3 * ones, SGD, 1.0, replica=0) == 1
    # (sum of the pushes) / (sum of their weights 2) x learning rate 0.5
    np.testing.assert_allclose(t.value[:, 0], [0, -0.25, -1.0, -0.75, 0, 0])
    assert t.pending == {}


def test_a_second_push_of_one_replica_in_a_step_is_refused_naming_the_cause():
    t = _table()
    t.push(0, [1], np.ones((1, 2), "f4"), SGD, 1.0, replica=0)
    with pytest.raises(ValueError, match=r"worker 0 pushed step 0 twice.*called twice"):
        t.push(0, [2], np.ones((1, 2), "f4"), SGD, 1.0, replica=0)
    with pytest.raises(ValueError, match=r"a push for step 1 while step 0 has 1 of 2 pushes"):
        t.push(1, [2], np.ones((1, 2), "f4"), SGD, 1.0, replica=1)


def test_a_failed_update_does_not_wedge_the_next_step():
    t = _table()
    bad = SGD.copy()
    bad[0] = 99  # no such optimizer
    t.push(0, [1], np.ones((1, 2), "f4"), bad, 1.0, replica=0)
    with pytest.raises(ValueError, match="unknown optimizer kind"):
        t.push(0, [1], np.ones((1, 2), "f4"), bad, 1.0, replica=1)
    assert t.pending == {}
    t.push(1, [1], np.ones((1, 2), "f4"), SGD, 1.0, replica=0)
    assert t.push(1, [1], np.ones((1, 2), "f4"), SGD, 1.0, replica=1) == 1


def test_bad_pushes_are_refused_before_they_count():
    t = _table()
    with pytest.raises(ValueError, match=r"2 ids carried 1 gradient rows"):
        t.push(0, [1, 2], np.ones((1, 2), "f4"), SGD, 1.0, replica=0)
    with pytest.raises(ValueError, match=r"id 6 is outside"):
        t.push(0, [6], np.ones((1, 2), "f4"), SGD, 1.0, replica=0)
    assert t.pending == {}


def test_a_lookup_of_the_next_step_waits_until_the_step_is_applied():
    """Workers push without waiting for the update (it overlaps their all-reduce): the next
    step's lookup, and a checkpoint's read, wait on the ps instead. Ordered by events, not
    sleeps: the lookup thread must still be waiting after replica 1's push alone."""
    import threading

    from tfstrat.ps.tables import Registry

    t = _table()
    ones = np.ones((1, 2), "f4")
    t.push(0, [1], ones, SGD, 1.0, replica=1)
    assert t.lookup([1], 0)[0] == 0  # step 0's own lookup: the step's rows, no wait
    got = {}
    lookup = threading.Thread(target=lambda: got.setdefault("rows", t.lookup([1], 1)))
    lookup.start()
    lookup.join(0.5)
    assert lookup.is_alive() and "rows" not in got, "step 1 read step 0's rows before its update"
    t.push(0, [1], ones, SGD, 1.0, replica=0)  # the last push applies the step
    lookup.join(30)
    np.testing.assert_allclose(got["rows"], [-0.5, -0.5])  # (1 + 1) / 2 x 0.5
    registry = Registry()
    registry.tables[0] = t
    t.push(1, [2], ones, SGD, 1.0, replica=0)
    reader = threading.Thread(target=lambda: got.setdefault("read", registry.read(0, 0, 6)))
    reader.start()
    reader.join(0.5)
    assert reader.is_alive(), "a read saw a half-pushed step"
    t.push(1, [2], ones, SGD, 1.0, replica=1)
    reader.join(30)
    assert got["read"].reshape(6, 2)[2, 0] == -0.5


def test_a_lookup_names_the_replicas_that_never_pushed():
    t = Table(6, 2, 3, {"zeros": True, "timeout": 0.4})  # waits 3/4 of the workers' timeout
    t.push(4, [1], np.ones((1, 2), "f4"), SGD, 1.0, replica=1)
    with pytest.raises(ValueError, match=r"step 4's pushes; worker\(s\) \[0, 2\] never pushed"):
        t.lookup([1], 5)


def test_weight_decay_reaches_every_row_as_keras_decays_them_each_step():
    """AdamW-style decay on a ps-held table: every row decays every step (Keras multiplies the
    whole table by 1 - wd * lr before the update), but the ps touches only the pushed rows;
    the others take the product of their missed factors when read. Lookups, whole reads and a
    restore (write) all see Keras's values; rows never pushed decay too."""
    from tfstrat.ps.tables import Registry

    rng = np.random.default_rng(0)
    rows, dim, lr, wd = 20, 3, 0.1, 0.05
    registry = Registry()
    spec = np.frombuffer(b'{"zeros": true}', np.uint8)
    registry.create(0, rows, dim, 1, spec)
    start = rng.normal(size=(rows, dim)).astype("f4")
    registry.write(0, 0, start)
    hyper = SGD.copy()
    hyper[1], hyper[12] = lr, wd
    dense = start.copy()  # Keras: v - v * wd * lr for every row, then the rows' SGD step
    for step in range(12):
        ids = np.unique(rng.integers(0, rows // 2, size=4))  # rows 10.. are never pushed
        grads = rng.normal(size=(len(ids), dim)).astype("f4")
        seen = registry.lookup(0, ids, step).reshape(-1, dim)
        np.testing.assert_allclose(seen, dense[ids], rtol=1e-6, atol=1e-7)
        registry.push(0, step, ids, grads, hyper, 0.0)
        dense = dense - dense * np.float32(wd) * np.float32(lr)
        dense[ids] -= np.float32(lr) * grads
        if step == 6:  # a restore writes rows as they are: nothing pending for them
            registry.write(0, 0, dense[:5])
    whole = registry.read(0, 0, rows).reshape(rows, dim)
    np.testing.assert_allclose(whole, dense, rtol=1e-6, atol=1e-7)
    assert not np.allclose(whole[10:], start[10:])  # decayed without a push


def test_a_table_in_parts_starts_as_the_whole_table_one_device_draws():
    """Each part of a ps-held table is its rows of one draw of the whole table (Keras's
    initializer and seed), so a table in parts starts as the same table on one device; the
    draw is kept only until the ps's last part of that table."""
    import json

    import keras

    from tfstrat.ps import tables

    initializer = keras.initializers.RandomNormal(seed=5)
    init = {"initializer": keras.initializers.serialize(initializer), "seed": 5}
    one_device = np.asarray(initializer((9, 3), dtype="float32"))
    parts = [
        tables._initial(hi - lo, 3, dict(init, first=lo, total=9, last=last))
        for lo, hi, last in ((0, 4, False), (4, 7, False), (7, 9, True))
    ]
    np.testing.assert_array_equal(np.concatenate(parts), one_device)
    assert not tables._last_draw  # released after the last part
    whole = tables._initial(9, 3, json.loads(json.dumps(dict(init, first=0, total=9))))
    np.testing.assert_array_equal(whole, one_device)
    assert whole.flags.writeable  # the table the ps updates in place
