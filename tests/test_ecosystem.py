"""Other people's Keras code under every strategy: keras-hub and keras-rs models built from
config, a keras-hub tokenizer in tf.data, raw strings, keras.io's convolutional classifier on
batches smaller than the replicas, XLA, save -> load -> resume (`keras_patterns/ecosystem.py`).

Each strategy runs every pattern in one process (MirroredNCCL on 2 logical CPUs) or one
2-worker cluster started by `tfstrat launch`; every task's weights and logs must be within
1e-5 of one device's. The reference is one device with dense gradients (`none-dense`): Keras
3's own sparse Adam squares each repeat of an embedding row separately, which no run of
several replicas can reproduce, and tfstrat sums the repeats first (README, "Sparse
gradients"); for SGD the two references are the same. LocalSGD(sync_every=1) runs the
patterns that train with plain SGD, for which it equals one device.

TensorFlow's oneDNN kernels are off here (`TF_ENABLE_ONEDNN_OPTS=0`, reference included), so
that the tier does the same on every CPU; `test_empty_replica_under_onednn` turns them on,
where a Conv2D of 0 rows has the wrong shape (the case a replica with no rows must skip).
"""

import concurrent.futures
import json
import math
import os

import pytest
from cluster import in_background
from compare import TOLERANCE, compare, load
from ecosystem import PATTERNS, PLAIN_SGD
from table import run_strategy

pytestmark = [pytest.mark.ecosystem, pytest.mark.cluster, pytest.mark.slow]

REFERENCE = "none-dense"
ALL = list(PATTERNS)
# keras.io's own BatchNormalization keeps statistics per replica (by design, README): it must
# train, evaluate and predict every row, not equal one device.
RUNS_ONLY = ("conv_keras_io_small_last_batch",)
ONEDNN_OFF = {"TF_ENABLE_ONEDNN_OPTS": "0"}


_references: dict = {}


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    """The reference's directory; the reference (every pattern on one device) runs in the
    background until a check needs it (`_check`)."""
    out = str(tmp_path_factory.mktemp("ecosystem"))
    _references[out] = in_background(_run, out, REFERENCE, ALL)
    yield out
    concurrent.futures.wait([_references.pop(out)])


def _check(out: str, kind: str, patterns: list[str], reference: str = REFERENCE) -> None:
    if out in _references and reference == REFERENCE:
        _references[out].result()
    failures = []
    # Every task reported: one process under MirroredNCCL, both workers elsewhere.
    tasks = ["main"] if kind == "mirrored" else ["worker0", "worker1"]
    for pattern in patterns:
        if pattern in RUNS_ONLY:
            failures += _ran(out, pattern, kind)
            continue
        result = compare(out, pattern, kind, reference=reference)
        if result["cell"] != "exact":
            failures.append(f"{pattern}: {result['cell']}")
        elif result["tasks"] != tasks:
            failures.append(f"{pattern}: results from {result['tasks']}, expected {tasks}")
    for task, run in load(out, "hub_save_resume", kind).items():
        if isinstance(run, dict):  # a worker's own file, loaded back, is what it saved
            assert float(run["m:own_file/max_difference"]) == 0.0, (task, kind)
    log = os.path.join(out, f"{kind}.log")
    assert not failures, (failures, log)


def _ran(out: str, pattern: str, kind: str) -> list[str]:
    runs = load(out, pattern, kind)
    if not runs:
        return [f"{pattern}: no result"]
    problems = []
    for task, run in runs.items():
        if isinstance(run, str):
            problems.append(f"{pattern} on {task}: {run}")
        elif int(run["m:predict/rows"]) != 17 or not all(
            math.isfinite(float(v)) for k, v in run.items() if k.startswith("m:")
        ):
            problems.append(f"{pattern} on {task}: {int(run['m:predict/rows'])} rows predicted")
    return problems


def _run(out: str, kind: str, patterns: list[str]) -> None:
    with open(os.path.join(out, f"{kind}.log"), "w") as log:
        run_strategy(kind, patterns, out, log, env=ONEDNN_OFF)


# Hybrid runs them with ps tasks below (the library tables on the ps). Without ps tasks it is
# CollectiveAllReduce with every table mirrored: `scripts/patterns` runs that row.
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["mirrored", "collective"])
def test_every_pattern_equals_one_device(out, kind):
    """MirroredNCCL (2 logical CPUs) and CollectiveAllReduce (2 workers)."""
    _run(out, kind, ALL)
    _check(out, kind, ALL)


