"""The `tfstrat` command: a thin skin over `tfstrat`'s functions.

Every flag falls back to an environment variable `TFSTRAT_<FLAG>` (dashes as underscores), so
`TFSTRAT_WORKERS=3 tfstrat launch -- python train.py` works like `--workers 3`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence

from tfstrat.cluster import TFConfig, TFConfigError

EXIT_USAGE = 2


def _env(flag: str, default=None, kind=str):
    """The default for `--flag`: $TFSTRAT_FLAG if set, else `default`."""
    value = os.environ.get("TFSTRAT_" + flag.upper().replace("-", "_"))
    if value is None:
        return default
    if kind is bool:
        return value.lower() in ("1", "true", "yes", "on")
    try:
        return kind(value)
    except ValueError:
        raise SystemExit(
            f"tfstrat: TFSTRAT_{flag.upper()}={value!r} is not a valid {kind.__name__}"
        ) from None


def _csv(text: str | None) -> list[str]:
    return [a.strip() for a in text.split(",") if a.strip()] if text else []


def _task(text: str) -> tuple[str, int]:
    kind, sep, index = text.partition(":")
    if not sep or not index.isdigit():
        raise TFConfigError(f"Received: --task {text!r}. Write it as TYPE:INDEX, e.g. worker:1.")
    return kind, int(index)


def _cmd_devices(args) -> int:
    from tfstrat.devices import devices

    info = devices()
    print(json.dumps(info.to_dict(), indent=2) if args.json else info.table())
    return 0


def _cmd_tf_config(args) -> int:
    task_type, index = _task(args.task) if args.task else (None, None)
    config = TFConfig.from_hosts(
        worker=_csv(args.worker),
        ps=_csv(args.ps),
        chief=args.chief,
        evaluator=args.evaluator,
        task_type=task_type,
        task_index=index,
    )
    text = config.to_json()
    print(f"export TF_CONFIG='{text}'" if args.export else text)
    return 0


def _cmd_launch(args) -> int:
    from tfstrat.launch import LaunchConfig, launch

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    try:
        config = LaunchConfig(
            command=command,
            workers=args.workers,
            ps=args.ps,
            chief=args.chief,
            timeout=args.timeout,
            port_retries=args.port_retries,
            threads_per_task=args.threads_per_task,
            grace=args.grace,
            restarts=args.restarts,
        )
    except ValueError as e:
        print(f"tfstrat launch: {e}", file=sys.stderr)
        return EXIT_USAGE
    return launch(config)


_LAUNCH_DESCRIPTION = """\
Runs COMMAND as every chief and worker task of a cluster on 127.0.0.1 (plus `tfstrat server`
for each ps task), each with its own TF_CONFIG and TFSTRAT_TASK (e.g. worker:1), its output
prefixed with its task name. Every task and everything it starts dies with the launcher."""

_LAUNCH_EPILOG = """\
When a task fails, the others get SIGTERM, then SIGKILL after --grace seconds, and the task's
last lines are printed. If its error names another task (a worker that timed out waiting for
worker:1, or for ps:0), that task is reported as the probable cause. A worker that exits 0
while others still run is reported too. With --restarts K, every task is started again on
fresh ports, up to K times; not after exit codes 2, 126 or 127, a timeout, or SIGINT/SIGTERM.

exit status: 0 when every chief and worker exits 0; else the first failed task's code
(128+N when signal N killed it: 137 SIGKILL, 143 SIGTERM); 124 on --timeout; 127 command
not found; 126 not executable; 130 on Ctrl-C and 143 on SIGTERM to the launcher.

Every flag falls back to TFSTRAT_<FLAG>, e.g. TFSTRAT_RESTARTS=3.

