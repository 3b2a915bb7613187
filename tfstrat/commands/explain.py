"""`tfstrat tf-config --explain`: what every task of a TF_CONFIG listens on, and where.

Each task at `host:P` listens on P (TensorFlow's gRPC server, all interfaces) and on P + offset
(`TFSTRAT_PORT_OFFSET`, default 1): tfstrat's ring on a chief or worker, Hybrid's table server
on a ps, bound to the task's own address towards its peers (`tfstrat.cluster.ports`). Where a task's
host is this machine the address is computed here; elsewhere it is described. The last lines
list the ports to open between the job's hosts: a firewall rule or a Kubernetes Service per
task declares exactly these.
"""

from __future__ import annotations

import functools
import socket

from tfstrat.cluster import TFConfig
from tfstrat.cluster import ports as _ports

_TF = "TensorFlow gRPC server"


def explain(config: TFConfig) -> str:
    """The per-task listing and the ports to open, as text.

    Example:
        >>> config = TFConfig.from_hosts(worker=["10.9.0.1:2222", "10.9.0.2:2222"])
        >>> print(explain(config))  # doctest: +ELLIPSIS
        Every task listens on its TF_CONFIG port P and on P + 1 (TFSTRAT_PORT_OFFSET=1).
        ...
        worker:0  10.9.0.1:2222
          2222/tcp  TensorFlow gRPC server  all interfaces (0.0.0.0 and ::)
          2223/tcp  tfstrat ring            10.9.0.1's own address on its route to worker:1 ...
        ...
        Open these ports between the job's hosts only (firewall, or Service ports):
          10.9.0.1  2222-2223/tcp
          10.9.0.2  2222-2223/tcp
    """
    offset = _ports.offset()
    trainers = [
        (f"{job}:{i}", address)
        for job in ("chief", "worker")
        for i, address in enumerate(config.addresses(job))
    ]
    lines = [
        f"Every task listens on its TF_CONFIG port P and on P + {offset} "
        f"(TFSTRAT_PORT_OFFSET={offset}).",
        "TensorFlow's server on P binds all interfaces (TensorFlow has no option for that) and",
        "runs any op it is sent, unauthenticated: let only the job's hosts reach these ports.",
        "",
    ]
    ports: dict[str, list[int]] = {}
    for job in ("chief", "worker", "ps", "evaluator"):
        for i, address in enumerate(config.addresses(job)):
            host, port = _ports.split(address)
            lines.append(f"{job}:{i}  {address}")
            if job == "evaluator":
                lines.append("  (none)    an evaluator runs no server of TensorFlow's or tfstrat's")
                continue
            lines.append(f"  {port}/tcp  {_TF:<22}  all interfaces (0.0.0.0 and ::)")
            if job == "ps":
                peers = trainers
            else:
                rank = trainers.index((f"{job}:{i}", address))
                peers = [trainers[(rank + 1) % len(trainers)], trainers[rank - 1]]
                peers = list(dict.fromkeys(peers))  # one peer twice on a two-worker ring
            lines.append(
                f"  {port + offset}/tcp  {_ports.LISTENERS[job]:<22}  {_bind_text(host, peers, job)}"
            )
            ports.setdefault(host, []).extend([port, port + offset])
    lines += ["", "Open these ports between the job's hosts only (firewall, or Service ports):"]
    width = max(len(h) for h in ports) if ports else 0
    for host, numbers in ports.items():
        lines.append(f"  {host:<{width}}  {' '.join(_ranges(sorted(set(numbers))))}")
    return "\n".join(lines)


def _bind_text(host: str, peers: list[tuple[str, str]], job: str) -> str:
    names = ", ".join(name for name, _ in peers[:3]) + (", ..." if len(peers) > 3 else "")
    others = [address for _, address in peers]
    if _is_here(host):
        bound = _ports.route_source(others) or _ports.wildcard(host)
        return f"{bound} (this machine's address on its route to {names})"
    where = "towards the other workers" if job != "ps" else "towards the workers"
    return (
        f"{host}'s own address on its route to {names} ({where}; all interfaces when it has "
        "no route)"
    )


@functools.lru_cache(maxsize=256)
def _is_here(host: str) -> bool:
    """Whether `host` resolves to an address of this machine (one a socket can bind)."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_DGRAM)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.bind((sockaddr[0], 0))
                return True
        except OSError:
            continue
    return False


def _ranges(numbers: list[int]) -> list[str]:
    """[2222, 2223, 2224, 2230] -> ["2222-2224/tcp", "2230/tcp"]."""
    out: list[str] = []
    start = prev = numbers[0]
    for n in numbers[1:] + [None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        out.append(f"{start}/tcp" if start == prev else f"{start}-{prev}/tcp")
        if n is not None:
            start = prev = n
    return out
