"""`NodeLayout`: which node this launcher is, among nodes that all run `tfstrat launch --nodes`
with the same arguments (torchrun's `--nnodes/--node-rank`). TensorFlow-free."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence

from tfstrat.cluster.config import TFConfig
from tfstrat.cluster.hosts import expand_nodelist, show, slurm_var
from tfstrat.cluster.nodes import DEFAULT_PORT, Node, plan
from tfstrat.cluster.ports import join
from tfstrat.errors import TFConfigError


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """Which node this launcher is, among nodes that all run `tfstrat launch` with the same
    arguments.

    Attributes:
        nodes: the nodes, `"a,b"`, `"node[01-04]"`, `"10.0.0.1:2222,[fd00::2]"`, or a list.
            `host:port` gives that node its own first port (two launchers on one machine).
        rank: this node's index in `nodes` (torchrun's `--node-rank`).
        workers_per_node: workers on every node, or one count per node (`"1,1,0"`).
        ps_per_node: ps tasks on every node, or one count per node (`"0,0,1"`).
        port: the first task's port on every node without its own port.

    Example:
        >>> layout = NodeLayout("a,b", rank=1, workers_per_node=2, port=2222)
        >>> layout.tf_config().addresses("worker")
        ('a:2222', 'a:2224', 'b:2222', 'b:2224')
        >>> [name for name, _ in layout.local_tasks()]
        ['worker:2', 'worker:3']
    """

    nodes: str | Sequence[str]
    rank: int
    workers_per_node: int | str | Sequence[int] = 1
    ps_per_node: int | str | Sequence[int] = 0
    port: int = DEFAULT_PORT

    def __post_init__(self) -> None:
        layout = plan(self.nodes, self.workers_per_node, self.ps_per_node, self.port)
        rank = self.rank
        if isinstance(rank, str) and rank.isdigit():
            rank = int(rank)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(layout):
            raise TFConfigError(
                f"Received: node_rank={show(rank)} for {len(layout)} nodes "
                f"({', '.join(n.host for n in layout[:4])}{', ...' if len(layout) > 4 else ''}). "
                f"Use 0..{len(layout) - 1}: this node's position in --nodes."
            )
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "_plan", layout)

    @property
    def plan(self) -> tuple[Node, ...]:
        return self._plan  # type: ignore[attr-defined]

    @property
    def node(self) -> Node:
        """This launcher's node."""
        return self.plan[self.rank]

    def tf_config(self) -> TFConfig:
        """The cluster (no task): the same on every node."""
        cluster: dict[str, list[str]] = {"worker": [], "ps": []}
        for node in self.plan:
            for job, _, address in node.tasks:
                cluster[job].append(address)
        return TFConfig(cluster)

    def local_tasks(self) -> list[tuple[str, tuple[str, int]]]:
        """This node's tasks: ("worker:2", ("worker", 2)), ..."""
        return [(f"{job}:{i}", (job, i)) for job, i, _ in self.node.tasks]

    def places(self) -> dict[str, str]:
        """Every task's node, for reports: {"worker:1": "node 1 (b)", ...}."""
        return {f"{job}:{i}": node.where for node in self.plan for job, i, _ in node.tasks}

    def among(self, ranks: Sequence[int]) -> NodeLayout:
        """The layout of the nodes `ranks` only (this one among them), numbered in their
        order: what a multi-node restart runs on the nodes left. Each node keeps its workers;
        the ps tasks of the nodes left out move to the first of `ranks`, so the job keeps its
        ps count (Hybrid's tables and ParameterServer's variables keep their parts).

        Example:
            >>> layout = NodeLayout("a,b,c", rank=2, ps_per_node="1,0,0", port=2222)
            >>> dict(layout.among([1, 2]).tf_config().cluster)
            {'worker': ('b:2222', 'c:2222'), 'ps': ('b:2224',)}
        """
        ranks = sorted(set(ranks))
        if self.rank not in ranks:
            raise TFConfigError(f"Received: ranks {ranks} without this node ({self.rank}).")
        count = lambda node, job: sum(1 for j, _, _ in node.tasks if j == job)  # noqa: E731
        kept = [self.plan[r] for r in ranks]
        workers = [count(n, "worker") for n in kept]
        ps = [count(n, "ps") for n in kept]
        ps[0] += sum(count(n, "ps") for n in self.plan if n.rank not in ranks)
        if not any(workers):
            names = ", ".join(n.where for n in kept)
            raise TFConfigError(
                f"no node with workers is left ({names} hold only ps tasks): the job cannot "
                "continue. Start the nodes with workers again."
            )
        nodes = [join(n.host, n.port) for n in kept]
        return NodeLayout(nodes, ranks.index(self.rank), workers, ps, self.port)

    def remote_trainers(self) -> dict[str, str]:
        """The workers of the other nodes: {"worker:1": "b:2222"}."""
        return {
            f"{job}:{i}": address
            for node in self.plan
            if node.rank != self.rank
            for job, i, address in node.tasks
            if job != "ps"
        }

    @classmethod
    def from_slurm(
        cls,
        environ: Mapping[str, str],
        workers_per_node: int | str | Sequence[int] = 1,
        ps_per_node: int | str | Sequence[int] = 0,
        port: int = DEFAULT_PORT,
        rank: int | None = None,
    ) -> NodeLayout:
        """The layout of a `srun --ntasks-per-node=1 tfstrat launch ...` step: nodes from
        SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST), this node from SLURM_NODEID (unless
        `rank` is given), checked against SLURM_STEP_NUM_NODES / SLURM_NNODES and one launcher
        per node (SLURM_LOCALID 0, SLURM_STEP_TASKS_PER_NODE all 1)."""
        name, text = slurm_var(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
        hosts = expand_nodelist(name, text)
        for count_name in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES"):
            count = environ.get(count_name)
            if count:
                if count != str(len(hosts)):
                    raise TFConfigError(
                        f"Received: {count_name}={count!r} but {name}={show(text)} lists "
                        f"{len(hosts)} nodes. Run tfstrat launch under srun in one allocation."
                    )
                break
        local_id = environ.get("SLURM_LOCALID", "0")
        per_node = environ.get("SLURM_STEP_TASKS_PER_NODE", "")
        if local_id != "0" or re.search(r"(^|,)([2-9]|[1-9][0-9]+)(\(|,|$)", per_node):
            raise TFConfigError(
                f"Received: SLURM_LOCALID={local_id!r}, SLURM_STEP_TASKS_PER_NODE={per_node!r}: "
                "srun started several launchers on one node. Start one per node: "
                "srun --ntasks-per-node=1 tfstrat launch --workers-per-node N -- ..."
            )
        if rank is None:
            node_id = environ.get("SLURM_NODEID")
            if node_id is None:
                raise TFConfigError(
                    "Received: SLURM_NODEID unset. Run tfstrat launch under srun, or give "
                    "--node-rank."
                )
            rank = node_id
        return cls(",".join(hosts), rank, workers_per_node, ps_per_node, port)
