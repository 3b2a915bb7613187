"""The ps's table (tfstrat/ps/tables.py) in one process: how it collects a step's pushes."""

import numpy as np
import pytest

from tfstrat.ps.tables import KINDS, Table

SGD = np.array([KINDS.index("sgd"), 0.5, 0.9, 0.999, 1e-7, 0.1, 0, 0, 0.9, 0.1, 0.001, 0.1], "f4")


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
    with pytest.raises(ValueError, match=r"replica 0 pushed step 0 twice.*called twice"):
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
