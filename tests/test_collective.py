"""CollectiveAllReduce: real worker processes started by `tfstrat launch`, against one device."""

import json
import sys

import numpy as np
import pytest
from cluster import (
    RUN_TIMEOUT,
    assert_chief_wrote_and_workers_restored,
    launch_script,
    start_task,
)
from common import check_collective_equiv
from paths import WORKERS

pytestmark = pytest.mark.cluster

TOLERANCE = 1e-5


_REFERENCES: dict[tuple, str] = {}  # one reference run per argument list in this module


def _reference(out_dir, *args):
    if args in _REFERENCES:
        return np.load(_REFERENCES[args])
    import subprocess

    proc = subprocess.run(
        [
            sys.executable,
            "collective_equiv.py",
            str(out_dir),
            "--reference",
            *args,
        ],
        cwd=WORKERS,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _REFERENCES[args] = str(out_dir / "reference.npz")
    return np.load(out_dir / "reference.npz")


def _check_against_reference(tmp_path, workers, *args):
    code, out = launch_script("collective_equiv.py", str(tmp_path), *args, workers=workers)
    assert code == 0, out[-6000:]
    # The reference is one device whatever the workers' devices are.
    at = args.index("--devices") if "--devices" in args else len(args)
    ref = _reference(tmp_path, *args[:at], *args[at + 2 :])
    results = [np.load(tmp_path / f"worker_{i}.npz") for i in range(workers)]
    check_collective_equiv(results, ref, TOLERANCE)
    return out


def test_two_workers_equal_single_device(tmp_path):
    out = _check_against_reference(tmp_path, 2)
    assert "input sharded by data" in out
    # The default on CPU workers with one device each; two on one machine share memory.
    assert "tcp ring (dense; shared memory with the other worker)" in out
    for i in range(2):
        r = np.load(tmp_path / f"worker_{i}.npz")
        steps = sum(int(r[f"{name}/iterations"]) for name in ("sgdm", "adam", "dataset"))
        # One TCP ring exchange per training step carries every dense gradient (packed),
        # the workers' two stop flags (tfstrat/strategies/_stopping.py), the replica's row
        # count and the metric states (loss and accuracy: a total and a count each), see
        # tfstrat/strategies/_exact_step.py, and the embedding's rows (one block gathered),
        # also in the while loop of steps_per_execution=3 where the batch size is unknown:
        # no other exchange and no TensorFlow collective in a step. The other exchanges are
        # metric reductions outside the steps and the stop agreement at each epoch's end.
        sizes, gathers = r["ring/sizes"], r["ring/gathers"]
        per_step = int(r["dense_params"]) + 2 + 1 + 4
        assert (sizes == per_step).sum() == steps, sizes
        assert (gathers[sizes == per_step] == 1).all(), gathers
        # Blocks gathered in all: one a step, the shuffle probe's (a one-table model) 10
        # steps, and before each of the 4 models' first step the workers' agreement on it (2
        # gathers each).
        assert int(gathers.sum()) == steps + 10 + 2 * 4, gathers


def test_workers_of_two_devices_equal_single_device_with_steps_per_execution(tmp_path):
    """Two logical CPUs per worker, the default transport: each worker sums its two replicas
    by copies on its first device and the sums cross on tfstrat's TCP ring, with
    steps_per_execution 1 (NumPy input) and 3 (the tf.data input); no TensorFlow collective in
    a step (their records grow with the run: tfstrat/reduce/cross_device.py)."""
    out = _check_against_reference(tmp_path, 2, "--devices", "2")
    assert "4 replica(s) in sync" in out and "tcp ring" in out, out[-3000:]
    assert "Using CollectiveAllReduce eagerly" not in out  # no eager collective on 2 devices
    for i in range(2):
        r = np.load(tmp_path / f"worker_{i}.npz")
        for name in ("sgdm", "adam"):
            graph = json.loads(str(r[f"{name}/graph"]))
            assert not graph["hints"], graph  # no CollectiveReduce op in the traced step
        # Every step exchanged once on the ring at least (the step's sums; the per-step
        # "input left" count of TensorFlow's sharding rides in a second, float64 call).
        steps = sum(int(r[f"{name}/iterations"]) for name in ("sgdm", "adam", "dataset"))
        assert (r["ring/sizes"] > int(r["dense_params"])).sum() >= steps, r["ring/sizes"]


def test_workers_of_two_devices_over_tensorflows_ring_with_steps_per_execution(tmp_path):
    """communication="ring": TensorFlow's collectives carry the step (no per-op timeout: the
    process's watchdog bounds them), where each replica draws its own instance keys inside
    Keras's loop of steps_per_execution=3 (one counter shared by a worker's replicas gave the
    members of one collective different keys, and they waited for each other forever)."""
    out = _check_against_reference(tmp_path, 2, "--devices", "2", "--communication", "ring")
    assert "4 replica(s) in sync" in out and "tcp ring" not in out
    assert "Using CollectiveAllReduce eagerly" not in out  # no eager collective on 2 devices


def test_three_workers_equal_single_device(tmp_path):
    _check_against_reference(tmp_path, 3)


def test_last_partial_batch_equals_single_device(tmp_path):
    """510 examples at global batch 24: 21 full batches, then one of 6 (3 per worker).

    Over TensorFlow's collectives (communication="ring"), the path multi-device and GPU
    workers take; the other tests use the default TCP ring."""
    out = _check_against_reference(
        tmp_path, 2, "--global-batch", "24", "--examples", "510", "--communication", "ring"
    )
    assert "tcp ring" not in out
    # Read from the traced step: TensorFlow's ring collectives, the gradients on the CPU.
    graph = json.loads(str(np.load(tmp_path / "worker_0.npz")["sgdm/graph"]))
    assert graph["hints"].get("ring", 0) > 0 and "nccl" not in graph["hints"], graph
    assert graph["gradient_devices"], graph
    assert all("device:CPU:0" in d for d in graph["gradient_devices"]), graph


def test_clipping_applies_to_the_aggregated_gradient(tmp_path):
    """Keras clips before its all-reduce; tfstrat clips the sum, as one device would."""
    _check_against_reference(tmp_path, 2, "--clip", "global_clipnorm=0.05")


@pytest.mark.faults
def test_a_killed_peer_fails_the_others_within_the_timeout():
    import time

    from tfstrat import TFConfig

    timeout = 20
    config = TFConfig.local(workers=2)
    procs = [start_task(config, "worker", i, "peer_killed.py", str(timeout)) for i in range(2)]
    try:
        out, _ = procs[0].communicate(timeout=RUN_TIMEOUT)
        ended = time.time()
        dead, _ = procs[1].communicate(timeout=30)  # it killed itself: its output is complete
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[0].returncode != 0, out[-3000:]
    assert "training finished" not in out
    # TensorFlow's gRPC error names the peer it lost.
    assert "/job:worker/replica:0/task:1" in out, out[-3000:]
    # From the kill: at most one collective timeout, and a busy machine's slack.
    took = ended - float(dead.split("worker 1 dies now, at ")[1].split()[0])
    assert took < timeout + 30, (took, out[-3000:])


def test_only_the_chief_writes_and_every_worker_restores(tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    code, out = launch_script(
        "callbacks_run.py", str(tmp_path), workers=2, env={"TMPDIR": str(scratch)}
    )
    assert code == 0, out[-6000:]
    assert_chief_wrote_and_workers_restored(tmp_path, scratch)