example: tfstrat launch --workers 2 --ps 1 --restarts 3 -- python train.py"""


def _cmd_server(args) -> int:
    from tfstrat.server import ServerError, serve

    try:
        serve(TFConfig.from_env(), _task(args.task) if args.task else None)
    except ServerError as e:
        print(f"tfstrat server: {e}", file=sys.stderr)
        return 1
    return 0


def _cmd_bench(args) -> int:
    workers = [int(w) for w in _csv(args.workers) if w.isdigit()]
    if not workers or min(workers) < 1 or len(workers) != len(_csv(args.workers)):
        print(f"tfstrat bench: --workers {args.workers!r} must list counts >= 1", file=sys.stderr)
        return EXIT_USAGE
    if args.name == "allreduce":
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
        if args.quick:
            sizes = dict(vocab=5000, steps=3, repeats=1, batch_per_device=8)
        config = SparseConfig(
            workers=[w for w in workers if w > 1] or [2],
            peer=args.peer,
            threads=args.threads_per_worker,
            out=args.out,
            **sizes,
        )
        rows = run_sparse(config)
        ok = all("error" not in r for r in rows if not r["row"].startswith("S"))
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
        )
        rows = run_scaling(config)
        ok = all("error" not in r for r in rows if not r["row"].startswith("S"))
    with open(f"{args.out}/{args.name}.md") as f:
        print(f.read())
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tfstrat", description="Distribution strategies for TensorFlow 2 and Keras 3."
    )
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    p = sub.add_parser("devices", help="what this host has: CPUs, GPUs (NCCL?), TPU")
    p.add_argument("--json", action="store_true", default=_env("json", False, bool))
    p.set_defaults(run=_cmd_devices)

    p = sub.add_parser("tf-config", help="print a valid TF_CONFIG for one task")
    g = p.add_argument_group("Cluster")
    g.add_argument("--worker", default=_env("worker"), help="worker addresses H:P,H:P")
    g.add_argument("--ps", default=_env("ps"), help="ps addresses H:P,...")
    g.add_argument("--chief", default=_env("chief"), help="the chief's address H:P")
    g.add_argument("--evaluator", default=_env("evaluator"), help="the evaluator's address")
    g.add_argument("--task", default=_env("task"), help="this task, TYPE:INDEX (e.g. worker:1)")
    p.add_argument("--export", action="store_true", default=_env("export", False, bool))
    p.set_defaults(run=_cmd_tf_config)

    p = sub.add_parser(
        "launch",
        help="run a real cluster on 127.0.0.1: launch [flags] -- CMD",
        description=_LAUNCH_DESCRIPTION,
        epilog=_LAUNCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("Cluster")
    g.add_argument("--workers", type=int, default=_env("workers", 1, int))
    g.add_argument("--ps", type=int, default=_env("ps", 0, int), help="ps tasks to start")
    g.add_argument("--chief", action="store_true", default=_env("chief", False, bool))
    g.add_argument(
        "--port-retries",
        type=int,
        default=_env("port-retries", 3, int),
        help="starts on fresh ports when TensorFlow finds a port taken (default 3)",
    )
    g = p.add_argument_group("Devices")
    g.add_argument(
        "--threads-per-task",
        type=int,
        default=_env("threads-per-task", None, int),
        help="threads in each TensorFlow pool per task (TF_NUM_INTRAOP_THREADS and "
        "TF_NUM_INTEROP_THREADS); default: cores / (workers + chief); 0: TensorFlow's defaults",
    )
    g = p.add_argument_group("Run")
    g.add_argument(
        "--timeout",
        type=float,
        default=_env("timeout", None, float),
        metavar="SECONDS",
        help="stop everything after SECONDS (all restarts included) and exit 124",
    )
    g.add_argument(
        "--restarts",
        type=int,
        default=_env("restarts", 0, int),
        metavar="K",
        help="when a task fails, stop all and start all again on fresh ports, up to K times "
        "(default 0); tasks see the attempt in TFSTRAT_RESTART",
    )
    g.add_argument(
        "--grace",
        type=float,
        default=_env("grace", 5.0, float),
        metavar="SECONDS",
        help="seconds between SIGTERM and SIGKILL when stopping tasks (default 5)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    p.set_defaults(run=_cmd_launch)

    p = sub.add_parser(
        "bench", help="benchmarks: scaling (the seed's table), sparse (embeddings), allreduce"
    )
    p.add_argument("name", choices=["scaling", "sparse", "allreduce"])
    g = p.add_argument_group("Cluster")
    g.add_argument(
        "--workers", default=_env("bench-workers", "1,2"), help="worker counts, e.g. 1,2,3"
    )
    g.add_argument("--devices-per-worker", type=int, default=_env("devices-per-worker", 1, int))
    g.add_argument("--threads-per-worker", type=int, default=_env("threads-per-worker", None, int))
    g = p.add_argument_group("Workload")
    g.add_argument("--model", choices=["small", "resnet50"], default=_env("model"))
    g.add_argument("--batch-per-device", type=int, default=_env("batch-per-device", None, int))
    g.add_argument("--image", type=int, default=_env("image", None, int), help="image side")
    g.add_argument(
        "--steps", type=int, default=_env("steps", 20, int), help="steps per timed epoch"
    )
    g.add_argument("--repeats", type=int, default=_env("repeats", 3, int), help="timed epochs")
    g = p.add_argument_group("Output")
    g.add_argument("--peer", action="store_true", default=_env("peer", False, bool))
    g.add_argument("--quick", action="store_true", help="tiny sizes, for smoke tests")
    g.add_argument("--out", default=_env("out", "bench-out"), help="directory for NAME.md/json/png")
    p.set_defaults(run=_cmd_bench)

    p = sub.add_parser("server", help="run this host's ps task (from TF_CONFIG) until stopped")
    p.add_argument("--task", default=_env("task"), help="TYPE:INDEX, default TF_CONFIG's task")
    p.set_defaults(run=_cmd_server)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `tfstrat` console script and `python -m tfstrat`."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        return args.run(args)
    except TFConfigError as e:
        print(f"tfstrat {args.cmd}: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
