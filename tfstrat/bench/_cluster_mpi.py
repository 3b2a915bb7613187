"""One rank of `tfstrat bench cluster`'s OpenMPI rows: mpi4py's `Allreduce` (float32 SUM) of
the same sizes as the ring rows, timed the same way (2 warm-up calls, then as many as
`_cluster_ring.timed_calls` says; the ranks agree on the count).

    mpirun ... python -m tfstrat.bench._cluster_mpi '{"sizes": [4, 1048576], "iters": 20,
        "seconds": 5}'

Rank 0 prints `RESULT {json}`: per size the slowest rank's median seconds.
"""

from __future__ import annotations

import json
import statistics
import sys
import time


def main(config: dict) -> dict | None:
    import numpy as np
    from mpi4py import MPI

    from tfstrat.bench._cluster_ring import timed_calls

    comm = MPI.COMM_WORLD
    results = []
    for size in config["sizes"]:
        x = np.ones(max(1, int(size) // 4), np.float32)
        y = np.empty_like(x)
        for _ in range(2):
            comm.Allreduce(x, y, op=MPI.SUM)
        seconds, calls = [], int(config["iters"])
        while len(seconds) < calls:
            begin = time.perf_counter()
            comm.Allreduce(x, y, op=MPI.SUM)
            seconds.append(time.perf_counter() - begin)
            if len(seconds) == 3:
                calls = comm.allreduce(timed_calls(config, seconds), op=MPI.MIN)
        if float(y[-1]) != comm.Get_size():
            raise SystemExit(f"rank {comm.Get_rank()}: the sum of ones ended in {y[-1]}")
        slowest = comm.allreduce(statistics.median(seconds), op=MPI.MAX)
        results.append({"bytes": int(size), "seconds": slowest, "calls": len(seconds)})
    if comm.Get_rank() != 0:
        return None
    return {"hosts": comm.Get_size(), "sizes": results, "mpi": MPI.Get_library_version().strip()}


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    if result is not None:
        print("RESULT " + json.dumps(result), flush=True)
