"""Choosing how many parts a ps-held table is split into, as Parallax does.

Parallax (EuroSys 2019, section 4.3) models the time of a step against the number of parts P
as t(P) = b/P + a(P - 1) + c: b, the work that parts share out (gathers, updates, bytes per
part); a, the per-part overhead (one more RPC per lookup and per push); c, the rest. It times
a few steps at a few partition counts at start-up, fits a, b, c, and takes the P that
minimises the fitted t. Here the chief times lookups and pushes of one batch of ids against
throwaway zero-filled tables of the real shape, so the trial changes no weights, and records
its choice on ps 0, where the other workers read it (timings differ between workers).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import tensorflow as tf

logger = logging.getLogger(__name__)

CANDIDATES = (1, 2, 4, 8)
TRIAL_STEPS = 3
TRIAL_IDS = 2048
_TRIAL_TABLES = 1 << 40  # table numbers of throwaway trial tables


def fit(samples: dict[int, float]) -> tuple[float, float, float]:
    """Least-squares (b, a, c) of t(P) = b/P + a(P-1) + c, with b and a kept >= 0."""
    parts = np.array(sorted(samples), dtype=np.float64)
    times = np.array([samples[int(p)] for p in parts])
    design = np.stack([1 / parts, parts - 1, np.ones_like(parts)], axis=1)
    (b, a, c), *_ = np.linalg.lstsq(design, times, rcond=None)
    return max(b, 0.0), max(a, 0.0), c


def best(samples: dict[int, float], most: int) -> int:
    """The partition count in 1..most that minimises the fitted step time."""
    b, a, c = fit(samples)
    counts = np.arange(1, most + 1)
    return int(counts[np.argmin(b / counts + a * (counts - 1) + c)])


def measure(make_table, rows: int, dim: int, candidates=CANDIDATES) -> dict[int, float]:
    """Seconds per lookup + push of TRIAL_IDS ids, for each partition count (eager RPCs).

    `make_table(parts, first_number)` returns a RemoteTable of zeros for one worker.
    """
    rng = np.random.default_rng(0)
    ids = tf.constant(rng.choice(rows, min(rows, TRIAL_IDS), replace=False), tf.int64)
    hyper = tf.constant(
        [0.0, 0.0, 0.9, 0.999, 1e-7, 0.1, 0.0, 0.0, 0.9, 0.1, 0.001, 0.1, 0.0]
    )  # SGD, lr 0
    samples = {}
    for k, parts in enumerate(c for c in candidates if c <= rows):
        table = make_table(parts, _TRIAL_TABLES + 16 * k)
        try:
            grads = tf.zeros([int(ids.shape[0]), dim])
            table.push(ids, grads, tf.constant(0, tf.int64), hyper)  # warm-up
            start = time.perf_counter()
            for step in range(TRIAL_STEPS):
                table.fetch(ids)
                table.push(ids, grads, tf.constant(step, tf.int64), hyper)
            samples[parts] = (time.perf_counter() - start) / TRIAL_STEPS
        finally:
            table.drop()
    return samples
