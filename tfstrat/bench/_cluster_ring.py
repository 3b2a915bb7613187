"""One host's process of `tfstrat bench cluster`'s ring rows: tfstrat's TCP ring called
directly (`Ring.exchange`, no TensorFlow), float32 SUM all-reduces of many sizes: the sum
lands in one of the ring's buffers, as a training step's does (and as OpenMPI's `Allreduce`
fills the caller's), not in a copy as `Ring.all_reduce` returns it.

    python -m tfstrat.bench._cluster_ring '{"rank": 0, "addresses": ["10.77.0.1:29500", ...],
        "sizes": [4, 1048576], "iters": 20, "seconds": 5, "timeout": 60}'

Each size runs 2 warm-up calls, then `iters` timed calls, more for quick calls (up to 2,000, as
many as fill half a second), or fewer (at least 3) when the first three say `seconds` would not
hold them (`timed_calls`; the hosts agree on the count through the ring). Prints
`RESULT {json}`: per size the median seconds of a call, and the bytes this process sent
through the ring over the whole run (the ring's own count, headers included),
which the caller compares with what the host's interface counted.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

KEY = b"tfstrat bench cluster"
QUICK_SECONDS, MAX_CALLS = 0.5, 2000


def main(config: dict) -> dict:
    import numpy as np

    from tfstrat.reduce import ring

    rank, addresses = int(config["rank"]), list(config["addresses"])
    host, port = addresses[rank].rsplit(":", 1)
    listener = ring.listen(host, int(port), f"host {rank}")
    names = [f"host {i}" for i in range(len(addresses))]
    r = ring.Ring(rank, addresses, listener, float(config["timeout"]), names, key=KEY)
    results = []
    try:
        for size in config["sizes"]:
            x = np.ones(max(1, int(size) // 4), np.float32)
            for _ in range(2):
                r.exchange(x, [])
            seconds, calls = [], int(config["iters"])
            while len(seconds) < calls:
                begin = time.perf_counter()
                y = r.exchange(x, [])[0]
                seconds.append(time.perf_counter() - begin)
                if len(seconds) == 3:  # how many: the hosts agree on the fewest
                    wanted = np.array([timed_calls(config, seconds)], np.int64)
                    calls = int(r.all_gather(wanted).min())
            if float(y[-1]) != len(addresses):  # a sum of ones: one per host
                raise SystemExit(f"host {rank}: the sum of {size} bytes of ones ended in {y[-1]}")
            results.append({"bytes": int(size), "seconds": statistics.median(seconds),
                            "calls": len(seconds)})  # fmt: skip
        sent = r.bytes_sent
        between = _between_hosts(r)
        streamed = None
        if float(config.get("stream_seconds") or 0) > 0:
            r.all_reduce(np.ones(1, np.float32))  # every host ready, as near at once as it gets
            streamed = streams(rank, addresses, float(config["stream_seconds"]))
    finally:
        r.close()
    return {"rank": rank, "hosts": len(addresses), "sizes": results, "ring_bytes_sent": sent,
            "between_hosts_bytes": between, "levels": r.levels is not None,
            "stream_bytes_per_s": streamed}  # fmt: skip


def timed_calls(config: dict, first: list[float]) -> int:
    """How many calls to time, from the first three's seconds: `iters`, or more for quick
    calls (as many as fill `QUICK_SECONDS`, at most `MAX_CALLS`: a few microseconds' calls
    need thousands for a steady median), or fewer (at least 3) where `seconds` would not hold
    them."""
    call = max(statistics.median(first), 1e-9)
    quick = min(MAX_CALLS, int(min(QUICK_SECONDS, float(config["seconds"])) / call))
    return max(3, min(max(int(config["iters"]), quick), int(float(config["seconds"]) / call)))


def _between_hosts(r) -> int:
    """Of the bytes `r` sent, those that left this host: the flat ring's when the next worker
    is on another host, and all of the two-level exchange's ring across the hosts."""
    from tfstrat.cluster import ports

    host = lambda i: ports.split(r.addresses[i % r.size])[0]  # noqa: E731
    if r.levels is None:
        return r.bytes_sent if host(r.rank + 1) != host(r.rank) else 0
    local, across = r.levels
    a = across.bytes_sent if across else 0
    flat = r.bytes_sent - a - (local.bytes_sent if local else 0)  # its own calls (the start's)
    return a + (flat if host(r.rank + 1) != host(r.rank) else 0)


def streams(rank: int, addresses: list[str], seconds: float) -> float:
    """Every host sends to the next one plain TCP for `seconds` while it receives from the
    previous (no collective, no Python between the bytes but a loop of sendall): what the
    emulated links carry all at once. Returns the bytes per second this host received, after
    its first half second (slow start)."""
    import socket
    import threading

    host, port = addresses[rank].rsplit(":", 1)
    listener = socket.create_server((host, int(port) + 1))
    nxt_host, nxt_port = addresses[(rank + 1) % len(addresses)].rsplit(":", 1)
    block = b"x" * (1 << 20)

    def send() -> None:
        deadline = time.monotonic() + 30
        while True:
            try:
                out = socket.create_connection((nxt_host, int(nxt_port) + 1), timeout=30)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        end = time.monotonic() + seconds + 1.0
        with out:
            try:
                while time.monotonic() < end:
                    out.sendall(block)
            except OSError:  # the receiver has counted enough and closed
                pass

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    conn, _ = listener.accept()
    start, begin, got = time.monotonic(), None, 0
    buf = bytearray(1 << 20)
    with conn:
        while True:
            n = conn.recv_into(buf)
            now = time.monotonic()
            if begin is None and now - start >= 0.5:
                begin, got = now, 0
            got += n
            if not n or (begin is not None and now - begin >= seconds):
                break
    if begin is None or now <= begin:
        raise SystemExit(f"host {rank}: the stream from the previous host ended within 0.5 s")
    rate = got / (now - begin)
    sender.join(timeout=seconds + 30)
    listener.close()
    return rate


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
