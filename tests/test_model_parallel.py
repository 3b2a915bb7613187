"""ModelParallel against single-device training, on logical CPU devices.

Each case runs in a fresh interpreter (the CPU is split before TensorFlow's runtime starts):
`workers/model_parallel_equiv.py` trains a model on one device and under ModelParallel on each
mesh, from the same weights on the same global batches. The default run covers every mesh with
the MLP with Adam on (1, 2) and (2, 2), the MLP on 2 workers of 1 device and the Transformer
block on 2 workers of 2 devices; `-m matrix` runs every model on every mesh with both optimizers, and on workers.
"""

import importlib.metadata
import json
import subprocess
import sys

import pytest
from paths import WORKERS

from tfstrat._compat import versions

TOLERANCE = 1e-5
MESHES = "1x2,2x1,2x2"
# 44 or 28 rows, batches of 8, 2 epochs
STEPS = {"mlp": 12, "transformer": 8, "llama": 8, "gemma": 8, "qwen": 8}


@pytest.fixture
def matrix_only(request):
    """The full matrix runs when `-m` names it (`scripts/test -m matrix`), not by default."""
    if "matrix" not in (request.config.getoption("markexpr") or ""):
        pytest.skip(
            "part of the full ModelParallel matrix (about 6.5 minutes, kept out of the default "
            "run's time budget; the default run covers each code path on a smaller set): run "
            "it with `scripts/test -m matrix`"
        )


def _run(tmp_path, *args, timeout=420):
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "model_parallel_equiv.py", *args[:3], str(out), *args[3:]],
        cwd=WORKERS,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stderr


def _check(result, meshes, optimizers, steps, devices_here=None, fsdp=False):
    cases = result["cases"]
    assert [(c["mesh"], c["optimizer"]) for c in cases] == [
        (m, o) for o in optimizers.split(",") for m in meshes.split(",")
    ]
    for case in cases:
        name = (case["mesh"], case["optimizer"])
        assert case["initial"] == 0.0, name  # the same draw as on one device
        assert case["weights"] <= TOLERANCE, (name, case["weights"])
        assert case["slots"] <= TOLERANCE, (name, case["slots"])
        assert case["iterations"] == steps, name
        # predict: against one device holding the same weights (the forward pass alone)
        assert case["predict"] <= TOLERANCE, (name, case["predict"])
        assert case["evaluate"] <= TOLERANCE, (name, case["evaluate"])
        batch_axis, model_axis = (int(n) for n in case["mesh"].split("x"))
        _check_held(name, case["held"], case["planned"], devices_here or batch_axis * model_axis)
        if model_axis == 1 and not fsdp:
            assert case["held"] == [], name  # nothing to split
            continue
        assert case["held"], name
        slots = [p for p, *_ in case["held"] if p.split("/")[0].startswith(("sgd", "adam"))]
        assert slots, (name, "the optimizer's slots are split too")
        if fsdp and batch_axis > 1:
            assert any(s[1] == batch_axis for p, *_, s in case["held"] if p in slots), name


