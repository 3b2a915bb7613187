"""`tfstrat bench scaling`: a 2019 ResNet-50 Mirrored vs CollectiveAllReduce table, remade on this host.

That table (ResNet-50, 8 GPUs per worker) reported global steps/s: Mirrored 1.26;
CollectiveAllReduce 1 worker 1.06, 2 workers 1.98, 3 workers 2.925. Its global batch grows
with the workers, so steps/s alone cannot compare rows: every speed-up and the scaling
efficiency here come from examples/s, efficiency(W) = ex/s(W) / (W x ex/s(1 worker)).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from tfstrat.bench import _report
from tfstrat.bench._worker import HELD_OUT

logger = logging.getLogger(__name__)
WORKER = "tfstrat.bench._worker"
LOCALSGD_SYNC_EVERY = (1, 4, 16)


def _with_accuracy(row: dict) -> bool:
    """Rows trained on learnable labels, with accuracy on held-out images: LocalSGD's and the
    CollectiveAllReduce rows they are compared with."""
    return row["row"].startswith(("B-", "L-"))


@dataclasses.dataclass(frozen=True)
class ScalingConfig:
    """Arguments of `tfstrat bench scaling` (see `tfstrat bench scaling --help`)."""

    workers: Sequence[int] = (1, 2)
    devices_per_worker: int = 1
    model: str | None = None  # None: resnet50 where GPUs exist, else small
    batch_per_device: int | None = None  # None: 128 on GPUs (as in the 2019 table), else 64
    image: int | None = None  # None: 224 for resnet50, 32 for small
    steps: int = 20
    repeats: int = 3
    peer: bool = False
    threads: int | None = None  # intra-op threads per worker process; None: cores / max workers
    out: str = "bench-out"
    rows: Sequence[str] | None = None  # row ids to run (None: all)


def _resolve(config: ScalingConfig, machine: dict) -> ScalingConfig:
    gpu = machine["gpus"] > 0
    model = config.model or ("resnet50" if gpu else "small")
    return dataclasses.replace(
        config,
        model=model,
        batch_per_device=config.batch_per_device or (128 if gpu else 64),
        image=config.image or (224 if model == "resnet50" else 32),
        threads=config.threads or max(1, machine["cpus"] // max(config.workers)),
    )


def _rows(c: ScalingConfig, cpus: int, gpus: int = 0) -> list[dict]:
    """(row id, label, strategy, workers, devices per worker, threads per process, env).

    On a host with `gpus` GPUs the A rows train on all of them, and B-W's W workers split them
    (`tfstrat launch` gives each its own: W must divide the count); the 2019 table's B rows used
    W machines of 8 GPUs each, which `--nodes` runs."""
    d, t = c.devices_per_worker, c.threads
    rows = [
        ("P-1", "one process, no strategy", "none", 1, 1, t, None),
        ("P-all", "one process, no strategy, all cores", "none", 1, 1, cpus, None),
    ]
    for w in (w for w in c.workers if w > 1):
        rid, label, strategy, workers, threads, env = _report.side_by_side_row(w, t)
        rows.append((rid, label, strategy, workers, 1, threads, env))
    rows += [
        ("A-1", "MirroredNCCL", "mirrored", 1, gpus or d, t, None),
        ("A-2", "CollectiveAllReduce", "collective", 1, gpus or d, t, None),
    ]
    if gpus:
        rows += [
            (
                f"B-{w}",
                f"CollectiveAllReduce, {w} worker(s) splitting this host's {gpus} GPUs",
                "collective",
                w,
                gpus // w,
                t,
                None,
            )
            for w in c.workers
            if gpus % w == 0
        ]
    else:
        rows += [(f"B-{w}", "CollectiveAllReduce", "collective", w, d, t, None) for w in c.workers]
    w = max(c.workers)
    if w > 1:  # LocalSGD (changes the algorithm: its rows report accuracy next to B-W's)
        rows += [
            (f"L-{w}-s{s}", f"LocalSGD, sync every {s}", f"localsgd-{s}", w, 1, t, None)
            for s in LOCALSGD_SYNC_EVERY
        ]
    rows += [
        (f"PS-S-{w}", "ParameterServer sync, 1 ps", "ps-sync", w, 1, t, None),
        (f"PS-A-{w}", "ParameterServer async, 1 ps", "ps-async", w, 1, t, None),
    ]
    if c.peer:
        legacy = {"TF_USE_LEGACY_KERAS": "1"}
        rows += [
            ("S-1", "stock, tf-keras, no strategy", "tfkeras-none", 1, 1, t, legacy),
            ("S-A", "stock MirroredStrategy, tf-keras", "tfkeras-mirrored", 1, d, t, legacy),
        ]
        rows += [
            (f"S-B-{w}", "stock MultiWorkerMirrored, tf-keras", "tfkeras-mwms", w, 1, t, legacy)
            for w in c.workers
            if w > 1
        ]
        w = max(c.workers)
        rows.append(
            (f"S-K3-{w}", "stock MultiWorkerMirrored, Keras 3", "keras3-mwms", w, 1, t, None)
        )
        rows += [
            (
                f"S-PS-{w}",
                "stock ParameterServer (async, 1 ps), tf-keras",
                "tfkeras-ps",
                w,
                1,
                t,
                legacy,
            )
            for w in c.workers
        ]
    keys = ("row", "label", "strategy", "workers", "devices_per_worker", "threads", "env")
    return _report.select([dict(zip(keys, r)) for r in _report.with_tuned_peers(rows)], c.rows)


def run(config: ScalingConfig) -> list[dict]:
    """Measures every row, one after another, and writes scaling.{md,json,png} to `config.out`."""
    machine = _report.machine()
    c = _resolve(config, machine)
    rows = _rows(c, machine["cpus"], machine["gpus"])
    try:
        _measure(rows, c, machine)
    except (_report.Interrupted, KeyboardInterrupt):  # Ctrl-C in a row, or between rows
        measured = [r for r in rows if "env" not in r]  # a measured row has lost its env
        _derive(measured)
        _report.write(c.out, "scaling", measured, table(measured, c), _plot)
        raise
    _derive(rows)
    _report.write(c.out, "scaling", rows, table(rows, c), _plot)
    return rows


def _measure(rows: list[dict], c: ScalingConfig, machine: dict) -> None:
    for i, row in enumerate(rows, 1):
        worker_config = {
            "strategy": row["strategy"],
            "model": c.model,
            "image": c.image,
            "batch_per_device": c.batch_per_device,
            "devices": row["devices_per_worker"],
            "steps": c.steps,
            "repeats": c.repeats,
            "threads": row["threads"],
            "accuracy": _with_accuracy(row),
            "host_processes": row["workers"],  # they share this host's memory
        }
        ps_mode = row["strategy"] == "tfkeras-ps"
        result = _report.run_row(
            WORKER,
            worker_config,
            workers=row["workers"],
            threads=row["threads"],
            env=row["env"],
            ps=_report.ps_tasks(row["strategy"]),
            chief=ps_mode,
            every_task=row["row"].startswith("P-1x"),
            # On a GPU host each task takes its row's GPUs (LocalSGD's and ParameterServer's
            # rows one each, the rest of the cards unused), not an even split of them all.
            gpus_per_task=row["devices_per_worker"] if machine["gpus"] else None,
        )
        row.update(result, model=c.model, image=c.image, machine=machine)
        row["total_devices"] = row["workers"] * row["devices_per_worker"]
        row.pop("env")
        speed = f"{row['examples_per_s']:,.0f} ex/s" if "examples_per_s" in row else row["error"]
        logger.info("[%d/%d] %s %s: %s", i, len(rows), row["row"], row["label"], speed)


def _derive(rows: list[dict]):
    """Speed vs P-1, A-1 and A-2, and scaling efficiency, all from examples/s: against one
    tfstrat worker (B-1, else A-2), and against one plain process (P-1), which also charges
    the strategy's own cost on one core."""
    rate = {r["row"]: r.get("examples_per_s") for r in rows}
    one_worker = rate.get("B-1") or rate.get("A-2")
    for r in rows:
        x = r.get("examples_per_s")
        r["vs_P1"] = x / rate["P-1"] if x and rate.get("P-1") else None
        r["vs_A1"] = x / rate["A-1"] if x and rate.get("A-1") else None
        r["vs_A2"] = x / rate["A-2"] if x and rate.get("A-2") else None
        if x and one_worker and r["row"].startswith("B-"):
            r["efficiency"] = x / (r["workers"] * one_worker)
        if x and rate.get("P-1") and r["row"] != "P-all":
            r["efficiency_P1"] = x / (r["workers"] * rate["P-1"])
        _report.against_limit(r, rows)


