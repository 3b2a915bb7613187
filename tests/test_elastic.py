"""Losing a node is not losing the job: `tfstrat launch --nodes ... --restarts K --min-nodes 2
--backup-dir D` on three "machines" (network namespaces on one bridge, tests/helpers/netns.py),
one launcher per machine as a user starts them, a backup directory they share.

A node's launcher and every task it started are killed (SIGKILL of its process group) in the
middle of an epoch; the other launchers stop their tasks, meet at the rendezvous and train on
from the chief's backup on the two nodes left; the final weights must be within 1e-5 of an
uninterrupted run on the three nodes (the global batch, 12, is sliced 4+4+4 or 6+6), which
is one device's: the reference is one process. Each case also bounds the seconds from the kill
to the first step trained again.

Cases: CollectiveAllReduce losing node 1, whose launcher is then started again, so the job
grows back to three nodes at once; CollectiveAllReduce losing node 0 (the chief, and the
rendezvous host); Hybrid with ps:0 on node 0 losing node 0 (the chief, the host and the ps:
ps:0 moves to the first node left, its table restored from the backup). Needs root (skipped
otherwise).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import netns
import numpy as np
import pytest
from cluster import run_script
from paths import WORKERS

from tfstrat.launcher.rendezvous import PROBE_SECONDS, WATCH_MISSES, WATCH_SECONDS

pytestmark = [pytest.mark.cluster]

PORT = 2222
TOLERANCE = 1e-5
RUN_SECONDS = 300  # one launch: three attempts' start-ups on 2 cores, 24 steps of 0.25 s
GRACE, REJOIN = 10, 20  # the launchers' --grace and --rejoin-window
# A lost node is noticed within WATCH_MISSES missed hellos WATCH_SECONDS apart (each hello
# waits up to PROBE_SECONDS to connect), after the last one it answered.
DETECT = WATCH_SECONDS * (WATCH_MISSES + 1) + PROBE_SECONDS * WATCH_MISSES
TF_START = 50  # three TensorFlow tasks' imports, the backup's restore, a first step (2 cores)
# From the kill to a step trained again: detection, the survivors' tasks stopped (grace), the
# round (closed at the latest by the rejoin window), the next attempt's start-up.
BACK_WITHIN = DETECT + GRACE + REJOIN + TF_START
APART = {"TFSTRAT_RING_SHARED_MEMORY": "0"}  # as between machines (test_multihost)
STEP = re.compile(r"elastic: epoch (\d+) batch (\d+) restart (\d+) workers (\d+) at ([\d.]+)")


@pytest.fixture(scope="module")
def net():
    yield from netns.module_network(3)


def _launch(net, rank: int, out, kind: str, ps: str | None, name: str):
    nodes = ",".join(net.ipv4(i) for i in range(3))
    argv = [
        sys.executable, "-m", "tfstrat", "launch",
        "--nodes", nodes, "--node-rank", str(rank), "--workers-per-node", "1",
        *(["--ps-per-node", ps] if ps else []),
        "--port", str(PORT), "--threads-per-task", "1",
        "--restarts", "2", "--min-nodes", "2", "--rejoin-window", str(REJOIN),
        "--backup-dir", str(out / "backup"), "--secret-file", str(out / "secret"),
        "--timeout", str(RUN_SECONDS), "--show", "all", "--grace", str(GRACE),
        "--", sys.executable, "elastic_train.py", str(out), kind,
    ]  # fmt: skip
    env = {"PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2", **APART}
    return net.start(rank, argv, env=env, name=name, cwd=WORKERS)


def _prepare(out):
    (out / "backup").mkdir(parents=True)
    (out / "secret").write_text("elastic test job\n")


def _steps(text: str) -> list[tuple[int, int, int, int, float]]:
    return [(int(e), int(b), int(r), int(w), float(t)) for e, b, r, w, t in STEP.findall(text)]


def _run(net, out, kind: str, ps: str | None, tag: str):
    _prepare(out)
    return [_launch(net, r, out, kind, ps, f"{tag} node {r}") for r in range(3)]


def _final(out) -> list[np.ndarray]:
    with np.load(out / "final.npz") as f:
        return [f[k] for k in sorted(f.files, key=lambda k: (len(k), k))]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Where each strategy's run on three nodes that lose nothing ends: one device's training
    of the same global batches (the strategies equal it within 1e-5: tests/test_collective.py,
    tests/test_hybrid.py), one process instead of three nodes."""
    finals = {}
    for kind in ("collective", "hybrid"):
        out = tmp_path_factory.mktemp(f"uninterrupted-{kind}")
        run_script("elastic_train.py", str(out), kind, "--reference")
        finals[kind] = _final(out)
    return finals


