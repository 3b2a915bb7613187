"""`tfstrat bench scaling|sparse|allreduce|model-parallel|cluster`: the benchmarks, as a table
and a plot."""

from __future__ import annotations

import sys

from tfstrat.commands import _args


def run(args) -> int:
    import signal

    from tfstrat.bench import _report

    def on_sigterm(signum, frame):  # between rows (`launch` handles it within one)
        raise _report.Interrupted(_report.INTERRUPTED_SIGTERM)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return _run(args)
    except (_report.Interrupted, KeyboardInterrupt) as e:  # a row's tasks are stopped
        code = e.code if isinstance(e, _report.Interrupted) else _report.INTERRUPTED_SIGINT
        kept = (
            "nothing written"
            if args.name in ("allreduce", "model-parallel", "cluster")
            else f"the rows measured before it are in {args.out}"
        )
        print(f"tfstrat bench: interrupted; {kept}", file=sys.stderr)
        return code
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args) -> int:
    from tfstrat.errors import UnknownRows

    workers = [int(w) for w in _args.csv(args.workers) if w.isdigit()]
    if not workers or min(workers) < 1 or len(workers) != len(_args.csv(args.workers)):
        print(f"tfstrat bench: --workers {args.workers!r} must list counts >= 1", file=sys.stderr)
        return _args.EXIT_USAGE
    if args.name == "cluster":
        return _cluster(args)
    if args.name == "model-parallel":
        from tfstrat.bench.model_parallel import ROWS, SPEED_QUICK, SPEED_ROWS, ModelParallelConfig
        from tfstrat.bench.model_parallel import run as run_model_parallel

        sizes = dict(steps=args.steps, repeats=args.repeats, budget_mib=args.budget_mib)
        if args.quick:  # seconds per row, numbers meaningless
            sizes = dict(steps=2, repeats=1, budget_mib=0.5, vocab=256, seq=8, batch=4)
            sizes["rows"] = ("DP-2", "MP-1x2", "FSDP-2x1", "S-TF-1", "S-TF-MP-1x2")  # each kind
            sizes["speed"] = tuple(SPEED_QUICK.items())
        if args.rows and not args.quick:
            sizes["rows"] = tuple(_args.csv(args.rows))
            known = [r[0] for r in ROWS] + [r[0] for r in SPEED_ROWS]
            unknown = [r for r in sizes["rows"] if r not in known]
            if unknown:
                print(
                    f"tfstrat bench: --rows {args.rows!r}: model-parallel has no row "
                    f"{', '.join(unknown)}; its rows are {', '.join(known)}",
                    file=sys.stderr,
                )
                return _args.EXIT_USAGE
        rows = run_model_parallel(ModelParallelConfig(out=args.out, **sizes))
        # A JAX row without jax installed says so in the table; it does not fail the run.
        ok = all("error" not in r or r.get("backend") == "jax" for r in rows)
    elif args.name == "allreduce":
        from tfstrat.bench.allreduce import DEFAULT_SIZES, AllReduceConfig
        from tfstrat.bench.allreduce import run as run_allreduce

        sizes = DEFAULT_SIZES[:4] if args.quick else DEFAULT_SIZES
        config = AllReduceConfig(
            workers=max(workers),
            sizes=sizes,
            iters=3 if args.quick else 30,
            peer=args.peer,
            out=args.out,
        )
        rows = run_allreduce(config)
        ok = all("tfstrat_ms" in r for r in rows)
    elif args.name == "sparse":
        from tfstrat.bench.sparse import SparseConfig
        from tfstrat.bench.sparse import run as run_sparse

        sizes = dict(steps=args.steps, repeats=args.repeats)
        if args.vocab:
            sizes["vocab"] = _args.vocabs(args.vocab)
        if args.quick:
            sizes = dict(sizes, vocab=sizes.get("vocab", 5000), steps=3, repeats=1)
            sizes["batch_per_device"] = 8
        config = SparseConfig(
            workers=[w for w in workers if w > 1] or [2],
            peer=args.peer,
            threads=args.threads_per_worker,
            out=args.out,
            rows=_args.csv(args.rows) if args.rows else None,
            **sizes,
        )
        run = run_sparse
    else:
        from tfstrat.bench.scaling import ScalingConfig
        from tfstrat.bench.scaling import run as run_scaling

        if args.quick:  # the smoke test's size: seconds per row, numbers meaningless
            args.steps, args.repeats, args.image, args.batch_per_device = 3, 1, 16, 8
        config = ScalingConfig(
            workers=workers,
            devices_per_worker=args.devices_per_worker,
            model=args.model,
            batch_per_device=args.batch_per_device,
            image=args.image,
            steps=args.steps,
            repeats=args.repeats,
            peer=args.peer,
            threads=args.threads_per_worker,
            out=args.out,
            rows=_args.csv(args.rows) if args.rows else None,
        )
        run = run_scaling
    if args.name not in ("allreduce", "model-parallel"):
        try:
            rows = run(config)
        except UnknownRows as e:
            print(e, file=sys.stderr)
            return _args.EXIT_USAGE
        ok = all("error" not in r for r in rows if not r["row"].startswith("S"))
    with open(f"{args.out}/{args.name}.md") as f:
        print(f.read())
    return 0 if ok else 1


