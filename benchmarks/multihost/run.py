"""Throughput across "machines" (network namespaces on a bridge, tfstrat/bench/_netns.py) against the
same cluster on loopback: CollectiveAllReduce and Hybrid on the benchmark models of
`tfstrat bench scaling` (the small ResNet-like CNN) and `tfstrat bench sparse` (a 200,000 x 64
embedding, Zipf ids).

Run as root (it creates network namespaces; nothing is changed in the root namespace):
    .venv/bin/python benchmarks/multihost/run.py --out bench-out/multihost [--steps 20]

Networks, each row measured on every one:
  - loopback:     `tfstrat launch` on 127.0.0.1 (one machine, as the other benchmarks);
  - veth:         one task per namespace, no rate limit (the namespaces' own cost);
  - veth 1gbit:   the same, each host's egress limited by `tc qdisc ... tbf rate 1gbit`
                  (netem is not available in every kernel; tbf is).
A plain TCP stream between two hosts is measured first on each network (the "link" line).
Writes OUT/multihost.md (the table) and OUT/multihost.json (every row).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

PORT = 2222
WORKER = "tfstrat.bench._worker"
ALLREDUCE_WORKER = "tfstrat.bench._allreduce_worker"
ALLREDUCE = {"impl": "tfstrat", "sizes": [2**20, 16 * 2**20], "iters": 10}  # the TCP ring
CNN = {"model": "small", "image": 32, "batch_per_device": 64}  # bench scaling's CPU model
SPARSE = {  # bench sparse's defaults
    "workload": "sparse",
    "vocab": 200_000,
    "dim": 64,
    "seq": 20,
    "classes": 1000,
    "batch_per_device": 64,
}
ROWS = [  # (row, model, strategy label, worker strategy, workload config, ps tasks)
    ("C-cnn", "small CNN", "CollectiveAllReduce", "collective", CNN, 0),
    ("C-sparse", "sparse 200k x 64", "CollectiveAllReduce", "collective", SPARSE, 0),
    ("H-sparse", "sparse 200k x 64", "Hybrid, 1 ps", "hybrid", SPARSE, 1),
    # No model: the all-reduce alone (`tfstrat bench allreduce`'s worker), to show the link.
    ("AR", "all-reduce 1 and 16 MiB", "CollectiveAllReduce", "allreduce", ALLREDUCE, 0),
]


def _sink(port: int) -> None:
    """Accepts one connection and reads it to the end (the far side of the link check)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(1)
    print("ready", flush=True)
    conn, _ = s.accept()
    while conn.recv(1 << 20):
        pass
    conn.close()


def _send(host: str, port: int, megabytes: int) -> None:
    block = b"x" * (1 << 20)
    with socket.create_connection((host, port), timeout=30) as c:
        start = time.perf_counter()
        for _ in range(megabytes):
            c.sendall(block)
        c.shutdown(socket.SHUT_WR)
        c.recv(1)  # the sink closes once it has read everything
        print(f"{megabytes / (time.perf_counter() - start):.1f}")


def link_mb_per_s(net, megabytes: int = 300) -> float:
    """MB/s of one TCP stream from host 0 to host 1."""
    sink = net.start(1, [sys.executable, __file__, "--sink", "5001"], name="sink")
    deadline = time.monotonic() + 30
    while "ready" not in sink.output():
        if time.monotonic() > deadline or sink.proc.poll() is not None:
            raise RuntimeError(net.report([sink]))
        time.sleep(0.05)
    out = net.run(0, [sys.executable, __file__, "--send", net.ipv4(1), "5001", str(megabytes)], 120)
    net.stop(sink)
    return float(out.strip())