def _wait_for_step(task, epoch: int, batch: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(s[:2] >= (epoch, batch) for s in _steps(task.output(limit=10**7))):
            return
        if task.proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"no step {epoch}/{batch} within {timeout} s:\n{task.output()}")


def _say(net, launchers) -> str:
    return net.report(launchers, limit=30000)


CASES = {
    # (strategy, ps per node, node killed, started again)
    "collective-node1-and-back": ("collective", None, 1, True),
    "collective-node0": ("collective", None, 0, False),
    "hybrid-node0-with-the-ps": ("hybrid", "1,0,0", 0, False),
}


@pytest.mark.multihost
@pytest.mark.elastic
@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_SECONDS + 200)
@pytest.mark.parametrize("case", list(CASES))
def test_losing_a_node_ends_where_an_uninterrupted_run_ends(net, uninterrupted, tmp_path, case):
    kind, ps, lost, back = CASES[case]
    launchers = _run(net, tmp_path, kind, ps, case)
    _wait_for_step(launchers[0], 1, 2, RUN_SECONDS)  # mid-epoch 1, backups at batches 1, 3, ...
    killed_at = time.time()
    net.stop(launchers[lost])
    survivors = [t for r, t in enumerate(launchers) if r != lost]
    if back:
        # Once the two nodes left train, node 1's launcher starts again: the job grows.
        deadline = time.monotonic() + BACK_WITHIN + 30
        while not any(s[2] >= 1 for s in _steps(launchers[0].output(limit=10**7))):
            assert time.monotonic() < deadline, _say(net, launchers)
            time.sleep(0.2)
        survivors.append(_launch(net, lost, tmp_path, kind, ps, f"{case} node {lost} again"))
    net.wait(survivors, 2 * RUN_SECONDS)
    log = _say(net, [*launchers, *survivors[len(launchers) - 1 :]])

    # The chief of each attempt prints the steps: node 0's, or after losing node 0, node 1's.
    text = "".join(t.output(limit=10**7) for t in survivors)
    steps = _steps(text)
    resumed = [s for s in steps if s[2] >= 1]
    assert resumed, log
    took = min(s[4] for s in resumed) - killed_at
    assert 0 < took < BACK_WITHIN, (took, log)
    # Each later attempt resumed from a backup: it starts in epoch 1 (the kill came after
    # epoch 1's batch 2; a restart from scratch would begin at epoch 0 batch 0 and end at the
    # same weights) and trains fewer than the 24 steps of a whole run.
    for attempt in sorted({s[2] for s in resumed}):
        mine = [(s[0], s[1]) for s in resumed if s[2] == attempt]
        assert min(mine) >= (1, 0) and len(mine) < 3 * 8, (attempt, mine, log)
    print(f"{case}: {took:.1f} s from the kill to a step trained again")  # pytest -rP shows it
    workers = {s[2]: s[3] for s in steps}
    if back:  # two nodes, then three again; growing uses no restart
        assert 2 in workers.values() and workers[max(workers)] == 3, (workers, log)
        grown = [
            line for line in log.splitlines() if f"node {lost} ({net.ipv4(lost)}) joined" in line
        ]
        assert grown and all("restarts used 1 of 2" in line for line in grown), (grown, log)
    else:
        assert workers[max(workers)] == 2, (workers, log)
    # Each restart says why: the lost node is named (its task the probable cause, or the
    # node that stopped answering).
    lost_node = f"node {lost} ({net.ipv4(lost)})"
    restarts = [line for line in log.splitlines() if re.search(r": attempt [1-9].*; after ", line)]
    assert restarts and lost_node in restarts[0].split("; after ", 1)[1], (restarts, log)
    if ps and lost == 0:  # ps:0 moved to node 1, the first node left
        assert f'"ps":["{net.ipv4(1)}:{PORT + 2}"]' in log, log

    final, reference = _final(tmp_path), uninterrupted[kind]
    assert len(final) == len(reference)
    for a, b in zip(final, reference):
        scale = max(1.0, float(np.abs(b).max()))
        assert float(np.abs(a - b).max()) <= TOLERANCE * scale, (case, a, b)