def _check_held(name, held, planned, devices):
    """Every variable and slot the layout map splits (`planned`, read from the map, not from
    what got split) is held as the map says, and nothing else is split: each of `devices`
    holds 1/(model parts x batch parts) of it, and each device's bytes of the split variables
    add up to the plan's."""
    got = {path: (whole, parts, ways) for path, whole, parts, ways in held}
    want = {path: (whole, ways) for path, whole, ways in planned}
    assert sorted(got) == sorted(want), (
        name,
        "split but not planned",
        sorted(set(got) - set(want)),
        "planned but not split",
        sorted(set(want) - set(got)),
    )
    per_device, planned_per_device = {}, 0
    for path, (whole, ways) in want.items():
        held_whole, parts, held_ways = got[path]
        assert (held_whole, held_ways) == (whole, ways), (name, path, held_ways, ways)
        assert len(parts) == devices, (name, path, parts)
        assert len({device for device, _ in parts}) == devices, (name, path, parts)
        assert {size for _, size in parts} == {whole // (ways[0] * ways[1])}, (name, path, parts)
        for device, size in parts:
            per_device[device] = per_device.get(device, 0) + size
        planned_per_device += whole // (ways[0] * ways[1])
    assert set(per_device.values()) <= {planned_per_device}, (name, per_device, planned_per_device)


@pytest.mark.timeout(600)
def test_mlp_on_1x2_and_2x2_with_checkpoints(tmp_path):
    """Column- then row-parallel Dense: meshes (1, 2) and (2, 2), Adam with global_clipnorm
    (the norm over all parts); model.save loads into plain Keras and back, and
    BackupAndRestore resumes exactly (from TensorFlow 2.22 within 1e-6: below). ((2, 1) and SGD
    with momentum: the matrix.)"""
    result, err = _run(tmp_path, "mlp", "1x2,2x2", "adam-clip", "--checkpoints")
    _check(result, "1x2,2x2", "adam-clip", steps=STEPS["mlp"])
    for key in ("saved_to_plain", "saved_slots_to_plain", "plain_to_sharded"):
        assert result[key] == 0.0, key
    assert result["plain_to_sharded_slots"] == 0.0
    assert result["loaded_held"], "a plain Keras file loads into split variables"
    _check_held("loaded", result["loaded_held"], result["loaded_planned"], 2)
    # Bit for bit through TensorFlow 2.21. A resumed run traces its step anew; from 2.22 Grappler
    # (the meta-optimizer) rewrites the new trace, structurally the same graph, into one that
    # sums in another order wherever the model axis is split: 3e-8 to 6e-8 off on 2.22.0rc0
    # (exact with the meta-optimizer off, and on the (2, 1) mesh), the same every run.
    tensorflow = versions._minor(importlib.metadata.version("tensorflow"))  # not importing it
    resume = 0.0 if tensorflow < (2, 22) else 1e-6
    assert result["resumed"] <= resume and result["resumed_slots"] <= resume, result["resumed"]
    # It resumed: it trained epoch 1 only (a restart from scratch ends at the same weights).
    assert result["resumed_epochs"] == [1], result["resumed_epochs"]
    assert "up (Dense): kernel (12, 16) split on dimension 1, bias (16,) split" in err
    # Logical CPUs: the model group's sums are device copies, no NCCL op in the step.
    assert "model axis 'model' (its sums: device copies)" in err, err[-3000:]
    assert all(c["graph"]["nccl_all_reduce"] == 0 for c in result["cases"]), result["cases"]
    assert "column-parallel" in err and "down (Dense): kernel (16, 12) split on dimension 0" in err


@pytest.mark.timeout(600)
def test_fsdp_shards_weights_over_the_batch_axis_too(tmp_path):
    """The Transformer block with every weight sharded over the batch axis too (FSDP:
    all-gathered for each use, gradients reduce-scattered), alone on (2, 1) and (4, 1) and with
    the model axis on (2, 2): each device holds 1/(B x M) of each weight and of Adam's slots,
    training equals one device (global_clipnorm: the norm over every block; an L2 penalty on
    a sharded kernel), and model.save / BackupAndRestore write and read whole weights."""
    result, err = _run(tmp_path, "transformer-fsdp", "2x2,2x1,4x1", "adam-clip", "--checkpoints")
    _check(result, "2x2,2x1,4x1", "adam-clip", steps=STEPS["transformer"], fsdp=True)
    for key in ("saved_to_plain", "saved_slots_to_plain", "plain_to_sharded"):
        assert result[key] == 0.0, key
    assert result["plain_to_sharded_slots"] == 0.0
    _check_held("loaded", result["loaded_held"], result["loaded_planned"], 4)
    assert result["resumed_epochs"] == [1], result["resumed_epochs"]
    # Not bit for bit: two uninterrupted runs of this model on one mesh differ by up to ~1e-6
    # (the Transformer under ModelParallel, with or without FSDP); the MLP's resume is exact.
    assert result["resumed"] <= TOLERANCE and result["resumed_slots"] <= TOLERANCE
    assert (
        "ff_up (Dense): kernel (16, 32) split on dimension 1 and sharded on dimension 0 over "
        "the batch axis" in err
    ), err[-3000:]
    assert (
        "tokens/embeddings: dimension 0 split over 'model', dimension 1 sharded over the "
        "batch axis 'batch' (FSDP): each device holds (24, 8)" in err
    ), err[-3000:]


@pytest.mark.matrix
@pytest.mark.usefixtures("matrix_only")
@pytest.mark.timeout(600)
def test_transformer_block_on_a_2x2_mesh(tmp_path):
    """Vocabulary-parallel Embedding, MultiHeadAttention split by heads, an MLP, a
    column-parallel logits layer, LayerNormalization whole; Adam."""
    result, err = _run(tmp_path, "transformer", "2x2", "adam")
    _check(result, "2x2", "adam", steps=STEPS["transformer"])
    assert "attention/query (EinsumDense)" in err and "vocabulary-parallel lookup" in err


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "model", ["llama", "gemma", pytest.param("qwen", marks=pytest.mark.matrix)]
)
def test_keras_hub_backbones_with_their_own_layout_maps(tmp_path, model, request):
    """keras-hub's Llama, Gemma and Qwen backbones (built from config) under their own
    get_layout_map, unchanged, on (1, 2) and (2, 2): the model-axis entries split, and on
    (2, 2) the batch-axis entries shard those weights over the batch axis too (FSDP). Gemma's
    attention reshapes by its configured head counts: it runs with the heads each device
    holds. Qwen's get_layout_map has Llama's entries (its attention adds biases): in the matrix."""
    if model == "qwen":
        request.getfixturevalue("matrix_only")
    result, err = _run(tmp_path, model, "1x2,2x2", "adam")
    if model == "gemma":
        assert "(num_query_heads 4 -> 2, num_key_value_heads 2 -> 1)" in err, err[-3000:]
    _check(result, "1x2,2x2", "adam", steps=STEPS[model], fsdp=True)
    fsdp = "dimension 1 sharded over the batch axis 'batch' (FSDP)"
    assert f"token_embedding/embeddings: dimension 0 split over 'model', {fsdp}" in err, err[-3000:]
    gate = "ffw_gating (EinsumDense)" if model == "gemma" else "feedforward_gate_dense (Dense)"
    assert gate in err and "row-parallel" in err, err[-3000:]


