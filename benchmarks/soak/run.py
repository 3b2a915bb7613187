"""Soak: Hybrid and ParameterServer (async) trained for many steps (50,000 by default) under
`tfstrat launch --workers 2 --ps 1`, every task's resident memory, open files and threads
sampled at intervals. Prints a table per run and each series' slope over the run's second half
(what grows once start-up is over), and writes OUT/soak.json.

    .venv/bin/python benchmarks/soak/run.py --steps 50000 --out bench-out/soak
    .venv/bin/python benchmarks/soak/run.py --steps 5000 --every 5   # a quick look

Not part of the test suite (it runs for tens of minutes); run by hand, machine otherwise quiet.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "helpers"))
import procs  # noqa: E402  (the tests' /proc scanner)

TASKS = ("ps:0", "worker:0", "worker:1")  # what `tfstrat launch --workers 2 --ps 1` starts


def _tasks(marker: str) -> dict[str, int]:
    """{task name: pid} of the run's tasks (by the environment `tfstrat launch` gives them)."""
    found = {}
    for task in TASKS:
        pids = procs.find(env=[f"TFSTRAT_SOAK={marker}", f"TFSTRAT_TASK={task}"])
        if pids:
            found[task] = pids[0]
    return found


def _sample(pid: int) -> dict | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        files = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    return {
        "rss_mb": int(status["VmRSS"].split()[0]) / 1024,
        "files": files,
        "threads": int(status["Threads"]),
    }


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope, per hour, of the second half of (seconds, value)."""
    half = points[len(points) // 2 :]
    if len(half) < 2:
        return 0.0
    n = len(half)
    mx = sum(t for t, _ in half) / n
    my = sum(v for _, v in half) / n
    var = sum((t - mx) ** 2 for t, _ in half)
    return 3600 * sum((t - mx) * (v - my) for t, v in half) / var if var else 0.0


def soak(kind: str, steps: int, every: float) -> dict:
    marker = uuid.uuid4().hex
    env = dict(os.environ, TFSTRAT_SOAK=marker)
    command = [sys.executable, "-m", "tfstrat", "launch", "--workers", "2", "--ps", "1"]
    command += ["--", sys.executable, os.path.join(HERE, "worker.py"), kind, str(steps)]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    series: dict[str, dict[str, list]] = {}
    started = time.monotonic()
    while proc.poll() is None:
        now = time.monotonic() - started
        for task, pid in _tasks(marker).items():
            sample = _sample(pid)
            if sample is None:
                continue
            for key, value in sample.items():
                series.setdefault(task, {}).setdefault(key, []).append((now, value))
        time.sleep(every)
    out = proc.stdout.read()
    took = time.monotonic() - started
    if proc.returncode != 0 or "soak: done" not in out:
        raise SystemExit(f"soak {kind}: the run failed ({proc.returncode}):\n{out[-3000:]}")
    result = {"kind": kind, "steps": steps, "seconds": took, "tasks": {}}
    for task, keys in sorted(series.items()):
        result["tasks"][task] = {
            key: {
                "first": points[0][1],
                "last": points[-1][1],
                "max": max(v for _, v in points),
                "slope_per_hour": _slope(points),
                "samples": len(points),
            }
            for key, points in keys.items()
        }
    return result


def table(results: list[dict]) -> str:
    lines = [
        "| run | task | RSS MB first / last / max | RSS MB per hour, 2nd half | open files first / "
        "last | threads first / last | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for task, k in r["tasks"].items():
            rss, files, threads = k["rss_mb"], k["files"], k["threads"]
            lines.append(
                f"| {r['kind']} ({r['steps']:,} steps) | {task} | {rss['first']:.0f} / "
                f"{rss['last']:.0f} / {rss['max']:.0f} | {rss['slope_per_hour']:+.1f} | "
                f"{files['first']} / {files['last']} | {threads['first']} / {threads['last']} | "
                f"{r['seconds']:.0f} |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50_000)
    parser.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--kinds", default="hybrid,ps-async")
    parser.add_argument("--out", default="bench-out/soak")
    args = parser.parse_args(argv)
    results = [soak(kind, args.steps, args.every) for kind in args.kinds.split(",")]
    text = table(results)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "soak.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out, "soak.md"), "w") as f:
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
