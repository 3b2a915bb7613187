"""Running benchmark rows as real processes, and writing NAME.md / NAME.json / NAME.png."""

from __future__ import annotations

import io
import json
import os
import platform
import sys
from collections.abc import Sequence

from tfstrat.errors import UnknownRows
from tfstrat.launcher.api import LaunchConfig, launch


def machine() -> dict:
    """What every row records about the machine it ran on."""
    from tfstrat.cluster.devices import devices

    info = devices()
    return {
        "cpu": cpu_name(),
        "cpus": info.cpu_count,
        "gpus": len(info.gpus),
        "tensorflow": info.tensorflow_version,
        "keras": info.keras_version,
        "python": platform.python_version(),
    }


def cpu_name() -> str:
    """The processor's model name (/proc/cpuinfo), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def side_by_side_row(workers: int, threads: int | None) -> tuple:
    """The machine's own limit for W workers: W independent one-process runs (P-1) at once,
    their examples/s summed (`run_row(..., every_task=True)`). Lock-step training on the same
    cores cannot beat it; every multi-worker row is read against it."""
    label = f"{workers} independent P-1 processes at once (the limit)"
    return (f"P-1x{workers}", label, "none", workers, threads, None)


PS_STRATEGIES = ("tfkeras-ps", "ps-sync", "ps-async", "hybrid")
# Rows that run a tfstrat strategy; the others are peers (no strategy, stock, tf-keras).
TFSTRAT_STRATEGIES = ("mirrored", "collective", "ps-sync", "ps-async", "hybrid", "localsgd")


TUNED = {"TF_CPU_ALLOCATOR_USE_BFC": "true"}


def with_tuned_peers(rows: list[tuple]) -> list[tuple]:
    """`rows` (id, label, strategy, ..., env last) with a "stock, tuned" twin after each peer
    row (P-1 and the stock ones): the same peer given the CPU allocator tfstrat gives its own
    tasks (`tfstrat.runtime.allocator`), so a table shows both what a user gets out of the box and the
    like-for-like comparison."""
    out = []
    for row in rows:
        out.append(row)
        twin = row[0] != "P-all" and not row[0].startswith("P-1x")
        if twin and not str(row[2]).startswith(TFSTRAT_STRATEGIES):
            rid, label, *middle, env = row
            out.append(
                (f"{rid}t", f"{label}, tuned (BFC allocator)", *middle, {**(env or {}), **TUNED})
            )
    return out


def color(row: dict) -> str:
    """A row's bar colour: tfstrat's strategies blue, the side-by-side limit green, the rest
    (one plain process, stock peers) gray."""
    if row["row"].startswith("P-1x"):
        return "tab:green"
    return "tab:blue" if str(row["strategy"]).startswith(TFSTRAT_STRATEGIES) else "tab:gray"


def against_limit(row: dict, rows: Sequence[dict]) -> None:
    """Sets `row["vs_limit"]`: its examples/s over the side-by-side row's of as many workers
    (P-1xW) in the same run, for multi-worker rows."""
    limit = next(
        (r.get("examples_per_s") for r in rows if r["row"] == f"P-1x{row['workers']}"), None
    )
    x = row.get("examples_per_s")
    multi = row["workers"] > 1 and not row["row"].startswith("P-1x")
    row["vs_limit"] = x / limit if x and limit and multi else None


def select(rows: list[dict], wanted: Sequence[str] | None) -> list[dict]:
    """The rows whose ids are in `wanted` (all when None), in table order; an unknown id is an
    UnknownRows error that lists the ids there are."""
    if not wanted:
        return rows
    ids = [r["row"] for r in rows]
    unknown = [w for w in wanted if w not in ids]
    if unknown:
        raise UnknownRows(
            f"tfstrat bench: --rows {','.join(unknown)}: no such row here. "
            f"Rows: {','.join(ids)} (--peer adds the stock ones)"
        )
    return [r for r in rows if r["row"] in wanted]


def ps_tasks(strategy: str) -> int:
    """ps tasks a benchmark row's cluster needs: one for the parameter-server strategies."""
    return 1 if strategy in PS_STRATEGIES else 0


