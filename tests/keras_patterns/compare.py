"""Compares a pattern's run under a strategy with its run without one; formats table cells.

A cell is "exact" when every weight of every task is within 1e-5 of the no-strategy run
(||w - w_ref|| / max(||w_ref||, 1e-3)) and so is every metric (|m - m_ref| / max(|m_ref|, 1e-3)),
"close (w X, logs Y)" with the largest relative differences otherwise, or "FAIL: reason".
"""

from __future__ import annotations

import glob
import os

import numpy as np

TOLERANCE = 1e-5
FLOOR = 1e-3  # norms below this count as this


def load(out: str, pattern: str, kind: str) -> dict:
    """{task: npz dict or error string} of `kind`'s run of `pattern`."""
    found = {}
    for path in sorted(glob.glob(os.path.join(out, pattern, f"{kind}.*"))):
        name = os.path.basename(path)
        if not name.endswith((".npz", ".error")):
            continue  # the pattern's own files (a saved model)
        task, ext = name[len(kind) + 1 :].rsplit(".", 1)
        if ext == "npz":
            with np.load(path) as f:
                found[task] = {k: f[k] for k in f.files}
        elif ext == "error":
            found[task] = open(path).read().strip()
    return found


def _relative(w, r) -> float:
    w, r = np.asarray(w, np.float64), np.asarray(r, np.float64)
    if w.shape != r.shape:
        return float("inf")
    # A weight that stays near zero (a bias before BatchNormalization gets no gradient) is
    # compared absolutely: relative differences of rounding noise mean nothing.
    value = float(np.linalg.norm(w - r) / max(np.linalg.norm(r), FLOOR))
    # NaN compares false with everything, so Python's max() would drop it: a NaN weight would
    # read as exact. Not finite is infinitely far.
    return value if np.isfinite(value) else float("inf")


def metric_differences(run: dict, ref: dict) -> dict[str, float]:
    """{metric: |m - m_ref| / max(|m_ref|, 1e-3)} (inf when missing or not finite)."""
    diffs = {}
    for k in ref:
        if k.startswith("m:"):
            a, b = float(run.get(k, np.nan)), float(ref[k])
            diffs[k[2:]] = abs(a - b) / max(abs(b), 1e-3) if np.isfinite(a) else float("inf")
    return diffs


def differences(run: dict, ref: dict) -> tuple[float, float, list[str]]:
    """(largest weight difference, largest metric difference, metrics that differ most)."""
    wkeys = [k for k in ref if k.startswith("w")]
    if sorted(k for k in run if k.startswith("w")) != sorted(wkeys):
        return float("inf"), float("inf"), ["a different number of weights"]
    dw = max((_relative(run[k], ref[k]) for k in wkeys), default=0.0)
    diffs = metric_differences(run, ref)
    worst = sorted(((d, k) for k, d in diffs.items() if d > TOLERANCE), reverse=True)
    return dw, max(diffs.values(), default=0.0), [name for _, name in worst[:2]]


def compare(
    out: str, pattern: str, kind: str, weights_only: bool = False, reference: str = "none"
) -> dict:
    """What the table and the tests read: {"cell", "weights", "metrics", "per_metric",
    "tasks"}, against the run of `reference` (a no-strategy kind)."""
    ref = load(out, pattern, reference).get("main")
    runs = load(out, pattern, kind)
    base = {"weights": None, "metrics": None, "tasks": sorted(runs)}
    if not isinstance(ref, dict):
        return {**base, "cell": f"FAIL: no-strategy run: {ref or 'missing'}"}
    if not runs:
        return {**base, "cell": "FAIL: no result (the run died; see its output)"}
    errors = [v for v in runs.values() if isinstance(v, str)]
    if errors:
        return {**base, "cell": "FAIL: " + _short(errors[0])}
    dw, dm, worst, per_metric = 0.0, 0.0, [], {}
    for run in runs.values():
        w, m, names = differences(run, ref)
        dw, dm = max(dw, w), max(dm, m)
        worst = worst or names
        for k, d in metric_differences(run, ref).items():
            per_metric[k] = max(per_metric.get(k, 0.0), d)
    if weights_only:
        dm, worst = 0.0, []
    if not np.isfinite(dw):
        cell = "FAIL: weights not finite or of other shapes"
    elif dw <= TOLERANCE and dm <= TOLERANCE:
        cell = "exact"
    elif dw <= TOLERANCE:
        cell = f"exact weights; logs {_num(dm)} ({', '.join(worst)})"
    else:
        cell = f"close (w {_num(dw)}" + (f", logs {_num(dm)})" if dm > TOLERANCE else ")")
    return {**base, "cell": cell, "weights": dw, "metrics": dm, "per_metric": per_metric}


def _num(x: float) -> str:
    return "inf" if not np.isfinite(x) else f"{x:.1g}"


def _short(error: str) -> str:
    error = " ".join(error.split())
    for marker in ("Exception encountered:", "Detected at node"):
        error = error.split(marker)[0].strip()
    return error[:90] + ("..." if len(error) > 90 else "")
