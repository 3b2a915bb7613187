"""`tfstrat bench model-parallel`: how large a Transformer fits a device, what it moves, and
what the split costs in speed.

For a fixed budget of bytes per device (the variables and Adam's two slots; activations not
counted), each row finds the largest Transformer of this family (by its width) whose bytes fit
on every device, under data parallelism (every variable whole on each device), under
`ModelParallel` meshes (1, 2) and (1, 4) with Megatron-LM's layout (embedding by rows,
attention by heads, MLP column then row, logits by columns), and with FSDP (every kernel and
the table sharded over the batch axis too) on (2, 1), (4, 1) and (2, 2). It then trains it for a few steps
on logical CPUs and reports the bytes each device holds, read from the devices' variables (the
bookkeeping must agree), and the bytes each device moves per step, counted as the steps run
(`tfstrat.mesh.collectives.Traffic`): within the model group (the layers' exchanges) and over
the batch axis (the gradients).

The speed rows (`_mp_speed`, S-*) train one Transformer block (the size of keras.io's
examples) for a few epochs, each row in its own process, one after another: on one device, and
split over a (1, 2) mesh of two logical CPUs of the same cores. Two logical devices of the same
cores cannot compute faster than one device, so what the split costs a user is the ratio of its
examples/s to the one device's: measured against the same ratio for Keras's own
`keras.distribution.ModelParallel` on JAX (rows added when `jax` is installed, e.g. with the
`bench` extra). The memory rows' step times share the machine's cores the same way; their ratios to the
one-device row are not measured here (the S-* rows are the speed measure).
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
# (id, label, mesh, FSDP: the weights sharded over the batch axis too)
ROWS = [
    ("DP-2", "data parallel: ModelParallel (2, 1), every variable whole", (2, 1), False),
    ("MP-1x2", "ModelParallel (1, 2)", (1, 2), False),
    ("MP-1x4", "ModelParallel (1, 4)", (1, 4), False),
    ("FSDP-2x1", "FSDP: ModelParallel (2, 1), weights sharded over the batch axis", (2, 1), True),
    ("FSDP-4x1", "FSDP: ModelParallel (4, 1), weights sharded over the batch axis", (4, 1), True),
    ("FSDP-2x2", "ModelParallel (2, 2) with FSDP over the batch axis", (2, 2), True),
]
SLOTS = 2  # Adam's
# (id, label, backend, mesh or None): the speed rows, each ratio to its backend's first row.
SPEED_ROWS = [
    ("S-TF-1", "TensorFlow, one device, no strategy", "tensorflow", None),
    ("S-TF-MP-1x2", "tfstrat.ModelParallel (1, 2)", "tensorflow", (1, 2)),
    ("S-JAX-1", "JAX, one device", "jax", None),
    ("S-JAX-MP-1x2", "keras.distribution.ModelParallel (1, 2), JAX", "jax", (1, 2)),
]
SPEED_MODEL = dict(vocab=2048, dim=256, heads=8, seq=64, rows=2048, batch=64, epochs=5)
SPEED_QUICK = dict(vocab=256, dim=32, heads=4, seq=8, rows=128, batch=32, epochs=2)


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
    speed: tuple[tuple[str, int], ...] = tuple(SPEED_MODEL.items())  # the speed rows' block


def bytes_per_device(c: ModelParallelConfig, dim: int, mesh, fsdp: bool = False) -> int:
    """The variables and Adam slots one device holds on `mesh` (batch, model): the split
    kernels' 1/model (with FSDP, 1/(batch x model)), the split biases' 1/model, the rest
    whole."""
    v, d, layers = c.vocab, dim, c.layers
    batch, model = mesh
    kernels = v * d + layers * (4 * d * d + 8 * d * d) + d * v
    biases = layers * (3 * d + 4 * d)
    whole = layers * 6 * d + v
    return 4 * (1 + SLOTS) * (kernels // (model * (batch if fsdp else 1)) + biases // model + whole)


def largest_dim(c: ModelParallelConfig, mesh, fsdp: bool = False) -> int:
    """The widest model (a multiple of the heads, so of the mesh's axes) within the budget."""
    budget, step = int(c.budget_mib * 2**20), c.heads
    dim = 0
    while bytes_per_device(c, dim + step, mesh, fsdp) <= budget:
        dim += step
    return dim


def run(config: ModelParallelConfig) -> list[dict]:
    machine = _report.machine()
    rows = []
    for row_id, label, mesh, fsdp in ROWS:
        if config.rows is not None and row_id not in config.rows:
            continue
        dim = largest_dim(config, mesh, fsdp)
        worker = {**dataclasses.asdict(config), "mesh": list(mesh), "dim": dim, "fsdp": fsdp}
        for key in ("out", "budget_mib", "rows"):
            worker.pop(key)
        row = {
            "row": row_id,
            "strategy": label,
            "mesh": list(mesh),
            "dim": dim,
            "budget_bytes": int(config.budget_mib * 2**20),
            "bookkeeping_bytes": bytes_per_device(config, dim, mesh, fsdp),
            "machine": machine,
        }
        rows.append(_measure(row, WORKER, worker))
    rows += speed_rows(config, machine)
    _report.write(config.out, "model-parallel", rows, table(rows, config), _plot)
    return rows


def _measure(row: dict, module: str, worker: dict) -> dict:
    """`row` with what `python -m module WORKER-JSON` printed on its RESULT line, or "error"."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", module, json.dumps(worker)],
            capture_output=True,
            text=True,
            timeout=1800,
        )
    except subprocess.TimeoutExpired:
        proc = subprocess.CompletedProcess([], 124, "", "Error: the row took over 1800 s")
    found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not found:
        errors = [line for line in proc.stderr.splitlines() if "Error" in line]
        row["error"] = (errors[-1] if errors else f"exit code {proc.returncode}")[-300:]
    else:
        row.update(json.loads(found[-1][len("RESULT ") :]))
    logger.info("model-parallel %s: %s", row["row"], row.get("error", "done"))
    return row


def _has_jax() -> bool:
    import importlib.util

    return importlib.util.find_spec("jax") is not None


def speed_rows(config: ModelParallelConfig, machine: dict) -> list[dict]:
    """The S-* rows: examples/s of epochs 2.. of `_mp_speed`, each row in its own process, and
    each row's ratio to its backend's one-device row."""
    rows: list[dict] = []
    for row_id, label, backend, mesh in SPEED_ROWS:
        if config.rows is not None and row_id not in config.rows:
            continue
        row = {"row": row_id, "kind": "speed", "strategy": label, "backend": backend,
               "mesh": list(mesh) if mesh else None, "machine": machine}  # fmt: skip
        if backend == "jax" and not _has_jax():
            row["error"] = "jax is not installed: pip install 'tfstrat[bench]'"
            rows.append(row)
            continue
        worker = {**dict(config.speed), "backend": backend, "mesh": row["mesh"]}
        rows.append(_measure(row, "tfstrat.bench._mp_speed", worker))
    base = {r["backend"]: r for r in rows if r["mesh"] is None and "error" not in r}
    for r in rows:
        one = base.get(r["backend"])
        if "error" not in r and one is not None:
            r["ratio"] = r["examples_per_s"] / one["examples_per_s"]
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
        "step s (logical CPUs sharing the cores)",
        "final loss",
    ]
    speed = [r for r in rows if r.get("kind") == "speed"]
    rows = [r for r in rows if r.get("kind") != "speed"]
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
        "the heads). FSDP rows: every kernel and the table also "
        "sharded over the batch axis (all-gathered for each use, their gradients "
        "reduce-scattered; counted as batch-axis bytes). Measured MiB: the most any device holds, read from the devices' "
        "variables. Bytes moved: what one device sends per training step by ring arithmetic "
        "(an all-reduce of S bytes over n devices 2(n-1)/n x S, an all-gather (n-1)/n of the "
        "whole), counted by tfstrat as the timed steps ran: within the model group (the "
        "layers' exchanges) and over the batch axis (the gradients). Step times: median of "
        f"{c.repeats} timed epochs of {c.steps} steps, all devices logical CPUs of one "
        f"machine sharing its {m.get('cpus')} CPUs (the speed rows below measure the "
        f"split's cost). Machine: {m.get('cpu')}, TensorFlow {m.get('tensorflow')}, Keras "
        f"{m.get('keras')}."
    )
    text = (_report.markdown(headers, body) + "\n" + note) if rows else ""
    return text + (("\n\n" if text else "") + speed_table(speed, c) if speed else "")


def speed_table(rows, c: ModelParallelConfig) -> str:
    headers = ["row", "run", "examples/s (epochs 2..)", "vs its backend on one device",
               "epoch s", "final loss", "Keras"]  # fmt: skip
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["row"], r["strategy"], f"error: {r['error']}", "-", "-", "-", "-"])
            continue
        body.append(
            [
                r["row"],
                r["strategy"],
                f"{r['examples_per_s']:.0f}",
                f"{r['ratio']:.2f}" if "ratio" in r else "-",
                ", ".join(f"{t:.2f}" for t in r["epoch_s"]),
                f"{r['loss']:.4f}",
                r.get("backend_version", "-"),
            ]
        )
    s, m = dict(c.speed), (rows[0]["machine"] if rows else {})
    note = (
        "\nThe split's cost: one Transformer block (Embedding "
        f"{s['vocab']} x {s['dim']}, MultiHeadAttention {s['heads']} x "
        f"{s['dim'] // s['heads']}, Dense {s['dim']} -> {4 * s['dim']} -> {s['dim']}, "
        f"LayerNormalization; Adam; {s['rows']} sequences of {s['seq']} tokens in batches of "
        f"{s['batch']}, {s['epochs']} epochs), each row in its own process, one after another. "
        "Mesh (1, 2): two logical CPUs of the same cores, so a ratio below 1.00 is what "
        "splitting the model costs. Layout (Megatron-LM's): embedding (None, 'model'), "
        "query/key/value (None, 'model', None), attention output ('model', None, None), "
        "up (None, 'model'), down ('model', None). TensorFlow without XLA, default thread "
        "pools; JAX compiles with XLA. examples/s from the epochs after the first. Machine: "
        f"{m.get('cpu')} ({m.get('cpus')} CPUs), TensorFlow {m.get('tensorflow')}."
    )
    return _report.markdown(headers, body) + "\n" + note


def _plot(ax, rows):
    ok = [r for r in rows if "error" not in r and r.get("kind") != "speed"]
    names = [f"{r['row']} (width {r['dim']})" for r in ok]
    ax.barh(names, [r["params"] / 1e6 for r in ok], color="tab:blue")
    ax.set_xlabel("parameters (millions) within the same bytes per device")
    ax.invert_yaxis()
    ax.set_title("tfstrat bench model-parallel")
