"""`tfstrat bench cluster`: tfstrat's collectives on an emulated cluster of 2-16 hosts.

Each host is a network namespace of this machine (`tfstrat.bench._netns`: veth pairs on one
bridge, the link shaped in both directions by `tc tbf`, each process with its host's hostname),
so the bytes really cross a link of the given rate, and no two hosts share memory (the ring's
shared-memory path is off: `TFSTRAT_RING_SHARED_MEMORY=0`). Needs root.

Rows, for every host count N and link (and the same hosts unshaped: the machine's own limit,
which two CPUs set at a few hundred MB/s in total):
- **ring**: tfstrat's TCP ring called directly (`Ring.all_reduce`, no TensorFlow,
  `_cluster_ring`), float32 SUM, sizes 4 B to 64 MiB: median seconds per call and bus bandwidth
  (NCCL's measure: 2(N-1)/N x size / time, which a link-bound ring holds at the link rate
  whatever N), as a share of the link. Beside each, the bytes the ring says it sent and what the
  hosts' interfaces counted.
- **model**: an alpha-beta model fitted on the smallest N's ring row of each link (a call of S
  bytes over N hosts takes 2(N-1) x alpha + 2(N-1)/N x S x beta; two hosts exchange in one round:
  alpha + S x beta), and its prediction for every row, so the table says where measurement and
  model part.

Peers (OpenMPI's `Allreduce`, stock `MultiWorkerMirroredStrategy`, `ParameterServerStrategy`)
and training rows are not part of this benchmark yet; a row says so rather than leaving them
out silently.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys

from tfstrat.bench import _netns

logger = logging.getLogger(__name__)
SIZES = [4, 1 << 10, 1 << 16, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [4, 1 << 16, 1 << 20, 4 << 20]
PORT = 29500


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    hosts: tuple[int, ...] = (2, 4)
    link: str = "1gbit"
    sizes: tuple[int, ...] = tuple(SIZES)
    iters: int = 20
    seconds: float = 5.0  # per size: fewer calls (at least 3) once this has passed
    unshaped: bool = True  # also each N unshaped: the machine's own limit
    timeout: float = 120.0
    out: str = "bench-out"


def machine() -> dict:
    from tfstrat.bench._report import cpu_name

    return {"cpu": cpu_name(), "cpus": os.cpu_count()}


def ring_row(net: _netns.Network, config: ClusterConfig) -> dict:
    """tfstrat's ring on every host of `net`, one process each; the row of its results."""
    n = net.hosts
    addresses = [f"{net.ipv4(i)}:{PORT}" for i in range(n)]
    before = net.counters()
    tasks = []
    for i in range(n):
        worker = {"rank": i, "addresses": addresses, "sizes": list(config.sizes),
                  "iters": config.iters, "seconds": config.seconds, "timeout": config.timeout}  # fmt: skip
        argv = [sys.executable, "-m", "tfstrat.bench._cluster_ring", json.dumps(worker)]
        env = {"TFSTRAT_RING_SHARED_MEMORY": "0", "PYTHONPATH": _package_root()}
        tasks.append(net.start(i, argv, env=env, name=f"ring:{i}"))
    budget = config.timeout + len(config.sizes) * (config.seconds + 30) * 2
    net.wait(tasks, timeout=budget)
    moved = _netns.counters_delta(before, net.counters())
    results = [_result(t) for t in tasks]
    first = results[0]
    sizes = []
    for k, entry in enumerate(first["sizes"]):
        # a call ends when the slowest host has its sum: the slowest median
        seconds = max(r["sizes"][k]["seconds"] for r in results)
        sizes.append({"bytes": entry["bytes"], "seconds": seconds, "calls": entry["calls"],
                      "bus_bytes_per_s": bus_bytes(entry["bytes"], n) / seconds})  # fmt: skip
    return {
        "impl": "tfstrat ring",
        "hosts": n,
        "link": net.rate,
        "sizes": sizes,
        "ring_bytes_sent": [r["ring_bytes_sent"] for r in results],
        "interface_bytes": moved,
    }


def _package_root() -> str:
    import tfstrat

    return os.path.dirname(os.path.dirname(os.path.abspath(tfstrat.__file__)))


def _result(task: _netns.Task) -> dict:
    text = task.output(limit=1 << 20)
    found = [line for line in text.splitlines() if line.startswith("RESULT ")]
    if not found:
        raise _netns.TaskError(f"{task.name} printed no RESULT line:\n{text[-3000:]}")
    return json.loads(found[-1][len("RESULT ") :])


def bus_bytes(size: int, hosts: int) -> float:
    """The bytes a ring all-reduce of `size` moves per host: 2(N-1)/N x size (NCCL's bus
    bandwidth counts these)."""
    return 2 * (hosts - 1) / hosts * size


def model_terms(size: int, hosts: int) -> tuple[float, float]:
    """(latency steps, bytes on the wire per host) of one call: tfstrat's two hosts exchange
    in one round; N >= 3 run the ring's 2(N-1) steps of size/N each."""
    if hosts == 2:
        return 1.0, float(size)
    return 2.0 * (hosts - 1), bus_bytes(size, hosts)


