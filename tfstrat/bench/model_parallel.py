"""`tfstrat bench model-parallel`: how large a Transformer fits a device, and what it moves.

For a fixed budget of bytes per device (the variables and Adam's two slots; activations not
counted), each row finds the largest Transformer of this family (by its width) whose bytes fit
on every device, under data parallelism (every variable whole on each device) and under
`ModelParallel` meshes (1, 2) and (1, 4) with Megatron-LM's layout (embedding by rows,
attention by heads, MLP column then row, logits by columns). It then trains it for a few steps
on logical CPUs and reports the bytes each device holds, read from the devices' variables (the
bookkeeping must agree), and the bytes each device moves per step, counted as the steps run
(`tfstrat.mesh.collectives.Traffic`): within the model group (the layers' exchanges) and over the batch axis (the
gradients). Step times on logical CPUs of one machine share its cores: they are not a speed
measure, and the table says so.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys

from tfstrat.bench import _report

logger = logging.getLogger(__name__)
WORKER = "tfstrat.bench._mp_worker"
ROWS = [
    ("DP-2", "data parallel: ModelParallel (2, 1), every variable whole", (2, 1)),
    ("MP-1x2", "ModelParallel (1, 2)", (1, 2)),
    ("MP-1x4", "ModelParallel (1, 4)", (1, 4)),
]
SLOTS = 2  # Adam's


@dataclasses.dataclass(frozen=True)
class ModelParallelConfig:
    budget_mib: float = 8.0
    vocab: int = 2048
    seq: int = 32
    layers: int = 2
    heads: int = 8
    batch: int = 16
    steps: int = 20
    repeats: int = 3
    out: str = "bench-out"
    rows: tuple[str, ...] | None = None  # row ids to run (None: all)


def bytes_per_device(c: ModelParallelConfig, dim: int, parts: int) -> int:
    """The variables and Adam slots one device holds: the split ones' 1/parts, the rest whole."""
    v, d, layers = c.vocab, dim, c.layers
    split = v * d + layers * (4 * d * d + 3 * d + 8 * d * d + 4 * d) + d * v
    whole = layers * 6 * d + v
    return 4 * (1 + SLOTS) * (split // parts + whole)


def largest_dim(c: ModelParallelConfig, parts: int) -> int:
    """The widest model (a multiple of the heads) within the budget on `parts` devices."""
    budget, step = int(c.budget_mib * 2**20), c.heads
    dim = 0
    while bytes_per_device(c, dim + step, parts) <= budget:
        dim += step
    return dim


def run(config: ModelParallelConfig) -> list[dict]:
    machine = _report.machine()
    rows = []
    for row_id, label, mesh in ROWS:
        if config.rows is not None and row_id not in config.rows:
            continue
        parts = mesh[1]
        dim = largest_dim(config, parts)
        worker = {**dataclasses.asdict(config), "mesh": list(mesh), "dim": dim}
        for key in ("out", "budget_mib", "rows"):
            worker.pop(key)
        try:
            proc = subprocess.run(
                [sys.executable, "-m", WORKER, json.dumps(worker)],
                capture_output=True,
                text=True,
                timeout=1800,
            )
        except subprocess.TimeoutExpired:
            proc = subprocess.CompletedProcess([], 124, "", "Error: the row took over 1800 s")
        row = {
            "row": row_id,
            "strategy": label,
            "mesh": list(mesh),
            "dim": dim,
            "budget_bytes": int(config.budget_mib * 2**20),
            "bookkeeping_bytes": bytes_per_device(config, dim, parts),
            "machine": machine,
        }
        found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not found:
            errors = [line for line in proc.stderr.splitlines() if "Error" in line]
            row["error"] = (errors[-1] if errors else f"exit code {proc.returncode}")[-300:]
        else:
            row.update(json.loads(found[-1][len("RESULT ") :]))
        logger.info("model-parallel %s: %s", row_id, row.get("error", "done"))
        rows.append(row)
    _report.write(config.out, "model-parallel", rows, table(rows, config), _plot)
    return rows


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def table(rows, c: ModelParallelConfig) -> str:
    headers = [
        "row",
        "strategy",
        "width",
        "parameters",
        "MiB per device (bookkeeping)",
        "MiB per device (measured)",
        "MiB moved per step per device: model axis",
        "batch axis",
        "step s (logical CPUs: not a speed measure)",
        "final loss",
    ]
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["row"], r["strategy"], r["dim"], "-", _mib(r["bookkeeping_bytes"]),
                         f"error: {r['error']}", "-", "-", "-", "-"])  # fmt: skip
            continue
        body.append(
            [
                r["row"],
                r["strategy"],
                r["dim"],
                f"{r['params']:,}",
                _mib(r["bookkeeping_bytes"]),
                _mib(max(r["held_bytes"])),
                _mib(r["model_axis_bytes"]),
                _mib(r["batch_axis_bytes"]),
                f"{r['step_s']:.3f}",
                f"{r['loss']:.4f}",
            ]
        )
    m = rows[0]["machine"] if rows else {}
    note = (
        f"\nBudget {c.budget_mib:g} MiB per device for the variables and Adam's two slots "
        "(activations not counted). Model: token embedding, "
        f"{c.layers} x (MultiHeadAttention with {c.heads} heads, LayerNormalization, "
        f"Dense 4 x width then width, LayerNormalization), logits; vocabulary {c.vocab}, "
        f"{c.seq} tokens per sequence, batch {c.batch}; the widest that fits (a multiple of "
        "the heads). Measured MiB: the most any device holds, read from the devices' "
        "variables. Bytes moved: what one device sends per training step by ring arithmetic "
        "(an all-reduce of S bytes over n devices 2(n-1)/n x S, an all-gather (n-1)/n of the "
        "whole), counted by tfstrat as the timed steps ran: within the model group (the "
        "layers' exchanges) and over the batch axis (the gradients). Step times: median of "
        f"{c.repeats} timed epochs of {c.steps} steps, all devices logical CPUs of one "
        f"machine sharing its {m.get('cpus')} CPUs: not a speed measure. Machine: "
        f"{m.get('cpu')}, TensorFlow {m.get('tensorflow')}, Keras {m.get('keras')}."
    )
    return _report.markdown(headers, body) + "\n" + note


def _plot(ax, rows):
    ok = [r for r in rows if "error" not in r]
    names = [f"{r['row']} (width {r['dim']})" for r in ok]
    ax.barh(names, [r["params"] / 1e6 for r in ok], color="tab:blue")
    ax.set_xlabel("parameters (millions) within the same bytes per device")
    ax.invert_yaxis()
    ax.set_title("tfstrat bench model-parallel")
