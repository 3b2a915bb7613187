"""`tfstrat bench cluster`'s ps rows: how many embedding rows one ps task serves a second.

One ps host runs Hybrid's table server (`tfstrat.ps.tables`, no TensorFlow); K client hosts
each play a Hybrid worker's share of a step against it, in lockstep as Hybrid's workers are:
look up `ids` unique rows of a `rows` x `dim` table (a step's lookup waits until the previous
step's pushes are applied), then push a gradient for each (SGD; the table applies a step once
all K pushed). Client 0 reads the ps process's CPU seconds (`Registry.cpu`) before and after
the timed steps, so a row says both what K workers got and what a row costs the ps:

    rows/s          K x ids x timed steps / client 0's wall time for them
    ps CPU share    the ps's CPU seconds over that time / the wall time (1.0: a whole core)
    rows per ps CPU second: what one ps core serves, whatever the clients' share of the CPUs

    python -m tfstrat.bench._cluster_ps '{"role": "ps", "address": "10.77.0.1:29700"}'
    python -m tfstrat.bench._cluster_ps '{"role": "client", "rank": 0, "clients": 4,
        "address": "10.77.0.1:29700", "rows": 200000, "dim": 64, "ids": 1024, "steps": 200,
        "warmup": 20, "timeout": 120}'

A client prints `RESULT {json}`; the ps serves until it is killed.
"""

from __future__ import annotations

import json
import sys
import time

from tfstrat.bench import _netns

PORT = 29700
SECRET = "tfstrat bench cluster ps\n"


def serve(config: dict) -> None:
    from tfstrat.cluster import ports
    from tfstrat.ps import tables

    host, port = ports.split(config["address"])
    tables.serve_tables(host, port, "ps:0")
    print("SERVING", flush=True)
    while True:
        time.sleep(3600)


def client(config: dict) -> dict:
    import numpy as np

    from tfstrat.ps import tables, wire

    rank, k = int(config["rank"]), int(config["clients"])
    rows, dim, ids = int(config["rows"]), int(config["dim"]), int(config["ids"])
    warmup, steps = int(config["warmup"]), int(config["steps"])
    conn = wire.Connection(config["address"], float(config["timeout"]), "ps:0")

    def call(method, *arrays):
        conn.send(method, *arrays)
        return conn.receive(method)

    spec = np.frombuffer(json.dumps({"zeros": True}).encode(), np.uint8)
    call("create", *np.array([0, rows, dim, k], np.int64), spec)  # idempotent: every client
    hyper = np.zeros(tables.HYPER, np.float64)
    hyper[1] = 0.01  # SGD (kind 0), learning rate 0.01
    rng = np.random.default_rng(rank)
    grads = rng.standard_normal((ids, dim)).astype(np.float32).reshape(-1)
    table, weight, replica = np.int64(0), np.float32(ids), np.int64(rank)
    cpu = wall = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            cpu = -float(call("cpu")[0]) if rank == 0 else 0.0
            wall = -time.perf_counter()
        chosen = np.unique(rng.integers(0, rows, 2 * ids))[:ids]  # unique, as Hybrid's are
        got = call("lookup", table, chosen, np.int64(step))[0]
        if got.size != chosen.size * dim:
            raise SystemExit(f"client {rank}: {got.size} values for {chosen.size} rows")
        call("push", table, np.int64(step), chosen, grads[: chosen.size * dim], hyper,
             weight, replica)  # fmt: skip
    wall += time.perf_counter()
    if rank == 0:
        cpu += float(call("cpu")[0])
    conn.close()
    return {"rank": rank, "seconds": wall, "rows": steps * ids, "ps_cpu_s": cpu}


def run(net, clients: int, *, config: dict, timeout: float, package_root: str) -> dict:
    """The ps on host 0 and `clients` clients on hosts 1..clients of `net`; the row."""
    import os
    import tempfile

    secret = os.path.join(tempfile.mkdtemp(prefix="tfstrat-ps-bench-"), "secret")
    with open(secret, "w") as f:
        f.write(SECRET)
    env = {"PYTHONPATH": package_root, "PYTHONUNBUFFERED": "1", "TFSTRAT_SECRET_FILE": secret}
    address = f"{net.ipv4(0)}:{PORT}"
    before = net.counters()
    argv = [sys.executable, "-m", "tfstrat.bench._cluster_ps"]
    ps = net.start(0, [*argv, json.dumps({"role": "ps", "address": address})], env=env,
                   name="ps:0")  # fmt: skip
    tasks = [
        net.start(
            1 + i,
            [
                *argv,
                json.dumps(
                    {
                        **config,
                        "role": "client",
                        "rank": i,
                        "clients": clients,
                        "address": address,
                        "timeout": timeout,
                    }
                ),
            ],
            env=env,
            name=f"client:{i}",
        )  # fmt: skip
        for i in range(clients)
    ]
    net.wait(tasks, timeout=timeout + 60, background=[ps])
    moved = net.counters()
    results = [_netns.result(t) for t in tasks]
    first = results[0]
    served = sum(r["rows"] for r in results)
    return {
        "impl": "ps capacity",
        "clients": clients,
        "hosts": net.hosts,
        "link": net.rate,
        "rows": int(config["rows"]),
        "dim": int(config["dim"]),
        "ids": int(config["ids"]),
        "steps": int(config["steps"]),
        "seconds": first["seconds"],
        "rows_per_s": served / first["seconds"],
        "ps_cpu_share": first["ps_cpu_s"] / first["seconds"],
        "rows_per_ps_cpu_s": served / max(first["ps_cpu_s"], 1e-9),
        "ps_interface_bytes": _netns.counters_delta(before, moved)[0],  # the ps host's, whole run
    }


if __name__ == "__main__":
    settings = json.loads(sys.argv[1])
    if settings["role"] == "ps":
        serve(settings)
    else:
        print("RESULT " + json.dumps(client(settings)), flush=True)