@pytest.mark.matrix
@pytest.mark.usefixtures("matrix_only")
@pytest.mark.timeout(900)
@pytest.mark.parametrize("model", ["mlp", "transformer", "llama", "gemma", "qwen"])
def test_every_mesh_and_optimizer(model, tmp_path):
    result, _ = _run(tmp_path, model, MESHES, "sgd,adam", timeout=840)
    _check(result, MESHES, "sgd,adam", steps=STEPS[model])


def _on_workers(tmp_path, model, optimizer, mesh="2x2"):
    from cluster import launch_script

    out = tmp_path / "result.json"
    code, output = launch_script("model_parallel_equiv.py", model, mesh, optimizer, str(out))
    assert code == 0, output[-4000:]
    results = [json.loads((tmp_path / f"result.json.{rank}").read_text()) for rank in (0, 1)]
    return results, output


def _check_workers(results, output, model, optimizer, mesh="2x2"):
    for result in results:
        _check(result, mesh, optimizer, steps=STEPS[model], devices_here=2)
    # The workers end with the same weights, bit for bit (each within 1e-5 of one device).
    for mine, theirs in zip(results[0]["cases"], results[1]["cases"], strict=True):
        assert mine["digest"] == theirs["digest"], (mine["optimizer"], "workers differ")
    shape = tuple(int(n) for n in mesh.split("x"))
    assert f"ModelParallel over a mesh {shape} (batch, model)" in output


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_two_workers_of_two_devices_each(tmp_path):
    """A (2, 2) mesh as 2 workers x 2 logical CPUs (`tfstrat launch --workers 2`): the model
    axis within each worker, the batch axis across them over tfstrat's ring."""
    results, output = _on_workers(tmp_path, "transformer", "adam")
    _check_workers(results, output, "transformer", "adam")


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_two_workers_of_one_device_each(tmp_path):
    """A (2, 1) mesh as 2 workers x 1 device: each step's sums still cross the workers (the
    data-parallel end of the mesh)."""
    results, output = _on_workers(tmp_path, "mlp", "sgd", mesh="2x1")
    _check_workers(results, output, "mlp", "sgd", mesh="2x1")


@pytest.mark.matrix
@pytest.mark.usefixtures("matrix_only")
@pytest.mark.cluster
@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", ["mlp", "transformer", "llama"])
def test_two_workers_every_model(model, tmp_path):
    results, output = _on_workers(tmp_path, model, "sgd,adam")
    _check_workers(results, output, model, "sgd,adam")


