"""The multi-node rendezvous's rules (`tfstrat/launcher/rendezvous.py`), each shown by real
rendezvous servers of one job on 127.0.0.1 in this process, without launchers or tasks:
which node's finish ends the job, which end is recorded, and how restarts are counted when
the host changes. (tests/test_elastic.py runs whole launchers through the same rules.)"""

from __future__ import annotations

import concurrent.futures

import pytest

from tfstrat.cluster.layout import NodeLayout
from tfstrat.cluster.ports import free_port
from tfstrat.launcher.rendezvous import Rendezvous

pytestmark = pytest.mark.timeout(120)

SECRET = b"one job's secret"


class Job:
    """The rendezvous servers of one job's nodes (`workers`/`ps`: "1,0"-style per node)."""

    def __init__(
        self, tmp_path, count: int, workers: str, ps: str, restarts: int = 1, first_window=20.0
    ):
        base = free_port()
        self.nodes = [f"127.0.0.1:{base + 10 + 100 * i}" for i in range(count)]
        self.workers, self.ps, self.restarts = workers, ps, restarts
        self.first_window = first_window
        self.backup = tmp_path / "backup"
        self.backup.mkdir(exist_ok=True)
        self.live: dict[int, Rendezvous] = {}

    def start(self, rank: int, secret: bytes = SECRET) -> Rendezvous:
        """Node `rank`'s launcher (again): a new rendezvous server on its port."""
        layout = NodeLayout(self.nodes, rank, self.workers, self.ps)
        self.live[rank] = Rendezvous(
            layout,
            secret,
            min_nodes=1,
            restarts=self.restarts,
            first_window=self.first_window,
            window=1.5,  # a later round closes 1.5 s after its last answering node joined
            backup_dir=str(self.backup),
        )
        return self.live[rank]

    def lose(self, rank: int) -> None:
        """Node `rank` is gone: its rendezvous answers no more."""
        self.live.pop(rank).close()

    def join(self, why: str | dict[int, str], cause: str = "") -> dict[int, dict]:
        """Every live node joins at once (as their launchers do), each for `why` ("start",
        "failure") or `why[rank]`; their answers by rank."""
        whys = why if isinstance(why, dict) else dict.fromkeys(self.live, why)
        with concurrent.futures.ThreadPoolExecutor(len(self.live)) as pool:
            futures = {r: pool.submit(z.join, whys[r], cause) for r, z in self.live.items()}
            return {r: f.result(timeout=90) for r, f in futures.items()}

    def close(self) -> None:
        for rendezvous in self.live.values():
            rendezvous.close()
        self.live.clear()


@pytest.fixture
def job_of(tmp_path):
    made = []

    def make(*args, **kwargs):
        made.append(Job(tmp_path, *args, **kwargs))
        return made[-1]

    yield make
    for job in made:
        job.close()


def test_a_ps_only_node_is_never_the_chiefs(job_of):
    """Node 0 holds only the ps, node 1 the worker: node 0's tasks finishing (a ps is ended by
    its workers) is not the end of the job; node 1's is, and is recorded: a launcher started
    later stops, naming node 1."""
    job = job_of(2, workers="0,1", ps="1,0")
    for rank in (0, 1):
        job.start(rank)
    answers = job.join("start")
    assert {r: a.get("ranks") for r, a in answers.items()} == {0: [0, 1], 1: [0, 1]}, answers
    for rendezvous in job.live.values():
        rendezvous.started(answers[0]["round"], answers[0]["ranks"])
    job.live[0].finished()
    assert not list(job.backup.glob(".tfstrat-nodes/ended-*")), "a ps-only node ended the job"
    job.live[1].finished()
    job.close()
    late = job.start(0).join("start")
    assert late["code"] == 0 and "the job has ended: the chief's node, node 1" in late["stop"], late


def test_the_first_recorded_end_stands(job_of):
    """Two ends recorded (a failure, then a node that finished): the job's end is the first."""
    job = job_of(1, workers="1", ps="0")
    rendezvous = job.start(0)
    rendezvous.end(3, "no restarts left (the first end)")
    rendezvous.end(0, "the chief's node finished (a later end)")
    job.close()
    late = job.start(0).join("start")
    assert late["code"] == 3 and "the first end" in late["stop"], late


def test_no_worker_node_left_stops_the_round_without_ending_the_job(job_of):
    """Node 1 (every worker) is lost; node 0 (the ps) alone cannot go on, and says so; but
    that is not the job's end: the nodes started again train (a new round), instead of being
    told the job has ended."""
    job = job_of(2, workers="0,1", ps="1,0", restarts=3)
    for rank in (0, 1):
        job.start(rank)
    assert all("round" in a for a in job.join("start").values())
    job.lose(1)
    alone = job.join("failure", "worker:0 exited with code 1")
    assert alone[0]["code"] == 1 and "no node with workers is left" in alone[0]["stop"], alone
    job.close()
    for rank in (0, 1):
        job.start(rank)
    again = job.join("start")
    assert all(a.get("ranks") == [0, 1] for a in again.values()), again


def test_restarts_are_counted_across_hosts(job_of):
    """--restarts 1 on three nodes: a failure uses the one restart (node 0 hosts). Nodes 0 and
    1 are then lost and node 1's launcher starts again, knowing nothing; when node 2 fails, node
    1 hosts: it learns from node 2 that the restart was used, and ends the job (recorded)
    instead of granting a second."""
    job = job_of(3, workers="1", ps="0", restarts=1)
    for rank in range(3):
        job.start(rank)
    first = job.join("start")
    assert all(a["round"] == 0 and a["restarts"] == 0 for a in first.values()), first
    second = job.join("failure", "worker:1 exited with code 1")
    assert all(a["round"] == 1 and a["restarts"] == 1 for a in second.values()), second
    job.lose(0)
    job.lose(1)
    job.start(1)
    third = job.join({1: "start", 2: "failure"}, "worker:2 exited with code 1")
    for answer in third.values():
        assert "no restarts left (1 of --restarts 1 used)" in answer.get("stop", ""), third
        assert answer["code"] == 1, third
    job.close()
    late = job.start(0).join("start")
    assert "the job has ended: no restarts left" in late["stop"], late


def test_a_launcher_with_another_jobs_secret_is_not_let_in(job_of):
    """Node 1's launcher is given another job's --secret-file: node 0 cannot reach it and it
    cannot reach node 0, so neither's first round takes the other in. Each closes its round
    at the window with itself alone (--min-nodes 1), never with the other's node."""
    job = job_of(2, workers="1", ps="0", first_window=3.0)
    job.start(0)
    stranger = job_of(2, workers="1", ps="0", first_window=3.0)
    stranger.nodes, stranger.backup = job.nodes, job.backup  # the same addresses
    stranger.start(1, secret=b"another job's secret")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        ours, theirs = pool.submit(job.join, "start"), pool.submit(stranger.join, "start")
        ours, theirs = ours.result(timeout=60)[0], theirs.result(timeout=60)[1]
    assert ours.get("ranks") == [0] and theirs.get("ranks") == [1], (ours, theirs)
