"""Long runs of tests/workers/soak_run.py on each transport path, for tests/test_soak.py and
benchmarks/soak/transports.py: `run` trains a path and returns every task's report, `growth` says
how much a sampled series grew."""

from __future__ import annotations

import json
import statistics

from cluster import launch_script, run_script

THREADS, FILES = 50, 10  # the most a run may grow by

# path -> (kind, devices per worker, steps_per_execution phases, ps tasks, workers (0: one
# process), communication)
PATHS = {
    "tcp-ring": ("car", 1, "1,4", 0, 2, "auto"),
    "tcp-ring-2-devices": ("car", 2, "1,4", 0, 2, "auto"),  # each worker sums its devices
    "tensorflow-ring": ("car", 2, "1,4", 0, 2, "ring"),
    "hybrid-ps": ("hybrid", 1, "1,4", 1, 2, "auto"),
    "localsgd": ("localsgd", 1, "4", 0, 2, "auto"),
    "ps-rpc": ("ps", 1, "4", 1, 2, "auto"),
    "mirrored": ("mirrored", 2, "1,4", 0, 0, "auto"),
    "model-parallel": ("model-parallel", 2, "4", 0, 0, "auto"),
}
# Paths whose resident memory grows by TensorFlow's own records, with the most a step may add
# (bytes; about twice the most measured, 9.1 KB): TensorFlow's collectives keep a record of every instance
# they ran for the life of the process (`CollectiveParamResolverLocal`'s instance table,
# tensorflow#42616). tfstrat's own paths run none in a step.
TENSORFLOW_RECORDS = {"tensorflow-ring": 20_000}


def run(path: str, out, steps: int, every: int, stop_at: int, spe: str | None = None) -> list[dict]:
    """Trains `path` for `steps` steps per phase (`spe`: its steps_per_execution phases
    instead of the path's), sampling every `every` steps, stopping a phase whose threads grew
    by more than `stop_at`; every task's report."""
    kind, devices, phases, ps, workers, communication = PATHS[path]
    spe = spe or phases
    args = ["soak_run.py", str(out), kind, "--steps", str(steps), "--spe", spe]
    args += ["--communication", communication]
    args += ["--devices", str(devices), "--every", str(every), "--max-threads", str(stop_at)]
    timeout = 400 + steps * 0.06  # start-up, and a slow path's 25 ms a step with slack
    if workers:
        code, log = launch_script(*args, workers=workers, ps=ps, timeout=timeout)
        assert code == 0, log[-6000:]
    else:
        run_script(*args, timeout=timeout)
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    assert len(reports) == (workers or 1), [p.name for p in out.iterdir()]
    return reports


def growth(samples: list[dict], key: str, warmup: int) -> float:
    """How much the floor of `samples[key]` rose: the least value of the last quarter of the
    samples after `warmup` steps minus the first quarter's. Dataset pipelines come and go at
    every epoch's end (a few dozen threads for a second), so single samples swing by 50 and
    the quarters' medians by 30 with where the samples fall; a leak lifts the floor."""
    after = [s[key] for s in samples if s["step"] >= warmup]
    assert len(after) >= 8, f"too few samples after warm-up: {len(after)}"
    quarter = len(after) // 4
    return min(after[-quarter:]) - min(after[:quarter])


def rss_growth(samples: list[dict], warmup: int) -> tuple[float, float]:
    """(first, last) quarter's median resident memory in KiB, of the samples after `warmup`."""
    rss = [s["rss_kib"] for s in samples if s["step"] >= warmup]
    quarter = len(rss) // 4
    return statistics.median(rss[:quarter]), statistics.median(rss[-quarter:])


def rss_per_step(first: float, last: float, steps: int, warmup: int) -> float:
    """Bytes of resident memory a step added, from `rss_growth`'s quarter medians (KiB) of a
    phase of `steps` steps: the medians lie three quarters of the steps after warm-up apart."""
    return (last - first) * 1024 / (0.75 * max(1, steps - warmup))


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