@pytest.mark.timeout(600)
def test_localsgd_sync_every_step_with_plain_sgd(out):
    _run(out, "localsgd", list(PLAIN_SGD))
    _check(out, "localsgd", list(PLAIN_SGD))


@pytest.mark.timeout(600)
def test_empty_replica_under_onednn(tmp_path):
    """With oneDNN's kernels on, keras.io's classifier trains under MirroredNCCL where a
    replica gets no rows (it failed in BatchNormalization: "Incompatible shapes"), and the
    LayerNormalization variant equals one device."""
    patterns = ["conv_layernorm_small_last_batch", "conv_keras_io_small_last_batch"]
    out, on = str(tmp_path), {"TF_ENABLE_ONEDNN_OPTS": "1"}
    for kind in (REFERENCE, "mirrored"):
        with open(os.path.join(out, f"{kind}.log"), "w") as log:
            run_strategy(kind, patterns, out, log, env=on)
    result = compare(out, patterns[0], "mirrored", reference=REFERENCE)
    assert result["cell"] == "exact", result["cell"]
    assert not _ran(out, patterns[1], "mirrored")
    assert result["weights"] <= TOLERANCE


def _placement(out: str, pattern: str, task: str) -> dict:
    with open(os.path.join(out, pattern, f"hybrid.{task}.placement.json")) as f:
        return json.load(f)


@pytest.mark.timeout(900)
def test_hybrid_holds_library_tables_on_the_ps_by_their_gradient(tmp_path):
    """Hybrid with 1 ps (2 workers) on code nobody here wrote: keras-hub's BERT classifier
    (AdamW whose decay reaches the tables, as keras-hub's recipe), keras.io's keras-rs ranking
    model (three keras.layers.Embedding tables), keras-rs's DistributedEmbedding (Adam) and
    keras-hub's GPT-2 (its token table tied to the logits), and `jit_compile=True` over a
    ps-held table (run without XLA: the lookups call the ps). Every table with a sparse gradient lives on the ps and no worker holds a copy;
    GPT-2's tied table comes back mirrored and says why. Each equals one device whose tables
    take the ps's update rule (`none-lazy`: lazy Adam, Keras's weight decay of every row)."""
    patterns = ["hub_bert", "rs_ranking", "rs_distributed_embedding", "hub_gpt2", "jit_compiled"]
    out = str(tmp_path)
    reference = in_background(_run, out, "none-lazy", patterns)  # the two runs at once
    _run(out, "hybrid", patterns)
    reference.result()
    _check(out, "hybrid", patterns, reference="none-lazy")

    # BERT: token, segment; keras-rs's DistributedEmbedding: its two EmbedReduce tables.
    for pattern, count in (("hub_bert", 2), ("rs_ranking", 3), ("rs_distributed_embedding", 2)):
        for task in ("worker0", "worker1"):
            placed = _placement(out, pattern, task)
            tables = {k: v for k, v in placed.items() if k not in ("variables", "mirrored_why")}
            assert len(tables) == count, (pattern, tables)
            for path, devices in tables.items():
                assert devices and set(devices) == {"/job:ps/replica:0/task:0/device:CPU:0"}, (
                    pattern,
                    path,
                    devices,
                )
                assert path not in placed["variables"], (pattern, task, path)  # no worker copy
            held = [p for p in placed["variables"] if p.endswith("/embeddings")]
            assert all("position_embedding" in p for p in held), (pattern, task, held)
    # BERT's position table is a PositionEmbedding (sliced, a dense gradient): mirrored.
    assert any(
        "position_embedding" in p for p in _placement(out, "hub_bert", "worker0")["variables"]
    )

    gpt2 = _placement(out, "hub_gpt2", "worker0")
    token = [k for k in gpt2 if k.endswith("token_embedding/embeddings")]
    assert len(token) == 1 and gpt2[token[0]] == [], gpt2  # tied: mirrored
    assert any(p.endswith("token_embedding/embeddings") for p in gpt2["variables"]), gpt2
    why = [w for p, w in gpt2["mirrored_why"].items() if p.endswith("token_embedding/embeddings")]
    assert why and "read whole outside its lookup" in why[0], gpt2["mirrored_why"]
    with open(os.path.join(out, "hybrid.log")) as f:
        log = f.read()
    assert "ReversibleEmbedding): mirrored on every worker (the table is also read whole" in log