INTERRUPTED_SIGINT, INTERRUPTED_SIGTERM = 130, 143  # the launcher's exit codes for them
LAUNCHER_STOPPED = "received; stopped all tasks"  # what the launcher says then


class Interrupted(Exception):
    """Ctrl-C or SIGTERM during a row: the benchmark stops (exit `code`), keeping the rows
    measured before it."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def run_row(
    module: str,
    config: dict,
    *,
    workers: int,
    threads: int | None,
    env: dict | None = None,
    timeout: float = 900,
    ps: int = 0,
    chief: bool = False,
    every_task: bool = False,
    gpus_per_task: int | None = None,
) -> dict:
    """Runs `python -m MODULE CONFIG` on `workers` tasks; returns worker 0's RESULT, or an error.

    With `every_task` (independent processes, no strategy: the side-by-side row), the tasks'
    examples/s are summed instead, and each task's RESULT is under "tasks". `gpus_per_task`:
    each training task's own GPUs (`tfstrat launch --gpus-per-task`; None: the launcher's
    even split of the host's GPUs).
    A row that fails (a stock peer that crashes, say) returns `{"error": "..."}` naming the
    first line of the failure, so the table can say how it failed.
    """
    peer = not str(config.get("strategy", "")).startswith(TFSTRAT_STRATEGIES)
    if peer and "TF_CPU_ALLOCATOR_USE_BFC" not in (env or {}):
        # A peer row runs as a user without tfstrat would: TensorFlow's own CPU allocator, not
        # the one a tfstrat strategy or `tfstrat launch` sets (`tfstrat.runtime.allocator`).
        env = {**(env or {}), "TFSTRAT_CPU_ALLOCATOR": "default"}
    out = io.StringIO()
    command = [sys.executable, "-m", module, json.dumps(config)]
    code = launch(
        LaunchConfig(
            command,
            workers=workers,
            ps=ps,
            chief=chief,
            threads_per_task=threads,
            timeout=timeout,
            env=env,
            gpus_per_task=gpus_per_task,
        ),
        out,
    )
    if code in (INTERRUPTED_SIGINT, INTERRUPTED_SIGTERM) and LAUNCHER_STOPPED in out.getvalue():
        raise Interrupted(code)  # the bench got the signal (not a task's own exit code)
    lines = out.getvalue().splitlines()
    results = {}
    for line in lines:
        prefix, _, rest = line.partition(" ")
        if rest.startswith("RESULT "):
            results[prefix.strip("[]")] = json.loads(rest[len("RESULT ") :])
    if every_task and len(results) == workers:
        tasks = [results[k] for k in sorted(results)]
        summed = {
            k: sum(t[k] for t in tasks)
            for k in ("examples_per_s", "examples_per_s_min", "examples_per_s_max", "steps_per_s")
        }
        return {**tasks[0], **summed, "tasks": tasks}
    for task in ("worker:0", "chief:0"):
        if task in results and not every_task:
            return results[task]
    errors = [line for line in lines if "Error" in line and "Traceback" not in line]
    return {"error": (errors[-1] if errors else f"exit code {code}")[-300:]}


def write(out_dir: str, name: str, rows: Sequence[dict], table: str, plot) -> list[str]:
    """Writes NAME.md (the table), NAME.json (the rows) and NAME.png (`plot(ax, rows)`; only
    with matplotlib, from the `bench` extra: without it, says so). Returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f"{name}.{ext}") for ext in ("md", "json", "png")]
    with open(paths[0], "w") as f:
        f.write(table + "\n")
    with open(paths[1], "w") as f:
        json.dump(list(rows), f, indent=1)
    try:
        import matplotlib
    except ImportError:
        print(
            f"tfstrat bench: no plot ({name}.png): matplotlib is not installed; "
            "pip install 'tfstrat[bench]' for it",
            file=sys.stderr,
        )
        return paths[:2]
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.8))
    plot(ax, rows)
    fig.tight_layout()
    fig.savefig(paths[2], dpi=110)
    plt.close(fig)
    return paths


def markdown(headers: Sequence[str], body: Sequence[Sequence]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
    return "\n".join(lines)