def loopback_link_mb_per_s(megabytes: int = 300) -> float:
    import subprocess

    sink = subprocess.Popen([sys.executable, __file__, "--sink", "5001"], stdout=subprocess.PIPE)
    try:
        sink.stdout.readline()
        out = subprocess.run(
            [sys.executable, __file__, "--send", "127.0.0.1", "5001", str(megabytes)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        return float(out.stdout.strip())
    finally:
        sink.kill()
        sink.wait()


def _module(row) -> str:
    return ALLREDUCE_WORKER if row[3] == "allreduce" else WORKER


def _worker_config(row, args) -> dict:
    _, _, _, strategy, workload, _ = row
    if strategy == "allreduce":
        return dict(workload)
    return {
        **workload,
        "strategy": strategy,
        "devices": 1,
        "steps": args.steps,
        "repeats": args.repeats,
        "threads": args.threads,
    }


def run_loopback(row, args) -> dict:
    from tfstrat.bench import _report

    return _report.run_row(
        _module(row),
        _worker_config(row, args),
        workers=args.workers,
        threads=args.threads,
        ps=row[5],
        timeout=args.timeout,
    )


def run_netns(net, row, args) -> dict:
    """Worker i on host i, the ps on the host after them, each started as on its own machine."""
    from netns import TaskError

    ps = row[5]
    cluster = {"worker": [f"{net.ipv4(i)}:{PORT}" for i in range(args.workers)]}
    if ps:
        cluster["ps"] = [f"{net.ipv4(args.workers + j)}:{PORT}" for j in range(ps)]

    def env(task, index):
        threads = str(args.threads)
        return {
            "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task, "index": index}}),
            "TFSTRAT_TASK": f"{task}:{index}",
            "TF_NUM_INTRAOP_THREADS": threads,  # as `tfstrat launch --threads-per-task` does
            "TF_NUM_INTEROP_THREADS": threads,
            "OMP_NUM_THREADS": threads,
            "PYTHONUNBUFFERED": "1",
            "TF_CPP_MIN_LOG_LEVEL": "2",
            # As on two machines: the TCP ring, not the shared memory two workers of one
            # machine would use (memory files cross network namespaces).
            "TFSTRAT_RING_SHARED_MEMORY": "0",
        }

    servers = [
        net.start(
            args.workers + j,
            [sys.executable, "-m", "tfstrat", "server"],
            env("ps", j),
            name=f"ps:{j}",
        )  # fmt: skip
        for j in range(ps)
    ]
    command = [sys.executable, "-m", _module(row), json.dumps(_worker_config(row, args))]
    workers = [
        net.start(i, command, env("worker", i), name=f"worker:{i}") for i in range(args.workers)
    ]
    try:
        net.wait(workers, args.timeout, background=servers)
    except TaskError as e:
        lines = [line for line in str(e).splitlines() if "Error" in line]
        return {"error": (lines[-1] if lines else str(e).splitlines()[0])[-300:]}
    for line in workers[0].output(limit=10**7).splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return {"error": "worker:0 printed no RESULT"}


def table(rows: list[dict], links: dict, args, machine: dict) -> str:
    from tfstrat.bench import _report

    networks = list(links)
    headers = ["row", "model", "strategy", "workers"]
    headers += [f"{n}: ex/s (min-max, load)" for n in networks]
    headers += [
        f"{networks[-1]} / {networks[0]}",
        "bytes/step/worker",
        f"those bytes at 1 Gbit/s (of a {networks[-1]} step)",
    ]
    body = []
    for r in rows:
        cells = [r["row"], r["model"], r["label"], r["workers"]]
        rates = {}
        for n in networks:
            m = r["results"].get(n, {})
            if "sizes" in m:  # the all-reduce row: bus bandwidth per size, 2(n-1)/n x bytes/s
                w = m["workers"]
                bw = [s["bytes"] / s["seconds"] * 2 * (w - 1) / w / 1e6 for s in m["sizes"]]
                rates[n] = bw[-1]
                sizes = ", ".join(
                    f"{s['bytes'] / 2**20:.0f} MiB: {b:,.0f} MB/s" for s, b in zip(m["sizes"], bw)
                )
                cells.append(f"{sizes} (load {m.get('load_before', 0):.1f})")
            elif "examples_per_s" in m:
                rates[n] = m["examples_per_s"]
                load = f", load {m['load_before']:.1f}" if "load_before" in m else ""
                cells.append(
                    f"{m['examples_per_s']:,.0f} "
                    f"({m['examples_per_s_min']:,.0f}-{m['examples_per_s_max']:,.0f}{load})"
                )
            else:
                cells.append(f"failed: {m.get('error', '?')[:100]}")
        a, b = rates.get(networks[-1]), rates.get(networks[0])
        cells.append(f"{a / b:.2f}" if a and b else "-")
        sent = next(
            (m.get("bytes_sent_per_step") for m in r["results"].values() if "examples_per_s" in m),
            None,
        )
        cells.append(f"{sent:,.0f}" if sent else "-")
        # What the bytes alone cost on a 1 Gbit/s link, against the measured step time.
        limited = r["results"].get(networks[-1], {})
        step = 1 / limited["steps_per_s"] if "steps_per_s" in limited else None
        cells.append(
            f"{sent * 8 / 1e9 * 1e3:.1f} ms (of {step * 1e3:.0f} ms)" if sent and step else "-"
        )
        body.append(cells)
    link = ", ".join(f"{n}: {v:,.0f} MB/s" for n, v in links.items())
    return _report.markdown(headers, body) + (
        f"\n\nOne TCP stream between two hosts (the link): {link}. {args.workers} workers, one "
        f"task per namespace (the Hybrid ps on a third), {args.threads} thread(s) in each of "
        f"TensorFlow's pools per task; median of {args.repeats} timed epochs of {args.steps} "
        "steps after a warm-up epoch. Bytes/step/worker: what tfstrat hands its collectives per "
        "step, plus (Hybrid) worker 0's traffic to the ps. Row AR: no model, the median time "
        "of one all-reduce of 1 and 16 MiB over tfstrat's TCP ring (`tfstrat bench allreduce`'s "
        "worker), as bus bandwidth (nccl-tests' busbw: 2(n-1)/n x bytes / time). Machine: "
        f"{machine.get('cpus')} CPUs, TensorFlow {machine.get('tensorflow')}, Keras "
        f"{machine.get('keras')}; every task of every network shares these cores. Load: the "
        "1-minute load average when the measurement started (other jobs on the machine)."
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench-out/multihost")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rate", default="1gbit", help="tc tbf rate of the limited network")
    parser.add_argument("--rows", default=",".join(r[0] for r in ROWS))
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--sink", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--send", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--render", metavar="JSON", help="print the table of an earlier run")
    args = parser.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            saved = json.load(f)
        for key in ("workers", "threads", "steps", "repeats"):
            setattr(args, key, saved.get("args", {}).get(key, getattr(args, key)))
        print(table(saved["rows"], saved["links_mb_per_s"], args, saved["machine"]))
        return 0
    if args.sink:
        _sink(args.sink)
        return 0
    if args.send:
        _send(args.send[0], int(args.send[1]), int(args.send[2]))
        return 0

    from tfstrat.bench import _netns as netns
    from tfstrat.bench import _report

    try:
        netns.check_available()
    except netns.Unavailable as e:
        print(f"benchmarks/multihost: {e}", file=sys.stderr)
        return 2
    machine = _report.machine()
    wanted = args.rows.split(",")
    rows = [
        {"row": r[0], "model": r[1], "label": r[2], "workers": args.workers, "results": {}}
        for r in ROWS
        if r[0] in wanted
    ]
    specs = {r[0]: r for r in ROWS}
    hosts = args.workers + max(r[5] for r in ROWS)
    with contextlib.ExitStack() as stack:
        # Both networks at once (distinct prefixes), and each row measured on the three
        # networks back to back: the other load on the machine drifts less within a row.
        nets = {
            "veth": stack.enter_context(netns.Network(hosts, prefix=f"tfs{os.getpid()}a")),
            f"veth {args.rate}": stack.enter_context(
                netns.Network(hosts, rate=args.rate, prefix=f"tfs{os.getpid()}b")
            ),
        }
        links = {"loopback": loopback_link_mb_per_s()}
        links.update((name, link_mb_per_s(net)) for name, net in nets.items())
        print("link MB/s", links, flush=True)
        measure(rows, specs, nets, links, args, _speed)
    write(args.out, "multihost", table(rows, links, args, machine), links, rows, machine, args)
    return 0


def measure(rows, specs, nets, links, args, describe) -> None:
    """Runs every row on every network of `links` ("loopback" or a name in `nets`), one row's
    networks back to back, into `row["results"][network]`; prints `describe(result)`."""
    for row in rows:
        for name in links:
            load = os.getloadavg()[0]
            if name == "loopback":
                result = run_loopback(specs[row["row"]], args)
            else:
                result = run_netns(nets[name], specs[row["row"]], args)
            result["load_before"] = load
            row["results"][name] = result
            print(row["row"], name, describe(result), f"(load {load:.1f})", flush=True)


def write(out_dir, name, text, links, rows, machine, args) -> None:
    """OUT_DIR/NAME.md (the table `text`) and OUT_DIR/NAME.json (everything measured)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(
            {"links_mb_per_s": links, "rows": rows, "machine": machine, "args": vars(args)},
            f,
            indent=1,
        )
    print(text)


def _speed(result: dict) -> str:
    if "sizes" in result:
        return ", ".join(f"{s['bytes']} B in {s['seconds'] * 1e3:.1f} ms" for s in result["sizes"])
    if "examples_per_s" in result:
        return f"{result['examples_per_s']:,.0f} ex/s (median of {len(result['epoch_s'])})"
    return f"failed: {result.get('error')}"


if __name__ == "__main__":
    sys.exit(main())
