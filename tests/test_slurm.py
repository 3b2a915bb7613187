"""The SLURM recipe on a real SLURM cluster: two compute nodes, each a network namespace with its
own address and name (`tests/helpers/slurm.py`), slurmctld and munged beside them.

`sbatch --wait examples/clusters/slurm.sbatch` must train across both nodes (one `tfstrat
launch` per node, started by srun), and a worker killed on one node must fail the job within
the timeout, the report naming the task and its node. Needs root and SLURM (`scripts/test`
installs slurm-wlm and munge as root); elsewhere the tier skips saying why. Run:
`scripts/test -m slurm`.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import procs
import pytest
from netns import Unavailable, skip_or_fail
from paths import ROOT, WORKERS
from slurm import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.cluster]

VENV = sys.prefix  # the recipe activates $TFSTRAT_VENV/bin/activate on every node


def _cluster() -> SlurmCluster:
    cluster = SlurmCluster(nodes=2)
    try:
        return cluster.__enter__()
    except Unavailable as e:
        skip_or_fail(str(e))


def _finish(proc, timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except Exception:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    return out


@pytest.mark.timeout(420)
def test_the_sbatch_recipe_trains_on_both_nodes():
    cluster = _cluster()
    try:
        start = time.monotonic()
        proc, output = cluster.submit(
            "examples/clusters/slurm.sbatch", env={"TFSTRAT_VENV": VENV}, cwd=str(ROOT)
        )
        sbatch = _finish(proc, 360)
        took = time.monotonic() - start
        job = cluster.job_output(output)
        assert proc.returncode == 0, f"{sbatch}\n{job[-6000:]}\n{cluster.logs()}"
        # One launcher per node, from SLURM's node list and node id; the same TF_CONFIG on both.
        assert "node 0 (node1) of 2 nodes starts worker:0, worker:1" in job, job[-6000:]
        assert "node 1 (node2) of 2 nodes starts worker:2, worker:3" in job, job[-6000:]
        clusters = set(re.findall(r"2 nodes starts worker:\d, worker:\d; cluster (\{.*\})", job))
        assert clusters == {'{"worker":["node1:2222","node1:2224","node2:2222","node2:2224"]}'}, (
            clusters
        )
        # The chief (worker:0, on node1) evaluated the trained model.
        accuracy = re.findall(r"\[worker:0\] CollectiveAllReduce: held-out accuracy (0\.\d+)", job)
        assert len(accuracy) == 1 and float(accuracy[0]) > 0.6, job[-6000:]
        assert took < 360, took
        made = cluster.dir, list(cluster.net.namespaces)
        cluster.close()
        assert cluster.leftovers(*made) == [], cluster.leftovers(*made)
    finally:
        cluster.close()


def _pid_of(task: str, marker: str) -> int | None:
    found = procs.find(env=[f"TFSTRAT_TASK={task}"], arg=marker, program="python")
    return found[0] if found else None


BATCH = """#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --time=00:10:00
set -euo pipefail
source "$TFSTRAT_VENV/bin/activate"
srun --ntasks-per-node=1 --kill-on-bad-exit=1 \\
    tfstrat launch --workers-per-node 1 --port 2222 --timeout 300 \\
    -- python {workers}/nodes_train.py {out} --forever
"""


@pytest.mark.faults
@pytest.mark.timeout(420)
def test_a_worker_killed_on_one_node_fails_the_job_naming_it_and_its_node(tmp_path):
    cluster = _cluster()
    try:
        out = tmp_path / "out"
        out.mkdir()
        script = tmp_path / "kill.sbatch"
        script.write_text(BATCH.format(workers=WORKERS, out=out))
        proc, output = cluster.submit(str(script), env={"TFSTRAT_VENV": VENV}, cwd=str(ROOT))
        deadline = time.monotonic() + 240
        while not all((out / f"worker:{i}.epoch").exists() for i in (0, 1)):
            if time.monotonic() > deadline or proc.poll() is not None:
                pytest.fail(
                    f"training never started:\n{_finish(proc, 30)}\n"
                    f"{cluster.job_output(output)[-6000:]}\n{cluster.logs()}"
                )
            time.sleep(0.5)
        pid = _pid_of("worker:1", str(out))
        assert pid is not None, cluster.job_output(output)[-3000:]
        os.kill(pid, signal.SIGKILL)  # worker:1 runs on node2
        killed = time.monotonic()
        sbatch = _finish(proc, 300)
        took = time.monotonic() - killed
        job = cluster.job_output(output)
        assert proc.returncode not in (0, None), f"{sbatch}\n{job[-6000:]}"
        assert (
            "worker:1 on node 1 (node2) failed first (exit code 137, killed by SIGKILL)" in job
        ), job[-6000:]
        # No --restarts: the job ends, far inside the strategy's 120 s timeout (the ring sees
        # the connection close; srun --kill-on-bad-exit stops the other node's launcher).
        assert took < 90, took
    finally:
        cluster.close()