@pytest.mark.timeout(120)
def test_a_backup_dir_the_nodes_do_not_share_is_refused_at_start(tmp_path):
    """Two launchers on this machine (127.0.0.1 at two ports), each given its own
    --backup-dir: the rendezvous finds the directory is not shared and both stop at once
    (exit 2), naming it, before any task starts."""
    from tfstrat.cluster.ports import free_port

    base = free_port()
    nodes = f"127.0.0.1:{base + 10},127.0.0.1:{base + 20}"
    procs = []
    for rank in range(2):
        (tmp_path / f"b{rank}").mkdir()
        argv = [
            sys.executable, "-m", "tfstrat", "launch", "--nodes", nodes,
            "--node-rank", str(rank), "--restarts", "1", "--backup-dir",
            str(tmp_path / f"b{rank}"), "--", sys.executable, "-c", "print('trained')",
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outs = [p.communicate(timeout=60)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 2, out
        assert "is not shared" in out and "trained" not in out, out


# ------------------------------------------------------ the rendezvous alone, on this machine

# A toy task: it says which attempt it runs and on how many workers, then sleeps (attempts
# 0 and 1 for the given seconds, later ones 2 s).
TOY = """
import json, os, sys, time
cluster = json.loads(os.environ["TF_CONFIG"])["cluster"]
restart = int(os.environ["TFSTRAT_RESTART"])
print("toy", os.environ["TFSTRAT_TASK"], "restart", restart, "workers",
      len(cluster["worker"]), "ps", len(cluster.get("ps", [])), flush=True)
time.sleep(float(sys.argv[1]) if restart < 2 else 2)
"""
TOY_GRACE = 5  # the launchers' default --grace (a toy task ends at once on SIGTERM)
TOY_START = 10  # a launcher's toy tasks started (Python without TensorFlow), on a loaded machine


def _toy_nodes(count: int) -> str:
    """--nodes for `count` launchers on 127.0.0.1, each with its own port range."""
    from tfstrat.cluster.ports import free_port

    base = free_port()
    return ",".join(f"127.0.0.1:{base + 10 + 100 * i}" for i in range(count))


class _Output:
    """A launcher's output, read line by line by a thread as it comes: a wait for a line ends
    at its deadline even while the launcher prints nothing."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines, self._taken, self._ended = proc, [], 0, False
        self._more = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._more:
                self.lines.append(line)
                self._more.notify_all()
        with self._more:
            self._ended = True
            self._more.notify_all()

    def until(self, text: str, seconds: float) -> str:
        """The lines not yet taken, up to the first that holds `text`."""
        deadline = time.monotonic() + seconds
        with self._more:
            while True:
                for i in range(self._taken, len(self.lines)):
                    if text in self.lines[i]:
                        out, self._taken = "".join(self.lines[self._taken : i + 1]), i + 1
                        return out
                left = deadline - time.monotonic()
                assert left > 0 and not self._ended, (text, seconds, "".join(self.lines))
                self._more.wait(left)

    def rest(self, seconds: float) -> str:
        """The lines not yet taken, once the launcher has exited (within `seconds`)."""
        self.proc.wait(timeout=seconds)
        with self._more:
            assert self._more.wait_for(lambda: self._ended, timeout=10), "".join(self.lines)
            out, self._taken = "".join(self.lines[self._taken :]), len(self.lines)
            return out


def _toy_launchers(tmp_path, nodes, ranks, extra, seconds) -> dict[int, _Output]:
    """Launchers of a toy job (no TensorFlow): `ranks` of `nodes`."""
    (tmp_path / "toy.py").write_text(TOY)
    (tmp_path / "backup").mkdir(exist_ok=True)
    (tmp_path / "secret").write_text("toy job\n")  # names the job (its end is recorded)
    procs = {}
    for rank in ranks:
        argv = [
            sys.executable, "-m", "tfstrat", "launch", "--nodes", nodes, "--node-rank",
            str(rank), "--backup-dir", str(tmp_path / "backup"), "--show", "all",
            "--secret-file", str(tmp_path / "secret"), *extra,
            "--", sys.executable, str(tmp_path / "toy.py"), str(seconds),
        ]  # fmt: skip
        procs[rank] = _Output(
            subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,  # killed whole, as a lost node's launcher and tasks
            )
        )
    return procs


def _toy_attempts(out: str) -> list[tuple[int, int]]:
    """(restart, workers) of each toy task start in a launcher's output."""
    found = re.findall(r"toy worker:\d+ restart (\d+) workers (\d+)", out)
    return [(int(r), int(w)) for r, w in found]


@pytest.mark.timeout(240)
def test_the_launchers_go_on_without_a_lost_node_and_take_it_back(tmp_path):
    """Three launchers of a job whose tasks only sleep: node 2's launcher and task are
    SIGKILLed (no task of the others fails: only the rendezvous can notice); the two others go
    on in attempt 1 on two nodes, and when node 2's launcher starts again, the job grows back
    to three nodes in attempt 2 (no restart used), which ends the run (exit 0 everywhere). A
    launcher started after that finds the job's end recorded and stops."""
    extra = ["--restarts", "1", "--rejoin-window", "10"]
    nodes = _toy_nodes(3)
    procs = _toy_launchers(tmp_path, nodes, range(3), extra, 60)
    seen = {r: procs[r].until(f"toy worker:{r} restart 0 workers 3", 120) for r in procs}
    killed_at = time.monotonic()
    os.killpg(procs[2].proc.pid, signal.SIGKILL)
    procs[2].proc.wait(timeout=10)
    # Node 2 noticed lost, node 0 and 1's tasks stopped, the round closed as soon as both
    # joined (node 2 does not answer), attempt 1 started.
    seen[0] += procs[0].until("toy worker:0 restart 1 workers 2", 60)
    took = time.monotonic() - killed_at
    assert took < DETECT + TOY_GRACE + TOY_START, (took, seen[0])
    again = _toy_launchers(tmp_path, nodes, [2], extra, 60)[2]
    outs = {1: seen[1] + procs[1].rest(120), 2: again.rest(120)}
    outs[0] = seen[0] + procs[0].rest(30)
    for rank in (0, 1):
        assert procs[rank].proc.returncode == 0, outs[rank]
        assert _toy_attempts(outs[rank]) == [(0, 3), (1, 2), (2, 3)], outs[rank]
        assert "stopped answering its rendezvous" in outs[rank], outs[rank]
        assert "restarts used 1 of 1" in outs[rank] and "node 2 (127.0.0.1) joined" in outs[rank]
    assert again.proc.returncode == 0 and _toy_attempts(outs[2]) == [(2, 3)], outs[2]
    # Started once more after the end, node 1's launcher does not train alone.
    late = _toy_launchers(tmp_path, nodes, [1], extra, 60)[1]
    out = late.rest(60)
    assert late.proc.returncode == 0 and not _toy_attempts(out), out
    assert "the job has ended: the chief's node, node 0 (127.0.0.1), finished the training" in out


@pytest.mark.timeout(120)
def test_too_few_nodes_left_stops_the_job_naming_min_nodes(tmp_path):
    """Two launchers with --min-nodes 2: when node 1 is lost, node 0 does not go on alone."""
    nodes = _toy_nodes(2)
    window = 10
    extra = ["--restarts", "3", "--min-nodes", "2", "--rejoin-window", str(window)]
    procs = _toy_launchers(tmp_path, nodes, range(2), extra, 60)
    out = procs[0].until("toy worker:0 restart 0 workers 2", 120)
    killed_at = time.monotonic()
    os.killpg(procs[1].proc.pid, signal.SIGKILL)
    out += procs[0].rest(90)
    took = time.monotonic() - killed_at
    assert procs[0].proc.returncode == 1, out
    said = "not restarting: only 1 node(s) joined within 10 s (node 0 (127.0.0.1)), fewer than --min-nodes 2"
    assert said in out, out
    # Noticed, its task stopped, the round closed (at the latest at the window), the end.
    assert took < DETECT + TOY_GRACE + window, (took, out)


@pytest.mark.timeout(120)
def test_sigterm_to_every_launcher_stops_the_job_without_a_restart(tmp_path):
    """`scancel` signals every launcher: each stops its tasks and exits 143; none restarts."""
    nodes = _toy_nodes(3)
    procs = _toy_launchers(tmp_path, nodes, range(3), ["--restarts", "2"], 60)
    seen = {r: procs[r].until(f"toy worker:{r} restart 0 workers 3", 120) for r in procs}
    stopped_at = time.monotonic()
    for launcher in procs.values():
        launcher.proc.send_signal(signal.SIGTERM)
    outs = {rank: seen[rank] + launcher.rest(60) for rank, launcher in procs.items()}
    took = time.monotonic() - stopped_at
    for rank, launcher in procs.items():
        assert launcher.proc.returncode == 143, outs[rank]
        assert "SIGTERM received; stopped all tasks" in outs[rank], outs[rank]
        assert _toy_attempts(outs[rank]) == [(0, 3)], outs[rank]  # no attempt 1
    assert took < TOY_GRACE + TOY_START, took  # the tasks' stop, the launchers' exit
