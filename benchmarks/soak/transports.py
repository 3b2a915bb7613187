"""Soak of every transport path: 20,000 steps each (tests/helpers/soak.py's PATHS, split over
its steps_per_execution phases), every task sampling its threads, open files, resident memory
and step function traces every 200 steps. Writes OUT/paths.json, OUT/paths.md (a table: the
growths tests/test_soak.py bounds, and the step time of each quarter of the phase) and
OUT/paths.png (threads over steps, a panel a path) when matplotlib is importable.

    .venv/bin/python benchmarks/soak/transports.py --out bench-out/soak-paths        # 20-30 minutes
    .venv/bin/python benchmarks/soak/transports.py --steps 2000 --paths tcp-ring      # a quick look

Run by hand, machine otherwise quiet. The step times are a benchmark figure (they include the
sampling callback), not a bound of any test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "helpers"))
import soak  # noqa: E402  (the soak tier's runner)

EVERY, WARMUP = 200, 1000  # at 10,000 steps a phase; fewer steps: in proportion (`main`)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        model = platform.processor() or "unknown CPU"
    return f"{model}, {os.cpu_count()} vCPU"


def quarters(samples: list[dict]) -> list[float]:
    """Milliseconds a step in each quarter of the samples after warm-up."""
    after = [s for s in samples if s["step"] >= WARMUP]
    n = len(after) // 4
    out = []
    for q in range(4):
        part = after[q * n : (q + 1) * n + 1]
        steps = part[-1]["step"] - part[0]["step"]
        out.append(1000 * (part[-1]["time"] - part[0]["time"]) / steps if steps else 0.0)
    return out


def summarize(path: str, reports: list[dict]) -> list[dict]:
    rows = []
    for r in reports:
        for p in r["phases"]:
            first, last = soak.rss_growth(p["samples"], WARMUP)
            rows.append(
                {
                    "path": path,
                    "task": r["task"],
                    "spe": p["spe"],
                    "steps": p["steps"],
                    "threads": [p["samples"][0]["threads"], p["samples"][-1]["threads"]],
                    "thread_growth": soak.growth(p["samples"], "threads", WARMUP),
                    "file_growth": soak.growth(p["samples"], "files", WARMUP),
                    "rss_mb": [first / 1024, last / 1024],
                    "rss_growth": last / first - 1,
                    "rss_per_step": soak.rss_per_step(first, last, p["steps"], WARMUP),
                    "retraced": p["traces"] - p["first_epoch_traces"],
                    "ms_per_step": quarters(p["samples"]),
                    "series": [(s["step"], s["threads"]) for s in p["samples"]],
                }
            )
    return rows


def table(rows: list[dict], machine: str) -> str:
    lines = [
        f"Machine: {machine}. Growth of threads and files: the least sample of the last "
        f"quarter after {WARMUP:,} steps against the first quarter's (`soak.growth`); RSS: "
        "the quarters' medians.",
        "",
        "| path | task | spe | steps | threads first / last (growth) | files growth | RSS MB "
        "first / last quarter (growth, bytes a step) | traced again after epoch 1 | ms a step, quarters 1-4 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms = " / ".join(f"{m:.1f}" for m in r["ms_per_step"])
        lines.append(
            f"| {r['path']} | {r['task']} | {r['spe']} | {r['steps']:,} | {r['threads'][0]} / "
            f"{r['threads'][1]} ({r['thread_growth']:+.0f}) | {r['file_growth']:+.0f} | "
            f"{r['rss_mb'][0]:.0f} / {r['rss_mb'][1]:.0f} ({100 * r['rss_growth']:+.1f}%, "
            f"{r.get('rss_per_step', 0):+,.0f}) | "
            f"{r['retraced']} | {ms} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    paths = list(dict.fromkeys(r["path"] for r in rows))
    fig, axes = plt.subplots(len(paths), 1, figsize=(8, 2.2 * len(paths)), squeeze=False)
    for ax, name in zip(axes[:, 0], paths):
        for r in (r for r in rows if r["path"] == name):
            steps, threads = zip(*r["series"])
            ax.plot(steps, threads, label=f"{r['task']} spe {r['spe']}")
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("threads")
        ax.legend(fontsize=7, loc="lower right")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20_000, help="per path (over its phases)")
    parser.add_argument("--paths", default=",".join(soak.PATHS))
    parser.add_argument("--out", default="bench-out/soak-paths")
    args = parser.parse_args(argv)
    global EVERY, WARMUP
    shortest = args.steps // 2  # a phase of a two-phase path
    EVERY, WARMUP = max(1, min(200, shortest // 50)), min(1000, shortest // 10)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(HERE, "..", "..", "tests", "helpers"), os.environ.get("PYTHONPATH", "")]
    )
    rows = []
    for name in args.paths.split(","):
        phases = len(soak.PATHS[name][2].split(","))
        with tempfile.TemporaryDirectory() as tmp:
            reports = soak.run(name, Path(tmp), args.steps // phases, every=EVERY, stop_at=10_000)
        rows += summarize(name, reports)
        print(table([r for r in rows if r["path"] == name], cpu_name()).split("\n", 4)[-1])
    os.makedirs(args.out, exist_ok=True)
    text = table(rows, cpu_name())
    Path(args.out, "paths.md").write_text(text + "\n")
    Path(args.out, "paths.json").write_text(json.dumps({"machine": cpu_name(), "rows": rows}))
    drawn = plot(rows, os.path.join(args.out, "paths.png"))
    print(text)
    print(f"wrote {args.out}/paths.md, paths.json" + (", paths.png" if drawn else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
