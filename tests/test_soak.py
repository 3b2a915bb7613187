"""Long runs: a process's threads and open files stop growing after the first steps, on every
transport path, with steps_per_execution 1 and 4, one and two devices per worker.

The smoke (default tier, about 3 minutes) trains each path for 1,000 steps per
steps_per_execution (tcp-ring and hybrid-ps: 4 only, where TensorFlow's collectives run inside
the step); the soak tier (`-m soak`, run by hand: 10-30 minutes) for 20,000 and
(10,000 per phase) and also holds resident memory and retracing to account. Both run
tests/workers/soak_run.py under `tfstrat launch` (or alone, for the one-process strategies;
tests/helpers/soak.py), which samples /proc/self every few steps and asks training to stop
once the threads grew by more than 400: a build that leaks (a thread per collective op, as TensorFlow's per-op timeouts
start) ends within a few hundred steps instead of exhausting the machine, and fails here.

Growth is how much the floor rose: the least sample of the last quarter after warm-up
against the first quarter's (dataset pipelines come and go at epoch ends, a few dozen threads
at a time; a leak lifts the floor). Resident memory's quarters are compared by their medians.
"""

from __future__ import annotations

import sys

import pytest
from soak import (
    PATHS,
    TENSORFLOW_RECORDS,
    THREADS,
    check,
    rss_growth,
    rss_per_step,
    run,
)

RSS_GROWTH = 0.05  # the soak's bound on resident memory, first quarter to last
# A sample this far above the first stops the run: a leak of a thread per op passes it within
# a few hundred steps; a healthy run's epoch-end pipelines, freed by Python's cyclic
# collector, reach +140 (the one-device paths' sawtooth, docs/benchmarks.md "Long runs").
STOP_AT = 8 * THREADS
SMOKE_SPE_4_ONLY = ("tcp-ring", "tcp-ring-2-devices", "hybrid-ps")


@pytest.mark.cluster
@pytest.mark.timeout(240)
@pytest.mark.parametrize("path", list(PATHS))
def test_threads_and_files_stay_flat_for_a_thousand_steps(path, tmp_path):
    steps = 1000
    # With one device per worker and steps_per_execution 1, tfstrat's own paths run no
    # TensorFlow collective inside a step (where a thread per op would start): the smoke runs
    # their steps_per_execution 4 phase only; the soak tier runs both.
    spe = "4" if path in SMOKE_SPE_4_ONLY else None
    reports = run(path, tmp_path, steps, every=25, stop_at=STOP_AT, spe=spe)
    lines = check(reports, steps, warmup=100)
    print("\n".join(lines))


@pytest.fixture
def soak_only(request):
    """The soak runs when `-m` names it (`scripts/test -m soak`), not by default."""
    if "soak" not in (request.config.getoption("markexpr") or ""):
        pytest.skip(
            "the soak tier (20,000 steps a path, 10-30 minutes, run by hand; the default run "
            "has the 1,000-step smoke of every path): run it with `scripts/test -m soak`"
        )


@pytest.mark.soak
@pytest.mark.usefixtures("soak_only")
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("path", list(PATHS))
def test_twenty_thousand_steps_flat_threads_files_memory_and_no_retracing(path, tmp_path):
    """Also: resident memory grows less than 5% from the first quarter to the last (on
    TensorFlow's ring, by less than its records' bound a step: `soak.TENSORFLOW_RECORDS`), and
    no step function is traced again after the first epoch. Step times per quarter are printed
    (a benchmark figure: `tfstrat bench soak` tabulates them)."""
    steps = 20_000 // len(PATHS[path][2].split(","))  # per steps_per_execution phase
    reports = run(path, tmp_path, steps, every=200, stop_at=STOP_AT)
    lines = check(reports, steps, warmup=1000)
    for r in reports:
        for p in r["phases"]:
            first, last = rss_growth(p["samples"], 1000)
            if path in TENSORFLOW_RECORDS:  # TensorFlow's own, bounded per step
                per_step = rss_per_step(first, last, p["steps"], 1000)
                bound = TENSORFLOW_RECORDS[path]
                assert per_step < bound, (r["task"], p["spe"], first, last, per_step)
            else:
                assert last < first * (1 + RSS_GROWTH), (r["task"], p["spe"], first, last)
            assert p["traces"] == p["first_epoch_traces"], (r["task"], p["spe"], p["traces"])
    print("\n".join(lines), file=sys.stderr)
