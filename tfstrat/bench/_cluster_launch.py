"""`tfstrat bench cluster`'s launcher row: N `tfstrat launch --nodes` launchers, one per emulated
host, agree on a job's attempts. No TensorFlow: each node's one task is a toy that prints when
it starts (wall clock: the hosts are one machine) and sleeps; node N-1's task fails 3 s into
attempt 0, so every launcher must stop its task and meet the others at the rendezvous for
attempt 1 (`--restarts 1`), whose tasks end after a second.

Measured: the launch (from the launchers started to the last attempt-0 task started), the
agreement (from the failure to the last attempt-1 task started, every launcher's grace for
its task to stop included), and whether every launcher ran attempts 0 and 1 on all N nodes.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import time

from tfstrat.bench import _netns

PORT = 29400
TOY = """
import json, os, sys, time
restart = int(os.environ["TFSTRAT_RESTART"])
task = os.environ["TFSTRAT_TASK"]
workers = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])
print(f"toy {task} restart {restart} workers {workers} at {time.time():.3f}", flush=True)
if restart == 0 and task == sys.argv[1]:
    time.sleep(3)
    print(f"toy failing at {time.time():.3f}", flush=True)
    sys.exit(1)
time.sleep(60 if restart == 0 else 1)
"""
GRACE = 2  # seconds a launcher gives its stopped task (a toy ends at once)


def run(net: _netns.Network, *, timeout: float, package_root: str) -> dict:
    n = net.hosts
    work = tempfile.mkdtemp(prefix="tfstrat-launchers-")
    toy = os.path.join(work, "toy.py")
    with open(toy, "w") as f:
        f.write(TOY)
    os.makedirs(os.path.join(work, "backup"))
    secret = os.path.join(work, "secret")
    with open(secret, "w") as f:
        f.write("bench cluster launchers\n")
    nodes = ",".join(f"{net.ipv4(i)}:{PORT}" for i in range(n))
    env = {"PYTHONPATH": package_root, "PYTHONUNBUFFERED": "1"}
    started = time.time()
    launchers = [
        net.start(
            i,
            [
                sys.executable,
                "-m",
                "tfstrat",
                "launch",
                "--nodes",
                nodes,
                "--node-rank",
                str(i),
                "--restarts",
                "1",
                "--grace",
                str(GRACE),
                "--backup-dir",
                os.path.join(work, "backup"),
                "--secret-file",
                secret,
                "--show",
                "all",
                "--",
                sys.executable,
                toy,
                f"worker:{n - 1}",
            ],
            env=env,
            name=f"launcher:{i}",
        )  # fmt: skip
        for i in range(n)
    ]
    try:
        net.wait(launchers, timeout)
    except _netns.TaskError as e:
        return {"hosts": n, "error": str(e).splitlines()[0][-300:]}
    starts: dict[int, list[float]] = {0: [], 1: []}
    agreed = True
    failed_at = None
    for task in launchers:
        out = task.output(limit=1 << 20)
        # the task's own lines (a failure report quotes them again, unprefixed)
        seen = re.findall(r"^\[worker:\d+\] toy worker:\d+ restart (\d+) workers (\d+) at ([\d.]+)",
                          out, re.M)  # fmt: skip
        attempts = [(int(r), int(w)) for r, w, _ in seen]
        agreed &= attempts == [(0, n), (1, n)]
        for r, _, at in seen:
            starts.setdefault(int(r), []).append(float(at))
        found = re.search(r"^\[worker:\d+\] toy failing at ([\d.]+)", out, re.M)
        failed_at = float(found.group(1)) if found else failed_at
    if not agreed or failed_at is None or len(starts[1]) != n:
        return {"hosts": n, "error": "the launchers did not all run attempts 0 and 1 on "
                f"every node: {net.report(launchers, limit=1500)[-1500:]}"}  # fmt: skip
    return {
        "hosts": n,
        "launch_s": max(starts[0]) - started,
        "attempt0_spread_s": max(starts[0]) - min(starts[0]),
        "agreement_s": max(starts[1]) - failed_at,
        "attempt1_spread_s": max(starts[1]) - min(starts[1]),
        "grace_s": GRACE,
    }
