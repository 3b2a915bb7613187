"""One host's process of `tfstrat bench cluster`'s ring rows: tfstrat's TCP ring called
directly (`Ring.all_reduce`, no TensorFlow), float32 SUM all-reduces of many sizes.

    python -m tfstrat.bench._cluster_ring '{"rank": 0, "addresses": ["10.77.0.1:29500", ...],
        "sizes": [4, 1048576], "iters": 20, "seconds": 5, "timeout": 60}'

Each size runs 2 warm-up calls, then `iters` timed calls, or fewer (at least 3) when the first
three say `seconds` would not hold them (the hosts agree on the count through the ring). Prints `RESULT {json}`: per size the median seconds of a call, and the bytes this
process sent through the ring over the whole run (the ring's own count, headers included),
which the caller compares with what the host's interface counted.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

KEY = b"tfstrat bench cluster"


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
                r.all_reduce(x)
            seconds, calls = [], int(config["iters"])
            while len(seconds) < calls:
                begin = time.perf_counter()
                y = r.all_reduce(x)
                seconds.append(time.perf_counter() - begin)
                if len(seconds) == 3:  # how many fit `seconds`: the hosts agree on the fewest
                    fit = int(float(config["seconds"]) / max(statistics.median(seconds), 1e-9))
                    wanted = np.array([max(3, min(calls, fit))], np.int64)
                    calls = int(r.all_gather(wanted).min())
            if float(y[-1]) != len(addresses):  # a sum of ones: one per host
                raise SystemExit(f"host {rank}: the sum of {size} bytes of ones ended in {y[-1]}")
            results.append({"bytes": int(size), "seconds": statistics.median(seconds),
                            "calls": len(seconds)})  # fmt: skip
    finally:
        sent = r.bytes_sent
        r.close()
    return {"rank": rank, "hosts": len(addresses), "sizes": results, "ring_bytes_sent": sent}


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
