"""The plan of a multi-node cluster for `tfstrat launch --nodes` (torchrun's `--nnodes/--node-rank`).

Every node's launcher is started with the same arguments and builds the same TF_CONFIG from
them; it then starts only its own node's tasks. On node k, its workers come first, then its ps
tasks, at ports P, P + 2, P + 4, ... of its host, where P is the node's own port when its entry
says `host:port`, else `--port`. The port above each task's, P + 1 (`TFSTRAT_PORT_OFFSET`), is
its tfstrat port, so the ports step by offset + 1. Workers are numbered node
by node, the first node's first, and so are ps tasks: worker:0, which TensorFlow and Keras
treat as the chief when the cluster has no chief task, runs on the first node.

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from tfstrat.cluster import ports
from tfstrat.cluster.hosts import MAX_TASKS, check_address, expand_nodelist, show
from tfstrat.cluster.ports import is_ipv6, join
from tfstrat.errors import TFConfigError

DEFAULT_PORT = 12345  # as TFConfig.from_slurm and from_hostfile
_ITEM = re.compile(r"(?:[^,\[]|\[[^\]]*\])+")  # commas inside brackets do not split


@dataclasses.dataclass(frozen=True)
class Node:
    """One node of a layout: its host, its rank, and its tasks with their addresses."""

    rank: int
    host: str
    port: int  # its first task's port
    tasks: tuple[tuple[str, int, str], ...]  # (task type, index, "host:port")

    @property
    def where(self) -> str:
        """ "node 1 (host)" for reports."""
        return f"node {self.rank} ({self.host})"


def parse_nodes(
    nodes: str | Sequence[str], what: str = "nodes"
) -> tuple[tuple[str, int | None], ...]:
    """(host, port or None) per node from `a,b:2300,[fd00::1]:2222,node[01-03]`.

    Hosts may use SLURM's hostlist syntax (`node[01-03,07]`), IPv6 addresses go in brackets
    when a port follows, and `host:port` gives that node its own first port (two launchers on
    one host need different ports: TensorFlow's server binds its port on every interface).
    """
    items = [nodes] if isinstance(nodes, str) else list(nodes)
    if not all(isinstance(i, str) for i in items):
        raise TFConfigError(f"Received: {what}={show(nodes)}. Give host names, e.g. 'a,b'.")
    parsed: list[tuple[str, int | None]] = []
    for text in items:
        found = _ITEM.findall(text.replace(" ", ""))
        if not found or ",".join(found) != text.replace(" ", ""):
            raise TFConfigError(
                f"Received: {what}={show(text)}. List the nodes separated by commas, e.g. "
                "'node1,node2', 'node[01-04]', '10.0.0.1:2222,10.0.0.2:2222' or '[fd00::1],[fd00::2]'."
            )
        for item in found:
            parsed += _parse_item(item, what)
            if len(parsed) > MAX_TASKS:
                raise TFConfigError(
                    f"Received: {what}={show(text)}. List at most {MAX_TASKS} nodes."
                )
    return tuple(parsed)


def _parse_item(item: str, what: str) -> list[tuple[str, int | None]]:
    bad = TFConfigError(
        f"Received: {item!r} in {what}. Write a node as 'host', 'host:port', 'node[01-03]', "
        "'fd00::1' or '[fd00::1]:port'."
    )
    if item.startswith("["):
        match = re.fullmatch(r"\[([0-9A-Fa-f:.%\w]+)\](?::([0-9]{1,5}))?", item)
        if not match or not is_ipv6(match[1]):
            raise bad
        return [(match[1], int(match[2]) if match[2] else None)]
    if item.count(":") > 1:
        if not is_ipv6(item):
            raise bad
        return [(item, None)]
    host, sep, port = item.partition(":")
    if sep and not re.fullmatch(r"[0-9]{1,5}", port) or not host:
        raise bad
    if sep and not 1 <= int(port) <= 65535:
        raise TFConfigError(
            f"Received: {item!r} in {what}. Port {int(port)} is out of range; use 1..65535."
        )
    return [(h, int(port) if sep else None) for h in expand_nodelist(what, host)]


def _counts(name: str, value: int | str | Sequence[int], nodes: int) -> tuple[int, ...]:
    """One task count per node from 2, "2", or "2,2,0" / [2, 2, 0]."""
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",")]
        if not all(re.fullmatch(r"[0-9]{1,6}", p) for p in parts):
            raise TFConfigError(
                f"Received: {name}={value!r}. Give a count (2) or one count per node (2,2,0)."
            )
        value = int(parts[0]) if len(parts) == 1 else [int(p) for p in parts]
    if isinstance(value, bool):
        value = [-1]
    if isinstance(value, int):
        value = [value] * nodes
    counts = tuple(value)
    if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
        raise TFConfigError(f"Received: {name}={show(value)}. Counts are whole numbers >= 0.")
    if len(counts) != nodes:
        raise TFConfigError(
            f"Received: {name}={','.join(map(str, counts))} for {nodes} nodes. Give one count "
            f"for every node, or a single count for all."
        )
    return counts


def plan(
    nodes: str | Sequence[str],
    workers_per_node: int | str | Sequence[int] = 1,
    ps_per_node: int | str | Sequence[int] = 0,
    port: int = DEFAULT_PORT,
) -> tuple[Node, ...]:
    """Every node's tasks and addresses (the layout described in this module's docstring).

    Raises:
        TFConfigError: a malformed node list or count, no worker at all, a node with no task,
            ports past 65535, or two nodes on one host whose ports overlap.
    """
    entries = parse_nodes(nodes)
    if not entries:
        raise TFConfigError("Received: nodes=''. List the nodes, e.g. --nodes node1,node2.")
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise TFConfigError(f"Received: port={show(port)}. Use a port in 1..65535.")
    workers = _counts("workers_per_node", workers_per_node, len(entries))
    ps = _counts("ps_per_node", ps_per_node, len(entries))
    if sum(workers) == 0:
        raise TFConfigError(
            f"Received: workers_per_node={','.join(map(str, workers))}. Put at least one worker "
            "on some node."
        )
    step = ports.offset() + 1
    result: list[Node] = []
    index = {"worker": 0, "ps": 0}
    for rank, (host, own_port) in enumerate(entries):
        base = own_port or port
        jobs = ["worker"] * workers[rank] + ["ps"] * ps[rank]
        if not jobs:
            raise TFConfigError(
                f"Received: node {rank} ({host}) with 0 workers and 0 ps tasks. Give it a task "
                "in --workers-per-node / --ps-per-node, or leave it out of --nodes."
            )
        last = base + step * (len(jobs) - 1) + ports.offset()
        if last > 65535:
            raise TFConfigError(
                f"Received: node {rank} ({host}) with {len(jobs)} tasks from port {base}. Its "
                f"last tfstrat port would be {last} > 65535; give it a lower port."
            )
        tasks = []
        for j, job in enumerate(jobs):
            address = join(host, base + step * j)
            check_address(f"nodes[{rank}]", address)
            tasks.append((job, index[job], address))
            index[job] += 1
        result.append(Node(rank, host, base, tuple(tasks)))
    _check_overlaps(result, step)
    return tuple(result)


def _check_overlaps(nodes: Sequence[Node], step: int) -> None:
    """Two nodes on one host must not share a port (task or tfstrat port)."""
    spans: dict[str, list[tuple[int, int, Node]]] = {}
    for node in nodes:
        spans.setdefault(node.host, []).append(
            (node.port, node.port + step * len(node.tasks), node)
        )
    for host, ranges in spans.items():
        ranges.sort(key=lambda r: r[0])
        for (_, end, a), (start, _, b) in zip(ranges, ranges[1:]):
            if start < end:
                raise TFConfigError(
                    f"Received: nodes {a.rank} and {b.rank} both on {host}, from ports "
                    f"{a.port} and {b.port}: node {a.rank}'s tasks use ports {a.port}..{end - 1}"
                    " (each task its port and the one above). Give each entry its own range, e.g. "
                    f"--nodes {join(host, a.port)},{join(host, a.port + 100)}."
                )
