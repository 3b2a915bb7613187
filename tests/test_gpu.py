"""The GPU tier: MirroredNCCL over NCCL, CollectiveAllReduce with one GPU per worker over NCCL,
Hybrid and ParameterServer computing on the workers' GPUs, ModelParallel's model-axis sums over
NCCL, and mixed precision with a forced overflow, against single-device training. Marked `gpu`; skipped with the reason on machines
with fewer than two GPUs, run wherever TensorFlow lists two or more (`scripts/test -m gpu`).
Not yet run on a machine with GPUs."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from cluster import launch_script
from common import check_collective_equiv, check_mixed_precision, relative_errors
from gpus import requires_gpus
from paths import WORKERS
from soak import check

pytestmark = [*requires_gpus(2), pytest.mark.timeout(600)]

TOLERANCE = 1e-5
# float32 everywhere: TF32 matmuls (Ampere and later) differ from one device by ~1e-3. Memory
# growth stays off, as users run (each process reserves most of its cards' memory: two on one
# card fail here, not in production), and NCCL says what it initialised.
FP32 = {"NVIDIA_TF32_OVERRIDE": "0", "NCCL_DEBUG": "INFO"}


def nccl_ranks(out: str) -> int:
    """How many NCCL ranks said they initialised (`NCCL_DEBUG=INFO`'s "Init COMPLETE" lines):
    what ran, not what tfstrat asked for (TensorFlow falls back to its ring without a word
    when NCCL is not registered)."""
    return sum(1 for line in out.splitlines() if "NCCL INFO" in line and "Init COMPLETE" in line)


MESH_GPUS = {"TFSTRAT_TEST_MESH_DEVICES": "gpu"}  # the workers' meshes of GPUs


def _run(*args, env=None) -> str:
    """`python ARGS...` in tests/workers, float32 on the GPUs (and `env`); its output (stdout,
    then stderr: NCCL writes its log to stdout, TensorFlow to stderr)."""
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=WORKERS,
        capture_output=True,
        text=True,
        timeout=500,
        env={**os.environ, **FP32, **(env or {})},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_mirrored_nccl_over_every_gpu_equals_single_device(tmp_path):
    out = tmp_path / "result.json"
    ran = _run("mirrored_equiv.py", "gpu", "auto", str(out))
    assert nccl_ranks(ran) >= 2, ran[-3000:]  # NCCL's own log: what ran
    result = json.loads(out.read_text())
    n = result["replicas"]
    assert n >= 2 and result["transport"] == "nccl", result  # "auto" chose NCCL
    for name in ("sgdm", "adam"):
        assert max(result[name]) <= TOLERANCE, (name, result[name])
        assert result[f"{name}_iterations"] == 24
        assert result[f"{name}_predict_rows"] == 8 * n * 24
        assert result[f"{name}_replica_copies"] == n  # every GPU's copy, as on one device
        assert max(result[f"{name}_replicas"]) <= TOLERANCE, (name, result[f"{name}_replicas"])
        assert max(result[f"{name}_evaluate"] + result[f"{name}_predict"]) <= TOLERANCE, result


@pytest.mark.parametrize(
    "per_worker", [1, pytest.param(2, marks=requires_gpus(4), id="2x2")], ids=["1", "2x2"]
)
def test_collective_all_reduce_over_nccl_equals_single_device(tmp_path, per_worker):
    """Two workers, each given its own GPUs by `tfstrat launch` (one each, or two each where 4
    exist), NCCL chosen by "auto" and seen initialising in NCCL's own log, against the
    reference run of the same program on one device: every worker's weights after SGD+momentum,
    Adam and a tf.data run with steps_per_execution=3, its evaluate, predict and val_loss."""
    gpus = [str(i) for i in range(2 * per_worker)]
    code, out = launch_script("collective_equiv.py", str(tmp_path), workers=2, env=FP32, gpus=gpus)
    assert code == 0, out[-6000:]
    cards = ", ".join(
        f"worker:{w} GPU " + ",".join(gpus[w * per_worker : (w + 1) * per_worker]) for w in range(2)
    )
    assert f"tfstrat launch: GPUs (CUDA_VISIBLE_DEVICES): {cards}" in out, out[-3000:]
    assert nccl_ranks(out) >= 2 * per_worker, out[-6000:]  # every GPU a rank of a communicator
    for i in range(2):  # read from the traced step: NCCL collectives, no gradient op on a CPU
        graph = json.loads(str(np.load(tmp_path / f"worker_{i}.npz")["sgdm/graph"]))
        assert graph["hints"].get("nccl", 0) > 0, graph
        assert graph["gradient_devices"], graph
        assert not any("CPU" in d for d in graph["gradient_devices"]), graph
    _run("collective_equiv.py", str(tmp_path), "--reference")
    ref = np.load(tmp_path / "reference.npz")
    results = [np.load(tmp_path / f"worker_{i}.npz") for i in range(2)]
    check_collective_equiv(results, ref, TOLERANCE)


@pytest.mark.parametrize("script", ["hybrid_equiv.py", "ps_equiv.py"])
def test_ps_strategies_compute_on_the_workers_gpus(tmp_path, script):
    """Hybrid (dense all-reduced, tables on the ps) and ParameterServer sync with 2 workers of
    one GPU each and 1 ps, against one device: the chief's files loaded into the stock model."""
    _run(script, str(tmp_path), "--reference")
    args = [str(tmp_path)] + (["--partitions=2"] if script == "hybrid_equiv.py" else [])
    code, out = launch_script(script, *args, workers=2, ps=1, env=FP32)
    assert code == 0, out[-6000:]
    names = ("sgd", "adagrad")
    files = [str(tmp_path / f"{n}.weights.h5") for n in names]
    _run(script, str(tmp_path), "--reference", "--load", *files)
    ref = np.load(tmp_path / "reference.npz")
    for name, path in zip(names, files):
        npz = np.load(path + ".npz")
        weights = [npz[f"arr_{i}"] for i in range(len(npz.files))]
        errs = relative_errors(weights, [ref[f"{name}/w{i}"] for i in range(len(weights))])
        assert max(errs) <= TOLERANCE, (script, name, errs)
    if script == "hybrid_equiv.py":  # the mirrored weights on the worker's GPU
        dense = json.loads((tmp_path / "worker_0.json").read_text())["dense_devices"]
        assert all("GPU" in d for d in dense.values()), dense
    else:
        assert "computing on device:GPU:0" in out, out[-3000:]


POLICIES = ["float32", "mixed_float16", "mixed_bfloat16"]


def test_mixed_precision_skips_one_workers_overflow_on_gpus(tmp_path):
    """float32 with a LossScaleOptimizer, mixed_float16 and mixed_bfloat16 on one GPU per
    worker: one worker's overflow skips the step on both, and the weights are within each
    policy's rounding of one device's (the CPU tier's own check)."""
    _run("mixed_precision.py", str(tmp_path), "reference", *POLICIES)
    code, out = launch_script(
        "mixed_precision.py", str(tmp_path), "collective", *POLICIES, workers=2, env=FP32
    )
    assert code == 0, out[-6000:]
    for i in range(2):
        check_mixed_precision(tmp_path, f"collective_worker_{i}", tmp_path)


def test_model_parallel_in_bfloat16_over_nccl_on_gpus(tmp_path):
    """ModelParallel on a (1, 2) mesh of two GPUs, the table split, under every policy:
    mixed_bfloat16's sums cross NCCL as float32 (NCCL has no bfloat16 kernel), and the loss
    scales, skips and weights are one device's."""
    _run("mixed_precision.py", str(tmp_path), "reference", *POLICIES)
    _run("mixed_precision.py", str(tmp_path), "modelparallel", *POLICIES, env=MESH_GPUS)
    check_mixed_precision(tmp_path, "modelparallel", tmp_path)


@pytest.mark.parametrize(
    "model, mesh", [("mlp", "1x2"), ("mlp", "2x1"), ("transformer-fsdp", "2x1")]
)
def test_model_parallel_sums_over_nccl_on_gpus(tmp_path, model, mesh):
    """ModelParallel on a mesh of two GPUs: the layers' sums within the model group (1, 2),
    the step's sums over the batch axis (2, 1) and FSDP's reduce-scatter over it are NCCL
    all-reduces (not copies added on each GPU), and training equals one device."""
    out = tmp_path / "result.json"
    ran = _run("model_parallel_equiv.py", model, mesh, "adam-clip", str(out), env=MESH_GPUS)
    line = "(its sums: NCCL)" if mesh == "1x2" else "sums the batch axis in this process over NCCL"
    assert line in ran, ran[-3000:]
    (case,) = json.loads(out.read_text())["cases"]
    assert case["graph"]["nccl_all_reduce"] > 0, case["graph"]
    for key in ("weights", "slots", "predict", "evaluate"):
        assert case[key] <= TOLERANCE, (key, case[key])
    assert all("GPU" in device for _, _, parts, _ in case["held"] for device, _ in parts), case


@pytest.mark.parametrize(
    "kind, workers, per_worker",
    [
        ("mirrored", 0, 2),
        ("car", 2, 1),
        pytest.param("car", 2, 2, marks=requires_gpus(4), id="car-2x2"),
    ],
    ids=["mirrored", "car-1", "car-2x2"],
)
def test_two_thousand_steps_keep_threads_and_files_flat_on_gpus(
    tmp_path, kind, workers, per_worker
):
    """2,000 steps with steps_per_execution 1 and 3, TensorFlow's collectives inside every
    step (NCCL): no thread per collective op, no hang (tests/workers/soak_run.py, as the CPU
    soak smoke: a run that grows by 400 threads is stopped and fails here)."""
    steps = 2000
    args = ["soak_run.py", str(tmp_path), kind, "--steps", str(steps), "--spe", "1,3"]
    args += ["--every", "50", "--max-threads", "400", "--gpus"]
    if workers:
        gpus = [str(i) for i in range(workers * per_worker)]
        code, out = launch_script(*args, workers=workers, env=FP32, gpus=gpus, timeout=550)
        assert code == 0, out[-6000:]
    else:
        _run(*args)
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*.json"))]
    assert len(reports) == (workers or 1), reports
    for r in reports:
        assert [p["spe"] for p in r["phases"]] == [1, 3], r["phases"]
    print("\n".join(check(reports, steps, warmup=100)))