def fit(row: dict) -> dict:
    """alpha (s) and beta (s per byte) fitted by least squares on a ring row's sizes."""
    import numpy as np

    terms = np.array([model_terms(s["bytes"], row["hosts"]) for s in row["sizes"]])
    seconds = np.array([s["seconds"] for s in row["sizes"]])
    # weighted by 1/time: small and large calls count alike
    weights = 1.0 / seconds
    (alpha, beta), *_ = np.linalg.lstsq(terms * weights[:, None], seconds * weights, rcond=None)
    return {"alpha_s": float(alpha), "beta_s_per_byte": float(beta), "hosts": row["hosts"]}


def predict(model: dict, size: int, hosts: int) -> float:
    steps, wire = model_terms(size, hosts)
    return steps * model["alpha_s"] + wire * model["beta_s_per_byte"]


def run(config: ClusterConfig) -> list[dict]:
    _netns.check_available()
    for h in config.hosts:
        if not 2 <= h <= 16:
            raise ValueError(f"Received: --hosts {h}. Use 2 to 16 (16 processes at most here).")
    rows = []
    for hosts in config.hosts:
        for link in ([None] if config.unshaped else []) + [config.link]:
            with _netns.Network(hosts, rate=link, hostnames=True) as net:
                logger.info("cluster: %d hosts, link %s", hosts, link or "unshaped")
                row = ring_row(net, config)
                row["machine"] = machine()
                rows.append(row)
    models = {}
    for row in sorted(rows, key=lambda r: r["hosts"]):
        models.setdefault(row["link"], fit(row))
    for row in rows:
        model = models[row["link"]]
        row["model"] = model
        for s in row["sizes"]:
            s["predicted_seconds"] = predict(model, s["bytes"], row["hosts"])
    from tfstrat.bench import _report

    _report.write(config.out, "cluster", rows, table(rows, config), _plot)
    return rows


def _size(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def table(rows: list[dict], config: ClusterConfig) -> str:
    from tfstrat.bench._report import markdown

    headers = ["hosts", "link", "size", "ms per call", "bus MB/s", "of the link",
               "model ms", "measured / model"]  # fmt: skip
    body = []
    for row in rows:
        rate = _netns.rate_bits(row["link"]) / 8 if row["link"] else None
        for s in row["sizes"]:
            body.append([
                row["hosts"], row["link"] or "unshaped", _size(s["bytes"]),
                f"{s['seconds'] * 1e3:.3f}", f"{s['bus_bytes_per_s'] / 1e6:.1f}",
                f"{s['bus_bytes_per_s'] / rate:.0%}" if rate else "-",
                f"{s['predicted_seconds'] * 1e3:.3f}",
                f"{s['seconds'] / s['predicted_seconds']:.2f}",
            ])  # fmt: skip
    lines = [markdown(headers, body), ""]
    for row in rows:
        ring = sum(row["ring_bytes_sent"])
        wire = sum(h["tx"] for h in row["interface_bytes"])
        m = row["model"]
        lines.append(
            f"- {row['hosts']} hosts, {row['link'] or 'unshaped'}: the ring says it sent "
            f"{ring / 1e6:.1f} MB, the hosts' interfaces sent {wire / 1e6:.1f} MB "
            f"({wire / ring:.3f}x: TCP/IP headers and handshakes); model fitted on "
            f"{m['hosts']} hosts: alpha {m['alpha_s'] * 1e6:.0f} us, "
            f"1/beta {1 / m['beta_s_per_byte'] / 1e6:.0f} MB/s."
        )
    mach = rows[0]["machine"] if rows else {}
    lines.append(
        f"\ntfstrat's TCP ring (`Ring.all_reduce`, no TensorFlow), float32 SUM; each host a "
        f"network namespace of one machine ({mach.get('cpu')}, {mach.get('cpus')} CPUs) on "
        "a bridge, its link shaped both ways by tc tbf (no delay emulated); no shared memory "
        "between hosts. ms per call: the slowest host's median. Bus MB/s: 2(N-1)/N x size / "
        "time. 'unshaped': the same hosts without a rate, the machine's own limit. Model: "
        "alpha-beta, fitted per link on the smallest host count. OpenMPI, stock TensorFlow "
        "and training rows: not measured by this version of the benchmark."
    )
    return "\n".join(lines)


def _plot(ax, rows):
    for row in rows:
        xs = [s["bytes"] for s in row["sizes"]]
        ys = [s["bus_bytes_per_s"] / 1e6 for s in row["sizes"]]
        ax.plot(xs, ys, marker="o", label=f"{row['hosts']} hosts, {row['link'] or 'unshaped'}")
    ax.set_xscale("log")
    ax.set_xlabel("bytes per all-reduce")
    ax.set_ylabel("bus MB/s")
    ax.legend()
    ax.set_title("tfstrat bench cluster: the ring on emulated hosts")
