"""`tfstrat bench allreduce`: latency and bandwidth of all-reduce between local processes.

nccl-tests conventions: algbw = bytes / time; busbw = algbw x 2(n-1)/n, the rate each link
carries in a ring. The machine's own limits are measured in the same run:
- the latency floor: a traced step whose only op is a no-op `numpy_function` (what any
  Python-side collective pays to be called from TensorFlow), plus a 4-byte ping-pong between
  two Python processes over loopback TCP (the least an exchange between two workers waits);
- the bandwidth limits: two loopback TCP streams at once, one each way, between two processes
  (what an all-reduce between two workers on two machines moves), and one stream alone; and
  for two workers on one machine, which exchange through shared memory, the memory copy: two
  processes each copying the size into shared memory at once.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from tfstrat.bench import _report
from tfstrat.reduce import shared_memory

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


_PEER = """
import socket, sys, threading
s = socket.create_server(("127.0.0.1", 0)); print(s.getsockname()[1], flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
mode, size, rounds = c.recv(64).decode().split()
size, rounds = int(size), int(rounds)
buf, data = bytearray(size), b"x" * size
def drain():
    view, got = memoryview(buf), 0
    while got < size:
        got += c.recv_into(view[got:])
if mode == "copy":
    import mmap
    import numpy as np
    src, dst = np.ones(size, np.uint8), np.frombuffer(mmap.mmap(-1, size), np.uint8)
for _ in range(rounds):
    if mode == "pingpong":
        drain(); c.sendall(data)
    elif mode == "copy":  # on the go byte, copy, then say so
        c.recv(1); np.copyto(dst, src); c.sendall(b"k")
    else:  # both ways at once: send while receiving
        t = threading.Thread(target=c.sendall, args=(data,)); t.start(); drain(); t.join()
"""


def _with_peer(mode: str, size: int, rounds: int, body) -> list[float]:
    """Runs `body(conn, size)` `rounds` times against a peer process doing `mode`; returns the
    seconds of each round."""
    peer = subprocess.Popen([sys.executable, "-c", _PEER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(peer.stdout.readline())
        with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(f"{mode} {size} {rounds}".ljust(64).encode())
            seconds = []
            for _ in range(rounds):
                start = time.perf_counter()
                body(conn, size)
                seconds.append(time.perf_counter() - start)
            return seconds
    finally:
        peer.kill()
        peer.wait()


def _receive(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        got += conn.recv_into(view[got:])


def ping_pong_seconds(rounds: int = 2000) -> float:
    """Median round trip of 4 bytes between this process and another over loopback TCP."""

    view = memoryview(bytearray(4))

    def body(conn, size):
        conn.sendall(b"xxxx")
        _receive(conn, view)

    return statistics.median(_with_peer("pingpong", 4, rounds, body))


def two_streams_rate(size: int, rounds: int = 10) -> float:
    """Bytes/s each way when two processes send each other `size` bytes at once (median)."""

    data, view = b"x" * size, memoryview(bytearray(size))  # allocated once, as the ring's

    def body(conn, size):
        t = threading.Thread(target=conn.sendall, args=(data,))
        t.start()
        _receive(conn, view)
        t.join()

    return size / statistics.median(_with_peer("both", size, rounds, body))


def memory_copy_rate(size: int, rounds: int = 20) -> float:
    """Bytes/s of copying `size` bytes into shared memory while another process does the same
    (median round: both copies and a one-byte round trip)."""
    import mmap

    import numpy as np

    src, dst = np.ones(size, np.uint8), np.frombuffer(mmap.mmap(-1, size), np.uint8)
    done = bytearray(1)

    def body(conn, size):
        conn.sendall(b"g")
        np.copyto(dst, src)
        _receive(conn, memoryview(done))

    return size / statistics.median(_with_peer("copy", size, rounds, body))


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
    impls = ["tfstrat", "tfstrat-tcp", "tfstrat-grpc"] + (["stock"] if config.peer else [])
    measured, empty_step = {}, None
    for impl in impls:
        worker_config = {"impl": impl, "sizes": list(config.sizes), "iters": config.iters}
        # tfstrat-tcp: the ring as between two machines (no shared memory)
        env = {shared_memory.ENV: "0"} if impl == "tfstrat-tcp" else None
        result = _report.run_row(WORKER, worker_config, workers=config.workers, threads=1, env=env)
        measured[impl] = {s["bytes"]: s["seconds"] for s in result.get("sizes", [])}
        empty_step = empty_step or result.get("empty_step_s")
        logger.info("allreduce %s: %s", impl, result.get("error", "done"))
    ceiling = tcp_ceiling()
    ping = ping_pong_seconds()
    floor = ping + (empty_step or 0.0)
    n = config.workers
    rows = []
    for size in config.sizes:
        row = {
            "bytes": size,
            "workers": n,
            "tcp_GBps": ceiling / 1e9,
            "two_streams_GBps": two_streams_rate(size) / 1e9 if size >= 2**16 else None,
            "memory_copy_GBps": memory_copy_rate(size) / 1e9 if size >= 2**16 else None,
            "ping_pong_ms": ping * 1e3,
            "empty_step_ms": (empty_step or 0.0) * 1e3,
            "floor_ms": floor * 1e3,
            "machine": machine,
        }
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
    headers += ["floor ms", "two streams GB/s", "memory copy GB/s", "tfstrat / limit"]
    body = []
    for r in rows:
        line = [_size(r["bytes"])]
        for impl in impls:
            if f"{impl}_ms" in r:
                line += [f"{r[f'{impl}_ms']:.3f}", f"{r[f'{impl}_busbw_GBps']:.3g}"]
            else:
                line += ["failed", "-"]
        line.append(f"{r['floor_ms']:.3f}")
        two, copy = r.get("two_streams_GBps"), r.get("memory_copy_GBps")
        line.append(f"{two:.3g}" if two else "-")
        line.append(f"{copy:.3g}" if copy else "-")
        if "tfstrat_ms" not in r:
            line.append("-")
        elif two:  # bandwidth-bound: each transport against its limit
            tcp = r.get("tfstrat-tcp_busbw_GBps")
            bus = r["tfstrat_busbw_GBps"]
            if r["workers"] == 2 and copy:  # shared memory: two workers on one machine
                line.append(
                    f"{bus / copy:.0%} of a memory copy"
                    + (f"; tcp: {tcp / two:.0%} of two streams" if tcp else "")
                )
            else:  # 3+ workers: the ring over TCP
                line.append(f"{bus / two:.0%} of two streams")
        else:  # latency-bound: the time against the floor
            line.append(f"{r['tfstrat_ms'] / r['floor_ms']:.1f}x the floor")
        body.append(line)
    m = rows[0]["machine"] if rows else {}
    n = rows[0]["workers"] if rows else 2
    first = rows[0] if rows else {}
    return (
        _report.markdown(headers, body)
        + f"\n\n{n} worker processes on 127.0.0.1, one thread in each TensorFlow pool; median "
        "of the timed iterations of a traced step holding one all-reduce; algbw = busbw x n / "
        "(2(n-1)) is in the JSON. tfstrat: CollectiveAllReduce's default on CPU workers, its "
        "own ring (here: shared memory, the header over TCP); tfstrat-tcp: the same over TCP "
        "alone, as between two machines; tfstrat-grpc: `communication='ring'`, TensorFlow's collectives under "
        "tfstrat's wrapper; stock: MultiWorkerMirroredStrategy. The machine's limits, measured "
        f"in the same run: floor = a traced step with one no-op numpy_function "
        f"({first.get('empty_step_ms', 0):.3f} ms) + a 4-byte ping-pong between two processes "
        f"({first.get('ping_pong_ms', 0):.3f} ms); two streams = two processes sending each "
        "other the size at once over loopback TCP, the rate each way (the limit between two "
        "machines); memory copy = two processes each copying the size into shared memory at "
        "once (two workers on one machine exchange through shared memory: each copies its "
        "message in, and sums from the other's); one stream alone: "
        f"{ceiling / 1e9:.2f} GB/s. Machine: {m.get('cpu')}, {m.get('cpus')} CPUs, TensorFlow "
        f"{m.get('tensorflow')}."
    )


def _plot(impls):
    def plot(ax, rows):
        for impl in impls:
            pts = [(r["bytes"], r[f"{impl}_busbw_GBps"]) for r in rows if f"{impl}_ms" in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{impl} busbw")
        two = [(r["bytes"], r["two_streams_GBps"]) for r in rows if r.get("two_streams_GBps")]
        if two:
            ax.plot(*zip(*two), color="gray", linestyle="--", label="two TCP streams (limit)")
        copy = [(r["bytes"], r["memory_copy_GBps"]) for r in rows if r.get("memory_copy_GBps")]
        if copy:
            ax.plot(*zip(*copy), color="black", linestyle=":", label="memory copy (limit)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("bytes per all-reduce")
        ax.set_ylabel("GB/s")
        ax.legend()
        ax.set_title("tfstrat bench allreduce")

    return plot
