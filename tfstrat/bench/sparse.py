"""`tfstrat bench sparse`: an embedding-heavy, LM1B-like model, where Parallax showed its gains.

A 200,000 x 64 embedding of Zipf-distributed ids, two Conv1D layers and a small dense head,
Adagrad. Rows: one process (one thread, all cores), CollectiveAllReduce, ParameterServer (sync and
async), Hybrid with one ps task, and the stock peers
(tf-keras MultiWorkerMirroredStrategy, and async ParameterServerStrategy with a chief
coordinator, the workers and one ps task).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from tfstrat.bench import _report

logger = logging.getLogger(__name__)
WORKER = "tfstrat.bench._worker"


@dataclasses.dataclass(frozen=True)
class SparseConfig:
    workers: Sequence[int] = (2,)
    vocab: int | Sequence[int] = 200_000  # several: every row once per table size
    dim: int = 64
    seq: int = 20
    classes: int = 1000
    batch_per_device: int = 64
    steps: int = 20
    repeats: int = 3
    peer: bool = False
    threads: int | None = None
    out: str = "bench-out"
    rows: Sequence[str] | None = None  # row ids to run (None: all)


def _rows(c: SparseConfig, cpus: int) -> list[dict]:
    t = c.threads or max(1, cpus // max(c.workers))
    legacy = {"TF_USE_LEGACY_KERAS": "1"}
    rows = [
        ("P-1", "one process, no strategy", "none", 1, t, None),
        ("P-all", "one process, no strategy, all cores", "none", 1, cpus, None),
    ]
    rows += [_report.side_by_side_row(w, t) for w in c.workers if w > 1]
    rows += [(f"C-{w}", "CollectiveAllReduce", "collective", w, t, None) for w in c.workers]
    w = max(c.workers)
    rows += [
        (f"PS-S-{w}", "ParameterServer sync, 1 ps", "ps-sync", w, t, None),
        (f"PS-A-{w}", "ParameterServer async, 1 ps", "ps-async", w, t, None),
        (f"H-{w}", "Hybrid, 1 ps", "hybrid", w, t, None),
        (
            f"H-{w}k",
            "Hybrid, 1 ps, keras.layers.Embedding",
            "hybrid",
            w,
            t,
            {"TFSTRAT_BENCH_EMBEDDING": "keras"},
        ),
    ]
    if c.peer:
        rows.append(("S-1", "stock, tf-keras, no strategy", "tfkeras-none", 1, t, legacy))
        rows += [
            (f"S-B-{w}", "stock MultiWorkerMirrored, tf-keras", "tfkeras-mwms", w, t, legacy)
            for w in c.workers
            if w > 1
        ]
        rows += [
            (
                f"S-PS-{w}",
                "stock ParameterServer (async, 1 ps), tf-keras",
                "tfkeras-ps",
                w,
                t,
                legacy,
            )
            for w in c.workers
        ]
    keys = ("row", "label", "strategy", "workers", "threads", "env")
    return _report.select([dict(zip(keys, r)) for r in _report.with_tuned_peers(rows)], c.rows)


def vocabs(c: SparseConfig) -> tuple[int, ...]:
    return (c.vocab,) if isinstance(c.vocab, int) else tuple(c.vocab)


def run(config: SparseConfig) -> list[dict]:
    machine = _report.machine()
    plan = [(vocab, row) for vocab in vocabs(config) for row in _rows(config, machine["cpus"])]
    base = {
        "workload": "sparse",
        "dim": config.dim,
        "seq": config.seq,
        "classes": config.classes,
        "batch_per_device": config.batch_per_device,
        "steps": config.steps,
        "repeats": config.repeats,
        "devices": 1,
    }
    rows: list[dict] = []
    try:
        _measure(plan, base, config, machine, rows)
    except (_report.Interrupted, KeyboardInterrupt):  # Ctrl-C in a row, or between rows
        _finish(rows, config)  # the rows measured before it
        raise
    _finish(rows, config)
    return rows


def _measure(plan, base: dict, config: SparseConfig, machine: dict, rows: list[dict]) -> None:
    for i, (vocab, row) in enumerate(plan, 1):
        row = dict(row, vocab=vocab)
        result = _report.run_row(
            WORKER,
            {**base, "vocab": vocab, "strategy": row["strategy"], "threads": row["threads"]},
            workers=row["workers"],
            threads=row["threads"],
            env=row.pop("env"),
            ps=_report.ps_tasks(row["strategy"]),
            chief=row["strategy"] == "tfkeras-ps",
            every_task=row["row"].startswith("P-1x"),
        )
        row.update(result, machine=machine, table_bytes=vocab * config.dim * 4)
        speed = f"{row['examples_per_s']:,.0f} ex/s" if "examples_per_s" in row else row["error"]
        logger.info(
            "[%d/%d] %s %s, %s rows: %s",
            i,
            len(plan),
            row["row"],
            row["label"],
            f"{vocab:,}",
            speed,
        )
        rows.append(row)


def _finish(rows: list[dict], config: SparseConfig) -> None:
    for vocab in vocabs(config):  # ratios within one table size
        group = [r for r in rows if r["vocab"] == vocab]
        one = next((r.get("examples_per_s") for r in group if r["row"] == "P-1"), None)
        for r in group:
            x = r.get("examples_per_s")
            r["vs_P1"] = x / one if one and x else None
            _report.against_limit(r, group)
            if x and one and r["row"] != "P-all":
                r["efficiency_P1"] = x / (r["workers"] * one)
    _report.write(config.out, "sparse", rows, table(rows, config), _plot)


def table(rows, c: SparseConfig) -> str:
    headers = [
        "row",
        "strategy",
        "table rows",
        "workers",
        "examples/s (min-max)",
        "vs P-1",
        "efficiency vs P-1",
        "vs limit",
        "bytes sent/step/worker",
        "% of table",
        "final loss",
        "peak RSS MB",
        "ps peak RSS MB",
    ]
    body = []
    for r in rows:
        if "error" in r:
            body.append(
                [r["row"], r["label"], f"{r['vocab']:,}", r["workers"]]
                + [f"failed: {r['error'][:120]}"]
                + ["-"] * 8
            )
            continue
        sent = r.get("bytes_sent_per_step")
        ps_rss = r.get("ps_peak_rss_mb")
        body.append(
            [
                r["row"],
                r["label"],
                f"{r['vocab']:,}",
                r["workers"],
                f"{r['examples_per_s']:,.0f} ({r['examples_per_s_min']:,.0f}-{r['examples_per_s_max']:,.0f})",
                f"{r['vs_P1']:.2f}" if r["vs_P1"] is not None else "-",
                f"{r['efficiency_P1']:.0%}" if r.get("efficiency_P1") else "-",
                f"{r['vs_limit']:.0%}" if r.get("vs_limit") else "-",
                f"{sent:,.0f}" if sent is not None else "not measured",
                f"{100 * sent / r['table_bytes']:.2f}%" if sent is not None else "-",
                f"{r['final_loss']:.4f}",
                f"{r['peak_rss_mb']:,.0f}",
                f"{ps_rss:,.0f}" if ps_rss is not None else "-",
            ]
        )
    m = rows[0]["machine"] if rows else {}
    sizes = " and ".join(f"{v:,}" for v in vocabs(c))
    mib = " and ".join(f"{v * c.dim * 4 / 2**20:.0f}" for v in vocabs(c))
    return _report.markdown(headers, body) + (
        f"\n\nEmbedding {sizes} x {c.dim} (float32, {mib} MiB), "
        f"{c.seq} Zipf-distributed ids per example, Conv1D x2 + dense head, Adagrad, "
        f"{c.batch_per_device} examples per worker per step; median of {c.repeats} timed "
        f"epochs of {c.steps} steps after a warm-up epoch. Bytes sent: what tfstrat hands "
        "its collectives per step: measured, what worker 0's TCP ring sent per timed step "
        "(headers included; its sparse rows deduplicated, so fewer than the batch's ids), else "
        "ring arithmetic (2(n-1)/n x S for an all-reduce of S bytes, (n-1) x S for an "
        "all-gather); for ParameterServer and Hybrid rows, plus the bytes worker "
        "0's sockets to the ps carried per step, both directions (for ParameterServer, the dense "
        "head's weights and gradients too). Keras 3 rows use tfstrat.keras.layers.Embedding "
        "(H-Wk: keras.layers.Embedding, held on the ps all the same). "
        f"Threads: {rows[0]['threads'] if rows else '?'} in each of TensorFlow's pools per process (row P-all: "
        f"{m.get('cpus')}). Machine: {m.get('cpu')}, {m.get('cpus')} CPUs, TensorFlow "
        f"{m.get('tensorflow')}, Keras {m.get('keras')}. Efficiency vs P-1 = ex/s / "
        "(workers x ex/s(P-1)); vs limit = ex/s / ex/s(P-1xW), W independent P-1 processes run "
        "at once on the same machine (their examples/s summed): what W workers could reach "
        'if they paid nothing for working together. Rows ending in t ("tuned") run the stock row again with the '
        "CPU allocator tfstrat gives its own tasks (TF_CPU_ALLOCATOR_USE_BFC=true). Peak RSS: "
        "worker 0's; ps peak RSS: the Hybrid table server's process (the largest ps task)."
    )


def _plot(ax, rows):
    ok = [r for r in rows if "examples_per_s" in r]
    ax.barh(
        range(len(ok)),
        [r["examples_per_s"] for r in ok],
        color=[_report.color(r) for r in ok],
    )
    ax.set_yticks(
        range(len(ok)),
        [f"{r['row']} {r['label']} (x{r['workers']}, {r['vocab']:,} rows)" for r in ok],
    )
    ax.invert_yaxis()
    ax.set_xlabel("examples/s (median)")
    ax.set_title("tfstrat bench sparse (blue: tfstrat, green: the limit)")
