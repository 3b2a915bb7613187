"""The GPU tier: MirroredNCCL over NCCL, and CollectiveAllReduce with GPUs, against
single-device training. Marked `gpu`; skipped with the reason on machines with fewer than two
GPUs, run wherever TensorFlow lists two or more (`scripts/test -m gpu`)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from cluster import launch_script
from common import relative_errors
from gpus import requires_gpus
from paths import WORKERS

pytestmark = [*requires_gpus(2), pytest.mark.timeout(600)]

TOLERANCE = 1e-5
# float32 everywhere: TF32 matmuls (Ampere and later) differ from one device by ~1e-3.
FP32 = {"NVIDIA_TF32_OVERRIDE": "0", "TF_FORCE_GPU_ALLOW_GROWTH": "true"}


def test_mirrored_nccl_over_every_gpu_equals_single_device(tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "mirrored_equiv.py", "gpu", "auto", str(out)],
        cwd=WORKERS,
        capture_output=True,
        text=True,
        timeout=500,
        env={**os.environ, **FP32},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    n = result["replicas"]
    assert n >= 2, result
    for name in ("sgdm", "adam"):
        assert max(result[name]) <= TOLERANCE, (name, result[name])
        assert result[f"{name}_iterations"] == 24
        assert result[f"{name}_predict_rows"] == 8 * n * 24


def test_collective_all_reduce_with_gpus_equals_single_device(tmp_path):
    """Two workers, each with every GPU of the machine, over NCCL, against the reference run
    of the same program on one device."""
    args = [str(tmp_path), "--communication", "nccl"]
    code, out = launch_script("collective_equiv.py", *args, workers=2, env=FP32)
    assert code == 0, out[-6000:]
    proc = subprocess.run(
        [sys.executable, "collective_equiv.py", str(tmp_path), "--reference"],
        cwd=WORKERS,
        capture_output=True,
        text=True,
        timeout=500,
        env={**os.environ, **FP32},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ref = np.load(tmp_path / "reference.npz")
    for i in range(2):
        mine = np.load(tmp_path / f"worker_{i}.npz")
        for name in ("sgdm", "adam"):
            keys = sorted(
                (k for k in ref.files if k.startswith(f"{name}/w")),
                key=lambda k: int(k[len(name) + 2 :]),
            )
            errs = relative_errors([mine[k] for k in keys], [ref[k] for k in keys])
            assert max(errs) <= TOLERANCE, (name, i, errs)
            assert int(mine[f"{name}/iterations"]) == int(ref[f"{name}/iterations"])