def _cluster(args) -> int:
    from tfstrat.bench import _netns
    from tfstrat.bench.cluster import QUICK_SIZES, ClusterConfig
    from tfstrat.bench.cluster import run as run_cluster

    try:
        hosts = tuple(int(h) for h in _args.csv(args.hosts))
        _netns.rate_bits(args.link)
    except ValueError as e:
        print(f"tfstrat bench cluster: {e} (--hosts {args.hosts!r}, --link {args.link!r})",
              file=sys.stderr)  # fmt: skip
        return _args.EXIT_USAGE
    try:
        parts = tuple(_args.csv(args.parts))
        ps = tuple(int(p) for p in _args.csv(args.ps))
    except ValueError as e:
        print(f"tfstrat bench cluster: {e} (--ps {args.ps!r})", file=sys.stderr)
        return _args.EXIT_USAGE
    options = dict(parts=parts, ps=ps, train_steps=args.steps, train_repeats=args.repeats,
                   workers_per_host=args.workers_per_host,
                   train_rows=tuple(_args.csv(args.rows)) if args.rows else ())  # fmt: skip
    if args.quick:  # the smallest cluster of each kind, few calls and steps; peers included
        options.update(sizes=tuple(QUICK_SIZES), iters=5, seconds=1.0, ps=ps[:1],
                       train_steps=5, train_repeats=1, hosts=hosts[:1])  # fmt: skip
    else:
        options["hosts"] = hosts
    try:
        run_cluster(ClusterConfig(link=args.link, out=args.out, **options))
    except _netns.Unavailable as e:
        print(f"tfstrat bench cluster: {e}", file=sys.stderr)
        return _args.EXIT_USAGE
    except ValueError as e:
        print(f"tfstrat bench cluster: {e}", file=sys.stderr)
        return _args.EXIT_USAGE
    with open(f"{args.out}/cluster.md") as f:
        print(f.read())
    return 0


def add_parser(sub) -> None:
    """The `tfstrat bench` subcommand, added to the parser `main` builds."""
    p = sub.add_parser(
        "bench",
        help="benchmarks: scaling (Mirrored vs CollectiveAllReduce), sparse (embeddings), "
        "allreduce, model-parallel (the largest Transformer per device), cluster (the ring on "
        "emulated hosts; root)",
    )
    p.add_argument("name", choices=["scaling", "sparse", "allreduce", "model-parallel", "cluster"])
    g = p.add_argument_group("Cluster")
    g.add_argument(
        "--workers", default=_args.env("bench-workers", "1,2"), help="worker counts, e.g. 1,2,3"
    )
    g.add_argument(
        "--devices-per-worker", type=int, default=_args.env("devices-per-worker", 1, int)
    )
    g.add_argument(
        "--threads-per-worker", type=int, default=_args.env("threads-per-worker", None, int)
    )
    g.add_argument(
        "--hosts",
        default=_args.env("hosts", "2,4"),
        help="cluster: emulated host counts, e.g. 2,4,8,16 (network namespaces; needs root)",
    )
    g.add_argument(
        "--link",
        default=_args.env("link", "1gbit"),
        help="cluster: each host's link rate, both ways, as tc writes it (1gbit, 200mbit)",
    )
    g.add_argument(
        "--parts",
        default=_args.env("parts", "ring,launchers,dense,sparse"),
        help="cluster: what to measure: ring (tfstrat's ring and OpenMPI's), flat (with ring: "
        "also one plain ring, no two levels or recursive doubling), ps (the rows one ps serves "
        "to 1-8 clients), launchers (N "
        "launchers agreeing on a restart), dense (CollectiveAllReduce vs stock "
        "MultiWorkerMirrored), sparse (Hybrid vs tfstrat's and stock ParameterServer)",
    )
    g.add_argument(
        "--ps", default=_args.env("ps", "1,2"), help="cluster: the sparse rows' ps task counts"
    )
    g.add_argument(
        "--workers-per-host",
        type=int,
        default=_args.env("workers-per-host", 1, int),
        help="cluster: processes per emulated host (the ring and dense parts; ranks host by host)",
    )
    g = p.add_argument_group("Workload")
    g.add_argument("--model", choices=["small", "resnet50"], default=_args.env("model"))
    g.add_argument("--batch-per-device", type=int, default=_args.env("batch-per-device", None, int))
    g.add_argument("--image", type=int, default=_args.env("image", None, int), help="image side")
    g.add_argument(
        "--steps", type=int, default=_args.env("steps", 20, int), help="steps per timed epoch"
    )
    g.add_argument("--repeats", type=int, default=_args.env("repeats", 3, int), help="timed epochs")
    g.add_argument(
        "--vocab",
        default=_args.env("vocab"),
        help="sparse: table rows, one run of the rows per value, e.g. 200000,2000000",
    )
    g.add_argument(
        "--budget-mib",
        type=float,
        default=_args.env("budget-mib", 8.0, float),
        help="model-parallel: bytes per device for the variables and Adam's slots, in MiB",
    )
    g = p.add_argument_group("Output")
    g.add_argument("--peer", action="store_true", default=_args.env("peer", False, bool))
    g.add_argument("--quick", action="store_true", help="tiny sizes, for smoke tests")
    g.add_argument(
        "--rows",
        default=_args.env("rows"),
        help="scaling/sparse/model-parallel/cluster: only these row ids, e.g. P-1,A-1,B-2, "
        "S-TF-1,S-TF-MP-1x2 or D-CAR-8,S-H-8w1ps (default: every row)",
    )
    g.add_argument(
        "--out", default=_args.env("out", "bench-out"), help="directory for NAME.md/json/png"
    )
    p.set_defaults(run=run)