@pytest.mark.timeout(300)
def test_layouts_it_cannot_apply_are_named_before_the_first_step(tmp_path):
    """Errors that name the variable, the rule and the fix; a warning for a rule that matches
    nothing; a layer tfstrat does not split; Keras's own mesh classes and tied logits."""
    out = tmp_path / "layouts.json"
    proc = subprocess.run(
        [sys.executable, "model_parallel_layouts.py", str(out)],
        cwd=WORKERS,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert (
        r["five"][0] == "UsageError"
        and "(4, 5): its dimension 1 (5) does not divide" in r["five"][1]
    )
    assert "'tensor'" in r["unknown_axis"][1]
    assert "matches 2 layout rules" in r["two_rules"][1]
    assert "1 entries for 2 dimensions" in r["wrong_rank"][1]
    assert "puts 2 dimensions" in r["two_dims_on_model"][1]
    assert "batch_dim_name='data'" in r["unknown_batch_axis"][1]
    assert "at most one model axis" in r["three_axes"][1]
    assert r["matches_nothing"] is None  # a warning, and training goes on
    assert (
        len(r["matches_nothing_lines"]) == 1
        and "'dense_99/kernel'" in r["matches_nothing_lines"][0]
    )
    # A layer tfstrat does not split computes on its whole kernel, named, equal to one device.
    assert (
        len(r["whole_line"]) == 1
        and "does not split this layer's computation" in r["whole_line"][0]
    )
    assert r["whole_parts"] == [[3, 3, 2], [3, 3, 2]]
    assert r["whole_diff"] <= TOLERANCE
    # Keras's own DeviceMesh and LayoutMap; a tied table: the lookup and the logits by rows.
    assert len(r["tied_line"]) == 1 and "vocabulary-parallel" in r["tied_line"][0]
    assert r["tied_parts"] == [[16, 8], [16, 8]]
    assert r["tied_diff"] <= TOLERANCE
    # A model built by its first call: whole shapes, equal to one device.
    assert r["lazy_shapes"][0] == [6, 16] and r["lazy_shapes"][2] == [16, 3], r["lazy_shapes"]
    assert r["lazy_diff"] <= TOLERANCE
    assert r["rows_counted"] == [20.0, 20.0]  # each slice of the batch counted once
    assert r["two_inputs_predict"][0] == [10, 2] and r["two_inputs_predict"][1] <= TOLERANCE
    # An attention layer's step on (1, 2) moves two sums of its activations over the model
    # axis (an all-reduce of S bytes over 2 devices sends S): the output's (row-parallel) and
    # one of the input's gradient for the query, key and value projections together (three
    # without the shared copy).
    moved, size = r["attention_model_axis"]
    assert moved == 2 * size, (moved, size)


# --- how a model group sums: NCCL among GPUs, device copies elsewhere -----------------------

GPUS = ["/device:GPU:0", "/device:GPU:1"]
CPUS = ["/device:CPU:0", "/device:CPU:1"]


@pytest.mark.parametrize(
    "devices, cuda, virtual, expected",
    [
        (GPUS, True, False, "nccl"),  # GPUs NCCL can join: one all-reduce per group
        ([f"/job:worker/replica:0/task:1/device:GPU:{i}" for i in range(4)], True, False, "nccl"),
        (CPUS, True, False, "copies"),  # logical CPUs: a collective costs more than copies
        (GPUS, False, False, "copies"),  # a build without CUDA
        (GPUS, True, True, "copies"),  # virtual GPUs: NCCL refuses two ranks on one card
        (["/device:GPU:0", "/device:CPU:0"], True, False, "copies"),  # mixed
        (["/device:GPU:0"], True, False, "copies"),  # one device: nothing to sum
    ],
)
def test_model_exchange_is_nccl_exactly_where_nccl_can_run(devices, cuda, virtual, expected):
    from tfstrat.strategies.model_parallel import model_exchange

    assert model_exchange(devices, cuda, virtual) == expected


@pytest.mark.parametrize("shape", [(1, 2), (2, 2), (1, 4), (4, 1)])
@pytest.mark.parametrize("grouping", ["model", "data"])
def test_each_group_sums_once_and_each_member_gets_its_groups_result(shape, grouping):
    """`over_model_groups` calls the all-reduce once per model group (or data group: FSDP's
    reduce-scatter on GPUs), with the group's parts in order, and hands each replica its own
    group's result (what NCCL's all_sum returns: one output per input, on its device)."""
    import tfstrat
    from tfstrat.mesh.collectives import over_model_groups
    from tfstrat.mesh.layout import Mesh

    n = shape[0] * shape[1]
    devices = [f"/device:CPU:{i}" for i in range(n)]
    mesh = Mesh.of(tfstrat.DeviceMesh(shape, ["batch", "model"], devices=devices), "batch")
    group_of = mesh.model_group if grouping == "model" else mesh.data_group
    calls = []

    def all_sum(parts):
        calls.append(list(parts))
        return [("sum", tuple(parts), k) for k in range(len(parts))]

    out = over_model_groups([f"part {r}" for r in mesh.local], mesh, all_sum, group_of)
    # one per batch coordinate (the model groups), or per model coordinate (the data groups)
    assert len(calls) == shape[0 if grouping == "model" else 1]
    for r in mesh.local:
        group = group_of(r)
        assert out[mesh.position(r)] == (
            "sum",
            tuple(f"part {g}" for g in group),
            group.index(r),
        )
    if grouping == "data":
        assert all(mesh.model_index(g) == mesh.model_index(group[0]) for g in group)
        assert [mesh.data_index(g) for g in group] == list(range(shape[0]))


# --- FSDP's plan: which block each device holds, and what is refused ---------------------


def _mesh(shape, workers=None):
    import tfstrat
    from tfstrat.mesh.layout import Mesh

    devices = [f"/device:CPU:{i}" for i in range(shape[0] * shape[1])]
    return Mesh.of(tfstrat.DeviceMesh(shape, ["batch", "model"], devices=devices), "batch", workers)


def _layout(rule, axes):
    layout = {}
    layout[rule] = axes
    return layout


def test_fsdp_blocks_join_into_the_whole():
    """On (2, 2), ("batch", "model") splits the columns over the model axis and each part's
    rows over the batch axis: device (b, m) holds block (m, b), a quarter, and the blocks
    join back into the whole."""
    import numpy as np

    from tfstrat.mesh.layout import plan

    mesh = _mesh((2, 2))
    sharding, line = plan(_layout("w", ("batch", "model")), mesh, "w", (4, 6))
    assert (sharding.dim, sharding.parts, sharding.batch_dim, sharding.batch_parts) == (1, 2, 0, 2)
    assert sharding.block_shape() == (2, 3)
    assert "dimension 0 sharded over the batch axis 'batch' (FSDP)" in line
    whole = np.arange(24).reshape(4, 6)
    blocks = {(m, b): sharding.take(whole, m, b) for m in range(2) for b in range(2)}
    np.testing.assert_array_equal(blocks[(1, 0)], whole[:2, 3:])
    np.testing.assert_array_equal(sharding.assemble(blocks, lambda xs, a: np.concatenate(xs, a)),
                                  whole)  # fmt: skip
    # The batch axis alone (the model axis of size 1 splits nothing).
    alone, _ = plan(_layout("w", ("batch", "model")), _mesh((4, 1)), "w", (4, 6))
    assert (alone.dim, alone.batch_dim, alone.block_shape()) == (None, 0, (1, 6))


def test_fsdp_layouts_it_cannot_apply_are_refused_by_name():
    from tfstrat.errors import UsageError
    from tfstrat.mesh.layout import plan

    with pytest.raises(UsageError, match=r"'w' has shape \(3, 6\): its dimension 0 \(3\) does "
                       r"not divide by the axis 'batch' \(2 devices\)"):  # fmt: skip
        plan(_layout("w", ("batch", "model")), _mesh((2, 2)), "w", (3, 6))
    with pytest.raises(UsageError, match="puts 2 dimensions of 'w' on the axis 'batch'"):
        plan(_layout("w", ("batch", "batch")), _mesh((2, 2)), "w", (4, 6))
    # Across workers (each worker's two devices a model group): named, with the fix.
    names = [[f"/job:worker/replica:0/task:{w}/device:CPU:{k}" for k in range(2)] for w in (0, 1)]
    across = _mesh((2, 2), workers=(0, names))
    with pytest.raises(UsageError, match=r"rule 'dense/kernel' .* not across workers yet\. Put "
                       r"None in place of 'batch'"):  # fmt: skip
        plan(_layout("dense/kernel", ("batch", "model")), across, "dense/kernel", (4, 6))
    assert plan(_layout("dense/kernel", (None, "model")), across, "dense/kernel", (4, 6))[0]
