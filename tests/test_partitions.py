"""Parallax's partition-count model: t(P) = b/P + a(P-1) + c."""

import pytest

from tfstrat.ps.partitions import best, fit


def _times(b, a, c, counts=(1, 2, 4, 8)):
    return {p: b / p + a * (p - 1) + c for p in counts}


def test_fit_recovers_the_model():
    b, a, c = fit(_times(0.040, 0.002, 0.005))
    assert (b, a, c) == pytest.approx((0.040, 0.002, 0.005))


@pytest.mark.parametrize(
    "b, a, expected",
    [
        (0.050, 0.002, 5),  # the minimum of b/P + aP is at sqrt(b/a) = 5
        (0.001, 0.010, 1),  # per-part overhead dominates: one part
        (0.100, 0.0001, 8),  # shared work dominates: as many as allowed
    ],
)
def test_best_minimises_the_fitted_time(b, a, expected):
    assert best(_times(b, a, 0.005), most=8) == expected
