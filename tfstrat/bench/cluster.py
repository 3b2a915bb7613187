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
  alpha + S x beta; a vector of 1 KiB or less goes around whole: (N-1) x (alpha + S x beta)),
  and its prediction for every row, so the table says where measurement and model part.

- **OpenMPI**: the same sizes with OpenMPI's `Allreduce` (mpi4py, `--mca btl tcp,self`;
  `mpirun` in host 0's namespace, the other ranks started through an rsh agent that enters
  theirs), when `mpirun` and mpi4py are installed; else a row says what to install.

- **streams**: after the ring's calls, plain TCP from every host to the next, all at once, for
  a few seconds: what the shaped links carry together on this machine (at 8-16 hosts two CPUs
  shaping every packet carry less than the links' rates: the limit a shaped row is read against).
- **launchers** (`_cluster_launch`): N `tfstrat launch --nodes` launchers, one task each (no
  TensorFlow); one task fails and the launchers must agree on attempt 1: how long that takes.
- **training** (`_cluster_train`): Keras `fit` of a link-bound MLP, CollectiveAllReduce
  against stock `MultiWorkerMirroredStrategy`; and of a sparse model with a dense part, Hybrid
  against tfstrat's ParameterServer and stock `ParameterServerStrategy` (tf-keras) with 1-2 ps
  tasks; examples/s, the busiest host's bytes a step, and (dense) the model's prediction.
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
PARTS = ("ring", "flat", "launchers", "ps", "dense", "sparse")


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    hosts: tuple[int, ...] = (2, 4)
    link: str = "1gbit"
    sizes: tuple[int, ...] = tuple(SIZES)
    iters: int = 20
    seconds: float = 5.0  # per size: fewer calls (at least 3) once this has passed
    unshaped: bool = True  # also each N unshaped: the machine's own limit
    # After the ring's calls, every host streams plain TCP to the next for this long: what the
    # emulated links carry all at once (the limit of a shaped row: 0 for none)
    stream_seconds: float = 3.0
    # Ring processes per host (2+: host-contiguous ranks, as `tfstrat launch --nodes` orders
    # workers; their local hops stay inside the host, unshaped; no streams row)
    workers_per_host: int = 1
    peers: bool = True  # also OpenMPI's rows
    timeout: float = 120.0
    out: str = "bench-out"
    # What to measure: "ring" (tfstrat's ring, and OpenMPI's with `peers`), "flat" (with
    # "ring": also the same workers in one plain ring, `TFSTRAT_RING_FLAT=1`; always with 2+
    # workers per host), "launchers" (`_cluster_launch`), "ps" (`_cluster_ps`: the rows one
    # ps serves, 1-8 clients, unshaped), "dense" and "sparse" (`_cluster_train`'s training rows).
    parts: tuple[str, ...] = ("ring", "launchers", "dense", "sparse")
    ps: tuple[int, ...] = (1, 2)  # the sparse rows' ps tasks
    train_steps: int = 10  # per timed epoch, after a warm-up epoch
    train_repeats: int = 2  # timed epochs
    train_rows: tuple[str, ...] = ()  # only these row ids (all: empty)
    train_timeout: float = 900.0
    ps_clients: int = 8  # the ps rows: 1, 2, 4, 8 clients up to this
    ps_steps: int = 1000  # the ps rows' timed steps (and 50 to warm up)


def machine() -> dict:
    from tfstrat.bench._report import cpu_name

    return {"cpu": cpu_name(), "cpus": os.cpu_count()}


def ring_row(net: _netns.Network, config: ClusterConfig, flat: bool = False) -> dict:
    """tfstrat's ring on every host of `net`, `workers_per_host` processes each (with 2+: by
    default the two-level exchange; `flat`: one plain ring of them all, no recursive doubling
    for small vectors either); its row."""
    n = net.hosts * config.workers_per_host  # the ring's size
    before = net.counters()
    results = _ring_tasks(net, config, list(config.sizes), 0.0, flat)
    levels = config.workers_per_host > 1 and not flat
    if any(r["levels"] != levels for r in results):
        raise RuntimeError(f"two levels on {[r['levels'] for r in results]}: expected {levels}")
    moved = _netns.counters_delta(before, net.counters())
    streams = None
    if config.stream_seconds > 0 and config.workers_per_host == 1:  # apart: counters above
        rates = [
            r["stream_bytes_per_s"] for r in _ring_tasks(net, config, [], config.stream_seconds)
        ]
        streams = {"min": min(rates), "median": sorted(rates)[len(rates) // 2]}
    first = results[0]
    sizes = []
    for k, entry in enumerate(first["sizes"]):
        # a call ends when the slowest host has its sum: the slowest median
        seconds = max(r["sizes"][k]["seconds"] for r in results)
        sizes.append({"bytes": entry["bytes"], "seconds": seconds, "calls": entry["calls"],
                      "bus_bytes_per_s": bus_bytes(entry["bytes"], n) / seconds})  # fmt: skip
    return {
        "impl": "tfstrat ring (flat)" if flat else "tfstrat ring",
        "hosts": net.hosts,
        "workers": n,
        "link": net.rate,
        "sizes": sizes,
        "ring_bytes_sent": [r["ring_bytes_sent"] for r in results],
        "between_hosts_bytes": [r["between_hosts_bytes"] for r in results],
        "interface_bytes": moved,
        "stream_bytes_per_s": streams,
    }


def _ring_tasks(
    net: _netns.Network, config: ClusterConfig, sizes: list, streams: float, flat: bool = False
) -> list:
    """`_cluster_ring` on every host (its calls of `sizes`, then `streams` seconds of plain
    TCP streams; `flat`: `TFSTRAT_RING_FLAT=1`, one plain ring); every host's result. The
    hosts' addresses differ, so two workers share memory only within a host."""
    k = config.workers_per_host
    addresses = [f"{net.ipv4(i // k)}:{PORT + 2 * (i % k)}" for i in range(net.hosts * k)]
    tasks = []
    for i in range(net.hosts * k):
        worker = {"rank": i, "addresses": addresses, "sizes": sizes, "iters": config.iters,
                  "seconds": config.seconds, "timeout": config.timeout,
                  "stream_seconds": streams}  # fmt: skip
        argv = [sys.executable, "-m", "tfstrat.bench._cluster_ring", json.dumps(worker)]
        env = {"PYTHONPATH": _package_root(), **({"TFSTRAT_RING_FLAT": "1"} if flat else {})}
        tasks.append(net.start(i // k, argv, env=env, name=f"ring:{i}"))
    budget = config.timeout + len(sizes) * (config.seconds + 30) * 2 + streams + 60
    net.wait(tasks, timeout=budget)
    return [_netns.result(t) for t in tasks]


MPI_MISSING = (
    "OpenMPI's Allreduce not run: {what} not found. Install it: apt-get install -y openmpi-bin "
    "libopenmpi-dev; pip install 'tfstrat[bench]' (mpi4py)"
)


def mpi_row(net: _netns.Network, config: ClusterConfig) -> dict:
    """OpenMPI's `Allreduce` (mpi4py) on the same hosts, TCP only: `mpirun` in host 0's
    namespace, the other ranks started through an rsh agent that enters their namespaces."""
    import importlib.util
    import shutil
    import tempfile

    k = config.workers_per_host
    row = {"impl": "OpenMPI Allreduce", "hosts": net.hosts, "workers": net.hosts * k,
           "link": net.rate}  # fmt: skip
    mpirun = shutil.which("mpirun")
    missing = [w for w, ok in (("mpirun", mpirun), ("mpi4py", importlib.util.find_spec("mpi4py")))
               if not ok]  # fmt: skip
    if missing:
        row["error"] = MPI_MISSING.format(what=" and ".join(missing))
        return row
    agent = os.path.join(tempfile.mkdtemp(prefix="tfstrat-mpi-"), "rsh")
    with open(agent, "w") as f:  # `agent HOST COMMAND...`: HOST is node<i>, namespace <prefix>h<i>
        f.write(
            '#!/bin/sh\nhost="$1"; shift\n'
            f'exec {_netns.IP} netns exec "{net.prefix}h${{host#node}}" '
            f'{_netns.UNSHARE} --uts sh -c "hostname $host; $*"\n'
        )
    os.chmod(agent, 0o755)
    worker = {"sizes": list(config.sizes), "iters": config.iters, "seconds": config.seconds}
    argv = [
        mpirun, "--allow-run-as-root", "-np", str(net.hosts * k),
        "--host", ",".join(f"{name}:{k}" for name in net.names),
        # every "node" is this machine: bound by default, each would take core 0
        "--bind-to", "none",
        "--mca", "plm_rsh_agent", agent, "--mca", "plm_rsh_no_tree_spawn", "1",
        "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "eth0",
        "--mca", "oob_tcp_if_include", "eth0",
        # more hosts than cores: ranks that busy-poll would take turns by the scheduler's slice
        *(["--mca", "mpi_yield_when_idle", "1"] if net.hosts * k > (os.cpu_count() or 1) else []),
        "-x", "PYTHONPATH", "-x", "PATH",
        sys.executable, "-m", "tfstrat.bench._cluster_mpi", json.dumps(worker),
    ]  # fmt: skip
    env = {"PYTHONPATH": _package_root(), "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}  # fmt: skip
    before = net.counters()
    task = net.start(0, argv, env=env, name="mpirun")
    try:
        net.wait([task], timeout=config.timeout + len(config.sizes) * (config.seconds + 30) * 2)
    except _netns.TaskError as e:
        row["error"] = f"mpirun failed: {str(e)[-600:]}"
        return row
    row["interface_bytes"] = _netns.counters_delta(before, net.counters())
    result = _netns.result(task)
    row["mpi"] = result["mpi"].splitlines()[0].rstrip("\x00 ")  # MPI's string ends in a NUL
    row["sizes"] = [
        {**s, "bus_bytes_per_s": bus_bytes(s["bytes"], net.hosts * k) / s["seconds"]}
        for s in result["sizes"]
    ]
    return row


def _package_root() -> str:
    import tfstrat

    return os.path.dirname(os.path.dirname(os.path.abspath(tfstrat.__file__)))


def bus_bytes(size: int, hosts: int) -> float:
    """The bytes a ring all-reduce of `size` moves per host: 2(N-1)/N x size (NCCL's bus
    bandwidth counts these)."""
    return 2 * (hosts - 1) / hosts * size


def model_terms(size: int, hosts: int, plain: bool = False) -> tuple[float, float]:
    """(latency steps, bytes on the wire per host) of one call: tfstrat's two hosts exchange
    in one round; N >= 3 run the ring's 2(N-1) steps of size/N each, or, for a vector of at
    most 1 KiB, recursive doubling's log2 P rounds (P the largest power of two <= N; two more
    when N > P: `Ring._doubling`) of the whole vector; `plain` (`TFSTRAT_RING_FLAT=1`): N-1
    steps of it around the ring (`Ring._ring_small`)."""
    from tfstrat.reduce.ring import _SMALL_VECTOR

    if hosts == 2:
        return 1.0, float(size)
    if size <= _SMALL_VECTOR and plain:
        return float(hosts - 1), float((hosts - 1) * size)
    if size <= _SMALL_VECTOR:
        big = 1 << (hosts.bit_length() - 1)
        rounds = big.bit_length() - 1 + (2 if hosts > big else 0)
        return float(rounds), float(rounds * size)
    return 2.0 * (hosts - 1), bus_bytes(size, hosts)


def fit(row: dict) -> dict:
    """alpha (s) and beta (s per byte) fitted by least squares on a ring row's sizes (its
    smallest, and 1 MiB and up)."""
    import numpy as np

    # The smallest call (latency) and the calls of 1 MiB and up: a shaped link lets a burst
    # (about 1 ms at its rate) through at full speed, which smaller calls would read as bandwidth.
    sizes = [s for s in row["sizes"] if s["bytes"] == row["sizes"][0]["bytes"] or
             s["bytes"] >= 1 << 20]  # fmt: skip
    sizes = sizes if len(sizes) > 1 else row["sizes"]  # no call of 1 MiB: every size
    plain = "flat" in row["impl"]
    terms = np.array([model_terms(s["bytes"], row["workers"], plain) for s in sizes])
    seconds = np.array([s["seconds"] for s in sizes])
    # weighted by 1/time: small and large calls count alike
    weights = 1.0 / seconds
    (alpha, beta), *_ = np.linalg.lstsq(terms * weights[:, None], seconds * weights, rcond=None)
    if alpha < 0:  # large calls alone say little of the latency: none, not a negative one
        alpha = 0.0
        wire, target = terms[:, 1] * weights, seconds * weights
        beta = float(wire @ target / (wire @ wire))
    return {"alpha_s": float(alpha), "beta_s_per_byte": float(beta), "hosts": row["workers"]}


def predict(model: dict, size: int, hosts: int, plain: bool = False) -> float:
    steps, wire = model_terms(size, hosts, plain)
    return steps * model["alpha_s"] + wire * model["beta_s_per_byte"]


def run(config: ClusterConfig) -> list[dict]:
    _netns.check_available()
    for h in config.hosts:
        if not 2 <= h <= 16:
            raise ValueError(f"Received: --hosts {h}. Use 2 to 16 (16 processes at most here).")
    if not 1 <= config.workers_per_host <= 4 or max(config.hosts) * config.workers_per_host > 16:
        raise ValueError(
            f"Received: --workers-per-host {config.workers_per_host} with --hosts "
            f"{','.join(map(str, config.hosts))}. Use 1-4, at most 16 processes in all."
        )
    unknown = set(config.parts) - set(PARTS)
    if unknown:
        raise ValueError(f"Received: parts {sorted(unknown)}. Use some of {', '.join(PARTS)}.")
    rows = []
    for hosts in config.hosts if "ring" in config.parts else ():
        for link in ([None] if config.unshaped else []) + [config.link]:
            with _netns.Network(hosts, rate=link, hostnames=True) as net:
                logger.info("cluster: %d hosts, link %s", hosts, link or "unshaped")
                measured = [ring_row(net, config)]
                if config.workers_per_host > 1 or "flat" in config.parts:  # one plain ring
                    measured.append(ring_row(net, config, flat=True))
                if config.peers:
                    measured.append(mpi_row(net, config))
                for row in measured:
                    row["machine"] = machine()
                    rows.append(row)
    models = {}
    rings = [r for r in rows if r["impl"] == "tfstrat ring"]
    for row in sorted(rings, key=lambda r: r["workers"]):
        models.setdefault(row["link"], fit(row))
    for row in rows:
        if "error" in row:
            continue
        model = models[row["link"]]
        row["model"] = model
        for s in row["sizes"]:
            s["predicted_seconds"] = predict(model, s["bytes"], row["workers"],
                                             "flat" in row["impl"])  # fmt: skip
    launched = launchers(config) if "launchers" in config.parts else []
    served = ps_rows(config) if "ps" in config.parts else []
    trained = train(config, models)
    from tfstrat.bench import _report

    tables = [
        table(rows, config) if rows else "",
        launch_table(launched),
        ps_table(served),
        train_table(trained, config),
    ]
    text = "\n\n".join(t for t in tables if t)
    _report.write(config.out, "cluster", rows + launched + served + trained, text, _plot)
    return rows + launched + served + trained


def launchers(config: ClusterConfig) -> list[dict]:
    """`_cluster_launch`'s row at every host count, under the link."""
    from tfstrat.bench import _cluster_launch

    out = []
    for hosts in config.hosts:
        with _netns.Network(hosts, rate=config.link, hostnames=True) as net:
            logger.info("cluster: %d launchers, link %s", hosts, config.link)
            row = _cluster_launch.run(net, timeout=config.train_timeout,
                                      package_root=_package_root())  # fmt: skip
        out.append({"impl": "launchers", "link": config.link, "machine": machine(), **row})
        logger.info("cluster: %d launchers: %s", hosts, row)
    return out


PS_CLIENTS = (1, 2, 4, 8)


def ps_rows(config: ClusterConfig) -> list[dict]:
    """`_cluster_ps`'s rows: one ps and 1, 2, 4, 8 clients (at most 15), unshaped: what a ps
    costs per row, which the link does not change."""
    from tfstrat.bench import _cluster_ps

    work = dict(rows=200_000, dim=64, ids=1024, steps=config.ps_steps, warmup=50)
    out = []
    for clients in [k for k in PS_CLIENTS if k <= config.ps_clients]:
        with _netns.Network(clients + 1, rate=None, hostnames=True) as net:
            logger.info("cluster: one ps, %d clients, unshaped", clients)
            row = _cluster_ps.run(net, clients, config=work, timeout=config.timeout,
                                  package_root=_package_root())  # fmt: skip
        out.append({**row, "machine": machine()})
        logger.info("cluster: ps, %d clients: %.0f rows/s", clients, row["rows_per_s"])
    return out


def ps_table(rows: list[dict]) -> str:
    from tfstrat.bench._report import markdown

    if not rows:
        return ""
    body = [[r["clients"], f"{r['rows_per_s']:,.0f}",
             f"{r['rows_per_s'] * r['dim'] * 4 / 1e6:.0f}", f"{r['ps_cpu_share']:.2f}",
             f"{r['rows_per_ps_cpu_s']:,.0f}"] for r in rows]  # fmt: skip
    first, mach = rows[0], rows[0]["machine"]
    return markdown(
        [
            "clients",
            "rows/s served",
            "MB/s each way at the ps",
            "ps CPU share",
            "rows per ps CPU second",
        ],
        body,
    ) + (  # fmt: skip
        f"\n\nOne ps task's table server (`tfstrat.ps.tables`, no TensorFlow) and K clients, each "
        f"a host of its own, unshaped; each client a Hybrid worker's share of a step in lockstep: "
        f"a lookup of {first['ids']} unique rows of a {first['rows']:,} x {first['dim']} float32 "
        f"table, then a push of their gradients (SGD); {first['steps']} timed steps. ps CPU "
        "share: the ps process's CPU seconds over the timed steps / their wall time (1.0: one "
        "core). Rows per ps CPU second: what one ps core serves. Machine: "
        f"{mach.get('cpu')}, {mach.get('cpus')} CPUs shared by the ps and the clients."
    )


def launch_table(rows: list[dict]) -> str:
    from tfstrat.bench._report import markdown

    if not rows:
        return ""
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["hosts"], r["link"], f"failed: {r['error'][:160]}", "-", "-", "-"])
            continue
        body.append([r["hosts"], r["link"], f"{r['launch_s']:.1f}",
                     f"{r['attempt0_spread_s']:.2f}", f"{r['agreement_s']:.1f}",
                     f"{r['attempt1_spread_s']:.2f}"])  # fmt: skip
    grace = next((r["grace_s"] for r in rows if "grace_s" in r), "?")
    return markdown(
        [
            "launchers",
            "link",
            "launch s",
            "attempt 0 spread s",
            "agreement s",
            "attempt 1 spread s",
        ],
        body,
    ) + (  # fmt: skip
        "\n\n`tfstrat launch --nodes ... --restarts 1` on every host, one toy task each (no "
        "TensorFlow); the last node's task fails 3 s into attempt 0. Launch: from the "
        "launchers started to the last attempt-0 task started. Agreement: from the failure to "
        "the last attempt-1 task started on all the nodes (every launcher stops its task, "
        f"with a grace of {grace} s, and meets the others at the rendezvous). Spread: first "
        "to last task start of an attempt."
    )


def train(config: ClusterConfig, models: dict) -> list[dict]:
    """The training rows (`_cluster_train`), each on its own hosts, under the link (and
    unshaped first, with `config.unshaped`); dense rows get the ring model's prediction."""
    from tfstrat.bench import _cluster_train as ct

    kinds = tuple(p for p in config.parts if p in ct.KINDS)
    plan = ct.rows(config.hosts, config.ps, kinds, config.workers_per_host)
    if config.train_rows:
        plan = [r for r in plan if r.id in config.train_rows]
    out = []
    for row in plan:
        for link in ([None] if config.unshaped else []) + [config.link]:
            with _netns.Network(row.hosts, rate=link, hostnames=True) as net:
                logger.info("cluster: %s (%s), link %s", row.id, row.label, link or "unshaped")
                result = ct.run_row(net, row, steps=config.train_steps,
                                    repeats=config.train_repeats, timeout=config.train_timeout,
                                    package_root=_package_root())  # fmt: skip
            entry = {"impl": "training", **dataclasses.asdict(row), "hosts": row.hosts,
                     "link": link, "machine": machine(), **result}  # fmt: skip
            logger.info("cluster: %s: %s", row.id, _speed(entry))
            out.append(entry)
    for entry in out:  # the dense rows: compute (unshaped, less its all-reduce) + the all-reduce
        if entry["workload"] != "dense" or "error" in entry or entry["link"] not in models:
            continue
        if entry["per_host"] > 1:  # the model is the flat ring's, one worker a host
            continue
        base = next((e for e in out if e["id"] == entry["id"] and e["link"] is None
                     and "error" not in e), None)  # fmt: skip
        if base is None or None not in models:
            continue
        n = entry["workers"]
        compute = 1 / base["steps_per_s"] - predict(models[None], ct.DENSE_BYTES, n)
        step = max(compute, 0.0) + predict(models[entry["link"]], ct.DENSE_BYTES, n)
        entry["predicted_examples_per_s"] = entry["global_batch"] / step
    return out


def _speed(entry: dict) -> str:
    if "error" in entry:
        return f"failed: {entry['error']}"
    return f"{entry['examples_per_s']:,.0f} ex/s"


def _startup(r: dict) -> str:
    if r.get("startup_s") is None:
        return "-"
    cpu = r.get("startup_cpu_s")
    return f"{r['startup_s']:.1f}" + (f" ({cpu:.1f} CPU)" if cpu is not None else "")


def train_table(rows: list[dict], config: ClusterConfig) -> str:
    from tfstrat.bench import _cluster_train as ct
    from tfstrat.bench._report import markdown

    if not rows:
        return ""

    headers = ["row", "model", "strategy", "workers", "ps", "link", "examples/s (min-max)",
               "against", "start-up s", "first epoch s", "busiest host MB/step", "link share",
               "model ex/s"]  # fmt: skip
    peers = {"D-CAR": ["D-MWMS"], "S-H": ["S-SPS", "S-PS"]}
    body = []
    for r in rows:
        rate = _netns.rate_bits(r["link"]) / 8 if r["link"] else None
        cells = [r["id"], r["workload"], r["label"], r["workers"], r["ps"], r["link"] or "unshaped"]
        if "error" in r:
            body.append(cells + [f"failed: {r['error'][:120]}"] + ["-"] * 6)
            continue
        against = []
        kind, _, tail = r["id"].partition("-")
        kind = f"{kind}-{tail.split('-')[0]}"
        for peer in peers.get(kind, []):
            other = next((o for o in rows if o["id"] == r["id"].replace(kind, peer)
                          and o["link"] == r["link"] and "error" not in o), None)  # fmt: skip
            if other:
                against.append(f"{r['examples_per_s'] / other['examples_per_s']:.2f}x {peer}")
        share = ct.link_share(r, rate)
        step_bytes = r["busiest_bytes_per_example"] * r["global_batch"]
        predicted = r.get("predicted_examples_per_s")
        cells += [
            f"{r['examples_per_s']:,.0f} ({r['examples_per_s_min']:,.0f}-"
            f"{r['examples_per_s_max']:,.0f})",
            ", ".join(against) or "-",
            _startup(r),
            f"{r['warmup_s']:.1f}",
            f"{step_bytes / 1e6:.2f}",
            f"{share:.0%}" if share is not None else "-",
            f"{predicted:,.0f}" if predicted else "-",
        ]
        body.append(cells)
    mach = rows[0]["machine"] if rows else {}
    return markdown(headers, body) + (
        "\n\nTraining rows: Keras `fit` (`tfstrat.bench._worker`), one task per host (a row "
        "named HxK: K per host, host by host), 1 thread "
        "in each of TensorFlow's pools, the BFC CPU allocator for every row (stock ones too); "
        f"{config.train_repeats} timed epochs of {config.train_steps} steps after a warm-up "
        "epoch, median. Dense: a 1.84M-weight MLP (7.4 MB of gradients a step), 64 examples "
        "per worker a step. Sparse: a 200,000 x 64 table (Zipf ids) and 0.57M dense weights, 64 "
        "examples per worker a step; stock ParameterServerStrategy is asynchronous (its "
        "examples/s: every worker's steps), its coordinator on one more host; tfstrat's "
        "ParameterServer is synchronous. Busiest host MB/step: the most one host's interface "
        "sent or received in the timed epochs, per step of the global batch; link share: that "
        "at the link's rate against the measured time (100%: "
        "the link is the limit). Model ex/s (dense): the unshaped row's compute (its time less "
        "the ring model's all-reduce) plus the ring model's all-reduce of "
        f"{ct.DENSE_BYTES / 1e6:.1f} MB at the link. Start-up: from the last task's strategy "
        "made to worker 0's (a stock PS: the chief's) first step done (building, compiling, "
        "tracing, the first collectives); in brackets the CPU seconds worker 0's process spent "
        "meanwhile (with more hosts than cores, the wall clock is mostly the other hosts' "
        "turns). First epoch: the warm-up epoch's seconds. "
        f"Machine: {mach.get('cpu')}, {mach.get('cpus')} CPUs "
        "shared by every task."
    )


def _size(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def _hosts(row: dict) -> str:
    """A row's hosts, "H x K" with K ring processes per host."""
    k = row.get("workers", row["hosts"]) // row["hosts"]
    return f"{row['hosts']} x {k}" if k > 1 else str(row["hosts"])


def table(rows: list[dict], config: ClusterConfig) -> str:
    from tfstrat.bench._report import markdown

    headers = ["hosts", "link", "size", "ring ms per call", "ring bus MB/s", "of the link",
               "OpenMPI ms", "OpenMPI bus MB/s", "ring / OpenMPI (bus)", "model ms",
               "ring / model (time)"]  # fmt: skip
    body, notes = [], []
    rings = [r for r in rows if r["impl"].startswith("tfstrat ring")]
    for ring in rings:
        peer = next((r for r in rows if r["impl"] == "OpenMPI Allreduce"
                     and _hosts(r) == _hosts(ring) and r["link"] == ring["link"]), None)  # fmt: skip
        mpi = peer["sizes"] if peer and "error" not in peer else [None] * len(ring["sizes"])
        rate = _netns.rate_bits(ring["link"]) / 8 if ring["link"] else None
        for s, m in zip(ring["sizes"], mpi):
            body.append([
                _hosts(ring) + (" flat" if "flat" in ring["impl"] else ""),
                ring["link"] or "unshaped", _size(s["bytes"]),
                f"{s['seconds'] * 1e3:.3f}", f"{s['bus_bytes_per_s'] / 1e6:.1f}",
                f"{s['bus_bytes_per_s'] / rate:.0%}" if rate else "-",
                f"{m['seconds'] * 1e3:.3f}" if m else "-",
                f"{m['bus_bytes_per_s'] / 1e6:.1f}" if m else "-",
                f"{s['bus_bytes_per_s'] / m['bus_bytes_per_s']:.2f}" if m else "-",
                f"{s['predicted_seconds'] * 1e3:.3f}",
                f"{s['seconds'] / s['predicted_seconds']:.2f}",
            ])  # fmt: skip
        k = ring.get("workers", ring["hosts"]) // ring["hosts"]
        sent = sum(ring["between_hosts_bytes"])  # what crossed the hosts' links
        wire = sum(h["tx"] for h in ring["interface_bytes"])
        m = ring["model"]
        flat = " (flat)" if "flat" in ring["impl"] else " (two levels)" if k > 1 else ""
        where = f"{_hosts(ring)} hosts{flat}, {ring['link'] or 'unshaped'}"
        between = " between hosts" if k > 1 else ""
        notes.append(
            f"- {where}: the ring says it sent {sent / 1e6:.1f} MB{between}, the hosts' "
            f"interfaces sent {wire / 1e6:.1f} MB ({wire / sent:.3f}x: TCP/IP headers and "
            f"handshakes); model fitted on {m['hosts']} workers: alpha "
            f"{m['alpha_s'] * 1e6:.0f} us, 1/beta {1 / m['beta_s_per_byte'] / 1e6:.0f} MB/s."
        )
        streams = ring.get("stream_bytes_per_s")
        if streams:
            best = max(s["bus_bytes_per_s"] for s in ring["sizes"] if s["bytes"] >= 4 << 20) \
                if any(s["bytes"] >= 4 << 20 for s in ring["sizes"]) else None  # fmt: skip
            share = (
                f"; the ring's best bus MB/s from 4 MiB is {best / streams['min']:.0%} of the slowest stream"
                if best
                else ""
            )
            notes.append(
                f"- {where}: plain TCP streams, every host to the next at once (the links' "
                f"limit): {streams['min'] / 1e6:.1f} MB/s the slowest host received, "
                f"{streams['median'] / 1e6:.1f} MB/s the median{share}."
            )
        if peer is not None and "error" in peer:
            notes.append(f"- {where}: {peer['error']}")
        elif peer is not None:
            mpi_wire = sum(h["tx"] for h in peer["interface_bytes"])
            notes.append(f"- {where}: OpenMPI's run sent {mpi_wire / 1e6:.1f} MB on the "
                         f"interfaces ({peer['mpi']}).")  # fmt: skip
    mach = rows[0]["machine"] if rows else {}
    notes.append(
        f"\ntfstrat's TCP ring (`Ring.all_reduce`, no TensorFlow) and OpenMPI's `Allreduce` "
        "(mpi4py; `--mca btl tcp,self`), float32 SUM, on the same hosts one after the other; "
        f"each host a network namespace of one machine ({mach.get('cpu')}, {mach.get('cpus')} "
        "CPUs) on a bridge, its link shaped both ways by tc tbf (no delay emulated); no shared "
        "memory between hosts; with more hosts than CPUs, OpenMPI yields when idle "
        "(`mpi_yield_when_idle`) and every process shares the CPUs, which adds latency to "
        "both. A shaped link passes a burst of about 1 ms at full speed: a call smaller than "
        "that can read above the link rate. ms per call: the slowest host's median. Bus MB/s: 2(N-1)/N x "
        "size / time. 'unshaped': the same hosts without a rate, the machine's own limit. "
        "Model: alpha-beta, fitted per link on the smallest host count."
    )
    return markdown(headers, body) + "\n\n" + "\n".join(notes)


def _plot(ax, rows):
    """Top: bus bandwidth by size (log-log), a colour per host count, the ring solid and
    OpenMPI dashed, shaped rows bold. Bottom (with training rows): examples/s of each row at
    the link, tfstrat blue, stock gray."""
    import matplotlib.pyplot as plt

    fig = ax.figure
    trained = [r for r in rows if r["impl"] == "training" and r["link"] and "error" not in r]
    fig.set_size_inches(10, 11 if trained else 6)
    if trained:
        grid = fig.add_gridspec(2, 1, height_ratios=[1, 1])
        ax.set_subplotspec(grid[0])
    calls = [r for r in rows if "sizes" in r]  # the ring's and OpenMPI's rows
    hosts = sorted({r["hosts"] for r in calls})
    colours = dict(zip(hosts, plt.get_cmap("tab10").colors))
    for row in calls:
        if "error" in row:
            continue
        xs = [s["bytes"] for s in row["sizes"]]
        ys = [s["bus_bytes_per_s"] / 1e6 for s in row["sizes"]]
        ring = row["impl"].startswith("tfstrat ring")
        style = ":" if "flat" in row["impl"] else "-" if ring else "--"
        ax.plot(xs, ys, color=colours[row["hosts"]], linestyle=style,
                marker="o" if ring else "x", linewidth=2 if row["link"] else 0.8,
                alpha=1.0 if row["link"] else 0.5,
                label=f"{row['impl'][8:] if ring else 'OpenMPI'}, {_hosts(row)} hosts, "
                f"{row['link'] or 'unshaped'}")  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes per all-reduce")
    ax.set_ylabel("bus MB/s")
    if ax.lines:
        ax.legend(fontsize=7, ncol=2)
    ax.set_title("tfstrat bench cluster: the ring and OpenMPI on emulated hosts")
    if not trained:
        return
    low = fig.add_subplot(grid[1])
    labels = [f"{r['id']} ({r['link']})" for r in trained]
    rates = [r["examples_per_s"] for r in trained]
    tfstrat = [not r["strategy"].startswith("tfkeras") for r in trained]
    low.barh(labels, rates, color=["tab:blue" if t else "tab:gray" for t in tfstrat])
    low.invert_yaxis()
    low.set_xlabel("examples/s at the link (tfstrat blue, stock gray)")
    low.tick_params(axis="y", labelsize=7)