def _fmt(x, spec):
    return format(x, spec) if x is not None else "-"


def table(rows: Sequence[dict], c: ScalingConfig) -> str:
    headers = [
        "row",
        "strategy",
        "workers",
        "devices/worker",
        "total devices",
        "global steps/s",
        "examples/s (min-max)",
        "vs P-1",
        "vs A-1",
        "vs A-2",
        "efficiency",
        "efficiency vs P-1",
        "vs limit",
        "accuracy",
    ]
    body = []
    for r in rows:
        lead = [r["row"], r["label"], r["workers"], r["devices_per_worker"], r["total_devices"]]
        if "error" in r:
            body.append([*lead, "-", f"failed: {r['error'][:120]}"] + ["-"] * 7)
            continue
        body.append(
            [
                *lead,
                f"{r['steps_per_s']:.2f}",
                f"{r['examples_per_s']:,.0f} ({r['examples_per_s_min']:,.0f}-{r['examples_per_s_max']:,.0f})",
                _fmt(r["vs_P1"], ".2f"),
                _fmt(r["vs_A1"], ".2f"),
                _fmt(r["vs_A2"], ".2f"),
                _fmt(r.get("efficiency"), ".0%"),
                _fmt(r.get("efficiency_P1"), ".0%"),
                _fmt(r.get("vs_limit"), ".0%"),
                _fmt(r.get("accuracy"), ".1%"),
            ]
        )
    m = rows[0]["machine"] if rows else {}
    notes = (
        f"\nModel `{c.model}` ({c.image}x{c.image}x3 synthetic images), {c.batch_per_device} "
        f"examples per device per step, SGD with momentum; median of {c.repeats} timed epochs "
        f"of {c.steps} steps after one warm-up epoch. Threads: {c.threads} in each of TensorFlow's "
        f"pools (intra-op and inter-op) per process, so each process keeps at most {c.threads} "
        f"core(s) busy (row P-all: {m.get('cpus')}). Machine: {m.get('cpu')}, {m.get('cpus')} CPUs, "
        f"{m.get('gpus')} GPUs, TensorFlow {m.get('tensorflow')}, Keras {m.get('keras')}. "
        "Speed-ups and efficiency use examples/s; efficiency(W) = ex/s(W) / (W x ex/s(B-1)); "
        "efficiency vs P-1 = ex/s / (W x ex/s(P-1)), which also counts what a strategy costs "
        'on one core. Rows ending in t ("tuned") run the stock row again with the CPU '
        "allocator tfstrat gives its own tasks (TF_CPU_ALLOCATOR_USE_BFC=true). Rows B and L "
        "(LocalSGD, which averages the weights every N steps instead of the gradients every "
        "step) train on learnable labels (noise over a colour per image, labelled by a fixed random "
        "linear map of the colour) and "
        f"report accuracy on {HELD_OUT:,} held-out images after the run."
    )
    return _report.markdown(headers, body) + "\n" + notes


def _plot(ax, rows):
    ok = [r for r in rows if "examples_per_s" in r]
    labels = [f"{r['row']} {r['label']} ({r['workers']}x{r['devices_per_worker']})" for r in ok]
    values = [r["examples_per_s"] for r in ok]
    errors = [
        [v - r["examples_per_s_min"] for v, r in zip(values, ok)],
        [r["examples_per_s_max"] - v for v, r in zip(values, ok)],
    ]
    colors = [_report.color(r) for r in ok]
    ax.barh(range(len(ok)), values, xerr=errors, color=colors)
    ax.set_yticks(range(len(ok)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("examples/s (median, min-max)")
    ax.set_title("tfstrat bench scaling (blue: tfstrat, green: the limit, gray: the rest)")
