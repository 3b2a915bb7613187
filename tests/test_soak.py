"""Long runs: a process's threads and open files stop growing after the first steps, on every
transport path, with steps_per_execution 1 and 4, one and two devices per worker.

The smoke (default tier, about 3 minutes) trains each path for 1,000 steps per
steps_per_execution; the soak tier (`-m soak`, run by hand: 10-30 minutes) for 20,000 and
also holds resident memory and retracing to account. Both run tests/workers/soak_run.py
under `tfstrat launch` (or alone, for the one-process strategies), which samples
/proc/self every few steps and asks training to stop once the threads grew by more than
`STOP_AT`: a build that leaks (a thread per collective op, as TensorFlow's per-op timeouts
start) ends within a few hundred steps instead of exhausting the machine, and fails here.

Growth is measured robustly: the median of the last quarter's samples against the median of
the first quarter's after warm-up (dataset pipelines come and go at epoch ends, a few dozen
threads at a time).
"""

from __future__ import annotations

import json
import statistics
import sys

import pytest
from cluster import launch_script, run_script

THREADS, FILES = 50, 10  # the most a run may grow by
STOP_AT = 4 * THREADS  # growth at which a leaking run is stopped early
RSS_GROWTH = 0.05  # the soak's bound on resident memory, first quarter to last

# (kind, devices per worker, steps_per_execution phases, ps tasks, workers; 0: one process)
PATHS = {
    "tcp-ring": ("car", 1, "1,4", 0, 2),
    "tensorflow-ring": ("car", 2, "1,4", 0, 2),
    "hybrid-ps": ("hybrid", 1, "1,4", 1, 2),
    "localsgd": ("localsgd", 1, "4", 0, 2),
    "ps-rpc": ("ps", 1, "4", 1, 2),
    "mirrored": ("mirrored", 2, "1,4", 0, 0),
    "model-parallel": ("model-parallel", 2, "4", 0, 0),
}


def run(path: str, out, steps: int, every: int) -> list[dict]:
    """Trains `path` for `steps` steps per phase; every task's report."""
    kind, devices, spe, ps, workers = PATHS[path]
    args = [
        "soak_run.py",
        str(out),
        kind,
        "--steps",
        str(steps),
        "--spe",
        spe,
        "--devices",
        str(devices),
        "--every",
        str(every),
        "--max-threads",
        str(STOP_AT),
    ]
    if workers:
        code, log = launch_script(*args, workers=workers, ps=ps)
        assert code == 0, log[-6000:]
    else:
        run_script(*args)
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    assert len(reports) == (workers or 1), [p.name for p in out.iterdir()]
    return reports


def growth(samples: list[dict], key: str, warmup: int) -> float:
    """Median of the last quarter of `samples` (after `warmup` steps) minus the first's."""
    after = [s[key] for s in samples if s["step"] >= warmup]
    assert len(after) >= 8, f"too few samples after warm-up: {len(after)}"
    quarter = len(after) // 4
    return statistics.median(after[-quarter:]) - statistics.median(after[:quarter])


def check(reports: list[dict], steps: int, warmup: int) -> list[str]:
    """Every task's phases: trained to the end, threads and files flat. Returns lines for
    the failure message and the log: task, steps_per_execution, growth."""
    lines, bad = [], []
    for r in reports:
        for p in r["phases"]:
            threads = growth(p["samples"], "threads", warmup)
            files = growth(p["samples"], "files", warmup)
            line = (
                f"{r['task']} spe {p['spe']}: {p['steps']} steps, threads "
                f"{p['samples'][0]['threads']} -> {p['samples'][-1]['threads']} "
                f"(growth {threads:+.0f}), files growth {files:+.0f}, stopped={p['stopped']}"
            )
            lines.append(line)
            if p["stopped"] or p["steps"] < steps or threads >= THREADS or files >= FILES:
                bad.append(line)
    assert not bad, "\n".join(["grew or stopped early:", *bad, "every phase:", *lines])
    return lines


@pytest.mark.cluster
@pytest.mark.timeout(240)
@pytest.mark.parametrize("path", list(PATHS))
def test_threads_and_files_stay_flat_for_a_thousand_steps(path, tmp_path):
    steps = 1000
    lines = check(run(path, tmp_path, steps, every=25), steps, warmup=100)
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
    """Also: resident memory grows less than 5% from the first quarter to the last, and no
    step function is traced again after the first epoch. Step times per quarter are printed
    (a benchmark figure: `tfstrat bench soak` tabulates them)."""
    steps = 20_000
    reports = run(path, tmp_path, steps, every=200)
    lines = check(reports, steps, warmup=1000)
    for r in reports:
        for p in r["phases"]:
            rss = [s["rss_kib"] for s in p["samples"] if s["step"] >= 1000]
            quarter = len(rss) // 4
            first, last = statistics.median(rss[:quarter]), statistics.median(rss[-quarter:])
            assert last < first * (1 + RSS_GROWTH), (r["task"], p["spe"], first, last)
            assert p["traces"] == p["first_epoch_traces"], (r["task"], p["spe"], p["traces"])
    print("\n".join(lines), file=sys.stderr)
