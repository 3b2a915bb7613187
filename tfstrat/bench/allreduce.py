"""`tfstrat bench allreduce`: latency and bandwidth of all-reduce between local processes.

nccl-tests conventions: algbw = bytes / time; busbw = algbw x 2(n-1)/n, the rate each link
carries in a ring. A loopback TCP stream measured in the same run is the ceiling.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from tfstrat.bench import _report

logger = logging.getLogger(__name__)
WORKER = "tfstrat.bench._allreduce_worker"
DEFAULT_SIZES = tuple(4 * 16**k for k in range(7))  # 4 B .. 64 MiB


@dataclasses.dataclass(frozen=True)
class AllReduceConfig:
    workers: int = 2
    sizes: Sequence[int] = DEFAULT_SIZES
    iters: int = 30
    peer: bool = True
    out: str = "bench-out"


_RECEIVER = """
import socket, sys
s = socket.create_server(("127.0.0.1", 0)); print(s.getsockname()[1], flush=True)
c, _ = s.accept(); buf = bytearray(1 << 20); total = 0
while (n := c.recv_into(buf)):
    total += n
c.sendall(b"k")
"""


def tcp_ceiling(total_bytes: int = 512 * 2**20) -> float:
    """Bytes/s of one loopback TCP stream from this process to another."""
    receiver = subprocess.Popen(
        [sys.executable, "-c", _RECEIVER], stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(receiver.stdout.readline())
        chunk = b"\0" * (4 << 20)
        with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
            start = time.perf_counter()
            for _ in range(total_bytes // len(chunk)):
                conn.sendall(chunk)
            conn.shutdown(socket.SHUT_WR)
            conn.recv(1)
            return total_bytes / (time.perf_counter() - start)
    finally:
        receiver.kill()
        receiver.wait()


def run(config: AllReduceConfig) -> list[dict]:
    machine = _report.machine()
    impls = ["tfstrat", "tfstrat-grpc"] + (["stock"] if config.peer else [])
    measured = {}
    for impl in impls:
        worker_config = {"impl": impl, "sizes": list(config.sizes), "iters": config.iters}
        result = _report.run_row(WORKER, worker_config, workers=config.workers, threads=1)
        measured[impl] = {s["bytes"]: s["seconds"] for s in result.get("sizes", [])}
        logger.info("allreduce %s: %s", impl, result.get("error", "done"))
    ceiling = tcp_ceiling()
    n = config.workers
    rows = []
    for size in config.sizes:
        row = {"bytes": size, "workers": n, "tcp_GBps": ceiling / 1e9, "machine": machine}
        for impl in impls:
            seconds = measured[impl].get(size)
            if seconds:
                algbw = size / seconds / 1e9
                row[f"{impl}_ms"] = seconds * 1e3
                row[f"{impl}_algbw_GBps"] = algbw
                row[f"{impl}_busbw_GBps"] = algbw * 2 * (n - 1) / n
        rows.append(row)
    _report.write(config.out, "allreduce", rows, table(rows, impls, ceiling), _plot(impls))
    return rows


def _size(b: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:g} {unit}"
    return f"{b} B"


def table(rows, impls, ceiling) -> str:
    headers = ["size"]
    for impl in impls:
        headers += [f"{impl} ms", f"{impl} busbw GB/s"]
    body = []
    for r in rows:
        line = [_size(r["bytes"])]
        for impl in impls:
            if f"{impl}_ms" in r:
                line += [f"{r[f'{impl}_ms']:.2f}", f"{r[f'{impl}_busbw_GBps']:.3g}"]
            else:
                line += ["failed", "-"]
        body.append(line)
    m = rows[0]["machine"] if rows else {}
    n = rows[0]["workers"] if rows else 2
    return (
        _report.markdown(headers, body)
        + f"\n\n{n} worker processes on 127.0.0.1, one thread in each TensorFlow pool; median "
        "of the timed iterations; algbw = busbw x n / (2(n-1)) is in the JSON. tfstrat: "
        "CollectiveAllReduce's default on CPU workers, its TCP ring; tfstrat-grpc: "
        "`communication='ring'`, TensorFlow's collectives under tfstrat's wrapper; stock: "
        f"MultiWorkerMirroredStrategy. One loopback TCP stream: {ceiling / 1e9:.2f} GB/s. "
        f"Machine: {m.get('cpus')} CPUs, TensorFlow {m.get('tensorflow')}."
    )


def _plot(impls):
    def plot(ax, rows):
        for impl in impls:
            pts = [(r["bytes"], r[f"{impl}_busbw_GBps"]) for r in rows if f"{impl}_ms" in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{impl} busbw")
        if rows:
            ax.axhline(rows[0]["tcp_GBps"], color="gray", linestyle="--", label="loopback TCP")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("bytes per all-reduce")
        ax.set_ylabel("GB/s")
        ax.legend()
        ax.set_title("tfstrat bench allreduce")

    return plot
