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


def _vocabs(text: str) -> tuple[int, ...]:
    try:
        vocabs = tuple(int(v) for v in _csv(text))
    except ValueError:
        vocabs = ()
    if not vocabs or min(vocabs) < 1:
        raise SystemExit(
            f"tfstrat bench: --vocab {text}: give table row counts >= 1, e.g. 200000,2000000"
        )
    return vocabs


def _csv(text: str | None) -> list[str]:
    return [a.strip() for a in text.split(",") if a.strip()] if text else []


def _task(text: str) -> tuple[str, int]:
    kind, sep, index = text.partition(":")
    if not sep or not index.isdigit():
        raise TFConfigError(f"Received: --task {text!r}. Write it as TYPE:INDEX, e.g. worker:1.")
    return kind, int(index)


def _cmd_devices(args) -> int:
    from tfstrat.cluster.devices import devices
    from tfstrat.runtime.quiet import quiet_tensorflow_import

    with quiet_tensorflow_import():  # TensorFlow's import prints C++ start-up lines
        info = devices()
    print(json.dumps(info.to_dict(), indent=2) if args.json else info.table())
    return 0


def _cmd_tf_config(args) -> int:
    task_type, index = _task(args.task) if args.task else (None, None)
    if args.nodes:
        from tfstrat.cluster.nodes import DEFAULT_PORT

        if args.worker or args.ps or args.chief or args.evaluator:
            raise TFConfigError(
                "Received: --nodes with --worker/--ps/--chief/--evaluator. Give either the "
                "nodes (with --workers-per-node, --ps-per-node, --port) or the addresses."
            )
        config = TFConfig.from_nodes(
            args.nodes,
            args.workers_per_node if args.workers_per_node is not None else 1,
            args.ps_per_node if args.ps_per_node is not None else 0,
            args.port if args.port is not None else DEFAULT_PORT,
            task_type,
            index,
        )
    elif not (args.worker or args.ps or args.chief or args.evaluator) and "TF_CONFIG" in os.environ:
        config = TFConfig.from_env()  # e.g. `tfstrat tf-config --explain` in a TFJob's pod
        if task_type is not None:
            config = config.for_task(task_type, index)
    else:
        config = TFConfig.from_hosts(
            worker=_csv(args.worker),
            ps=_csv(args.ps),
            chief=args.chief,
            evaluator=args.evaluator,
            task_type=task_type,
            task_index=index,
        )
    if args.explain:
        from tfstrat.commands.explain import explain

        print(explain(config))
        return 0
    text = config.to_json()
    print(f"export TF_CONFIG='{text}'" if args.export else text)
    return 0


def _node_layout(args):
    """The NodeLayout of a multi-node launch (from --nodes, else srun's SLURM variables), or
    None for a one-machine launch."""
    from tfstrat.cluster.layout import NodeLayout
    from tfstrat.cluster.nodes import DEFAULT_PORT

    per_node = dict(
        workers_per_node=args.workers_per_node if args.workers_per_node is not None else 1,
        ps_per_node=args.ps_per_node if args.ps_per_node is not None else 0,
        port=args.port if args.port is not None else DEFAULT_PORT,
    )
    if args.nodes:
        if args.node_rank is None:
            raise TFConfigError(
                f"Received: --nodes {args.nodes} without --node-rank. Give this node's position "
                "in --nodes (0 for the first), the same --nodes on every node."
            )
        return NodeLayout(args.nodes, args.node_rank, **per_node)
    asked = [
        f for f in ("workers_per_node", "ps_per_node", "node_rank") if getattr(args, f) is not None
    ]
    if not asked:
        if args.port is not None:
            raise TFConfigError(
                f"Received: --port {args.port} without --nodes. A one-machine launch picks free "
                "ports itself; --port is the first port of every node of a multi-node launch."
            )
        nodes = os.environ.get("SLURM_STEP_NUM_NODES") or os.environ.get("SLURM_NNODES")
        if nodes and nodes != "1":
            print(
                f"tfstrat launch: SLURM_NNODES={nodes}, but this starts a cluster on this node "
                "alone; for one cluster over every node of the step give --workers-per-node.",
                file=sys.stderr,
            )
        return None
    flags = ", ".join("--" + f.replace("_", "-") for f in asked)
    if not os.environ.get("SLURM_JOB_NODELIST"):
        raise TFConfigError(
            f"Received: {flags} without --nodes, outside SLURM. Give --nodes host1,host2 and "
            "--node-rank, or run under srun (which sets SLURM_JOB_NODELIST and SLURM_NODEID)."
        )
    layout = NodeLayout.from_slurm(os.environ, rank=args.node_rank, **per_node)
    print(
        f"tfstrat launch: nodes and rank from SLURM: --nodes {layout.nodes} --node-rank "
        f"{layout.rank} (SLURM_NODEID={os.environ.get('SLURM_NODEID')}).",
        file=sys.stderr,
    )
    return layout


def _cmd_launch(args) -> int:
    from tfstrat.launcher.api import LaunchConfig, launch

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    try:
        nodes = _node_layout(args)
        if nodes is not None and (args.workers is not None or args.ps or args.chief):
            raise TFConfigError(
                "Received: --workers/--ps/--chief with --nodes. A multi-node launch counts per "
                "node: --workers-per-node N [--ps-per-node M]; worker:0, on the first node, is "
                "the chief."
            )
        config = LaunchConfig(
            command=command,
            workers=args.workers if args.workers is not None else 1,
            ps=args.ps,
            chief=args.chief,
            timeout=args.timeout,
            port_retries=args.port_retries,
            threads_per_task=args.threads_per_task,
            grace=args.grace,
            restarts=args.restarts,
            nodes=nodes,
            private_network=args.private_network,
            show=args.show,
            log_dir=args.log_dir,
            verbose=args.verbose,
        )
    except ValueError as e:
        print(f"tfstrat launch: {e}", file=sys.stderr)
        return EXIT_USAGE
    return launch(config)


_LAUNCH_DESCRIPTION = """\
Runs COMMAND as every chief and worker task of a cluster on 127.0.0.1 (plus `tfstrat server`
for each ps task), each with its own TF_CONFIG and TFSTRAT_TASK (e.g. worker:1). Every task and
everything it starts dies with the launcher.

Output: the chief's lines are shown (worker:0 when there is no chief), prefixed with its name:
one progress bar, not one per worker. Every task's whole output goes to its own file in
--log-dir (default: a new directory under the temporary directory, named at the start and in
a failure's report). A task that fails has its last lines printed whatever --show says.
TensorFlow's start-up lines that say nothing (CUDA driver notices, absl's logging notice) are
hidden and tasks get TF_CPP_MIN_LOG_LEVEL=2 unless set; --verbose hides nothing.

Several machines: start `tfstrat launch --nodes host1,host2 --node-rank R --workers-per-node N
-- COMMAND` once on each node, with the same arguments and R = 0, 1, ... (torchrun's
--nnodes/--node-rank). Every node builds the same TF_CONFIG: on each node its workers, then its
ps tasks, at ports P, P+2, P+4, ... (P = --port, or the node's own `host:port`); each task also
listens on the port above its own (tfstrat's ring or table server), so open P..P+2K-1 between
the nodes (`tfstrat tf-config --nodes ... --explain` lists them). Each launcher starts its own
node's tasks; its ps tasks serve until every node's workers have ended. Ports are fixed: no
port retries, and no --restarts (restart the whole job instead). Under srun with no --nodes,
--workers-per-node reads the nodes and this node's rank from SLURM_STEP_NODELIST /
SLURM_JOB_NODELIST and SLURM_NODEID: `srun --ntasks-per-node=1 tfstrat launch
--workers-per-node 2 -- python train.py`."""

_LAUNCH_EPILOG = """\
When a task fails, the others get SIGTERM, then SIGKILL after --grace seconds, and the task's
last lines are printed. If its error names another task (a worker that timed out waiting for
worker:1, or for ps:0), that task is reported as the probable cause. A worker that exits 0
while others still run is reported too. With --restarts K, every task is started again on
fresh ports, up to K times; not after exit codes 2, 126 or 127, a timeout, or SIGINT/SIGTERM.

In a multi-node run the report names the node of each task (worker:1 on node 1 (host)). Each
launcher stops only its own node's tasks: the other nodes learn of a failure from their tasks'
errors (a ring or ps connection that closes names the task: "worker:1 on node 1 (host) is the
probable cause") and fail in turn; under srun, --kill-on-bad-exit=1 stops every node at once.
A node's ps tasks serve until the other nodes' workers have ended (a node with only ps tasks
waits for each of them to come up and end: give --timeout).

--private-network runs every task in one new network namespace whose only interface is
loopback: TensorFlow's gRPC servers bind all interfaces and run any op they are sent,
unauthenticated; in the namespace nothing reaches them from outside. It needs user namespaces
(or root); where the kernel refuses, it exits 125 and says what failed and what to change.

exit status: 0 when every chief and worker exits 0; else the first failed task's code
(128+N when signal N killed it: 137 SIGKILL, 143 SIGTERM); 124 on --timeout; 127 command
not found; 126 not executable; 130 on Ctrl-C and 143 on SIGTERM to the launcher; 125 when
--private-network was refused.

Every flag falls back to TFSTRAT_<FLAG>, e.g. TFSTRAT_RESTARTS=3, TFSTRAT_NODES=a,b,
TFSTRAT_NODE_RANK=1.

examples:
  tfstrat launch --workers 2 --ps 1 --restarts 3 -- python train.py
  tfstrat launch --private-network --workers 2 -- python train.py
  tfstrat launch --nodes 10.0.0.1,10.0.0.2 --node-rank 0 --workers-per-node 2 --port 2222 \\
      -- python train.py        # and --node-rank 1 on 10.0.0.2"""


def _cmd_doctor(args) -> int:
    from tfstrat.commands.doctor import run
    from tfstrat.runtime.quiet import quiet_tensorflow_import

    with quiet_tensorflow_import():  # TensorFlow's import prints C++ start-up lines
        return run(timeout=args.timeout)


def _cmd_server(args) -> int:
    from tfstrat.ps.server import ServerError, serve

    try:
        serve(TFConfig.from_env(), _task(args.task) if args.task else None)
    except ServerError as e:
        print(f"tfstrat server: {e}", file=sys.stderr)
        return 1
    return 0


def _cmd_bench(args) -> int:
    from tfstrat.bench._report import UnknownRows

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
        if args.vocab:
            sizes["vocab"] = _vocabs(args.vocab)
        if args.quick:
            sizes = dict(sizes, vocab=sizes.get("vocab", 5000), steps=3, repeats=1)
            sizes["batch_per_device"] = 8
        config = SparseConfig(
            workers=[w for w in workers if w > 1] or [2],
            peer=args.peer,
            threads=args.threads_per_worker,
            out=args.out,
            rows=_csv(args.rows) if args.rows else None,
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
            rows=_csv(args.rows) if args.rows else None,
        )
        run = run_scaling
    if args.name != "allreduce":
        try:
            rows = run(config)
        except UnknownRows as e:
            print(e, file=sys.stderr)
            return EXIT_USAGE
        ok = all("error" not in r for r in rows if not r["row"].startswith("S"))
    with open(f"{args.out}/{args.name}.md") as f:
        print(f.read())
    return 0 if ok else 1


def _node_flags(g) -> None:
    """--nodes, --workers-per-node, --ps-per-node, --port (tf-config and launch)."""
    g.add_argument(
        "--nodes",
        default=_env("nodes"),
        metavar="HOSTS",
        help="the machines, the same list on every node: host1,host2 or node[01-04]; "
        "host:port gives a node its own first port; IPv6 as [fd00::1]:port",
    )
    g.add_argument(
        "--workers-per-node",
        default=_env("workers-per-node"),
        metavar="N",
        help="workers on every node (default 1), or one count per node: 2,2,0",
    )
    g.add_argument(
        "--ps-per-node",
        default=_env("ps-per-node"),
        metavar="M",
        help="ps tasks on every node (default 0), or one count per node: 0,0,1",
    )
    g.add_argument(
        "--port",
        type=int,
        default=_env("port", None, int),
        metavar="P",
        help="first task's port on every node (default 12345); tasks at P, P+2, ...; each also "
        "uses the port above its own",
    )


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("tfstrat")
    except metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tfstrat", description="Distribution strategies for TensorFlow 2 and Keras 3."
    )
    parser.add_argument("--version", action="version", version=f"tfstrat {_version()}")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    p = sub.add_parser("devices", help="what this host has: CPUs, GPUs (NCCL?), TPU")
    p.add_argument("--json", action="store_true", default=_env("json", False, bool))
    p.set_defaults(run=_cmd_devices)

    p = sub.add_parser(
        "tf-config",
        help="print a valid TF_CONFIG for one task (from addresses, --nodes, or $TF_CONFIG), "
        "or with --explain what every task listens on",
    )
    g = p.add_argument_group("Cluster")
    g.add_argument("--worker", default=_env("worker"), help="worker addresses H:P,H:P")
    g.add_argument("--ps", default=_env("ps"), help="ps addresses H:P,...")
    g.add_argument("--chief", default=_env("chief"), help="the chief's address H:P")
    g.add_argument("--evaluator", default=_env("evaluator"), help="the evaluator's address")
    g.add_argument("--task", default=_env("task"), help="this task, TYPE:INDEX (e.g. worker:1)")
    g = p.add_argument_group("Nodes (the cluster `tfstrat launch --nodes` builds)")
    _node_flags(g)
    p.add_argument("--export", action="store_true", default=_env("export", False, bool))
    p.add_argument(
        "--explain",
        action="store_true",
        default=_env("explain", False, bool),
        help="print what every task listens on, where (TensorFlow's port P on all interfaces; "
        "tfstrat's ring or table server on P+1, at the task's own address), and the ports to "
        "open between the hosts, instead of the JSON",
    )
    p.set_defaults(run=_cmd_tf_config)

    p = sub.add_parser(
        "launch",
        help="run a real cluster on 127.0.0.1: launch [flags] -- CMD",
        description=_LAUNCH_DESCRIPTION,
        epilog=_LAUNCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("Cluster (one machine)")
    g.add_argument(
        "--workers", type=int, default=_env("workers", None, int), help="worker tasks (default 1)"
    )
    g.add_argument("--ps", type=int, default=_env("ps", 0, int), help="ps tasks to start")
    g.add_argument("--chief", action="store_true", default=_env("chief", False, bool))
    g.add_argument(
        "--port-retries",
        type=int,
        default=_env("port-retries", 3, int),
        help="starts on fresh ports when TensorFlow finds a port taken (default 3); none with "
        "--nodes, whose ports are fixed",
    )
    g = p.add_argument_group("Nodes (one launcher per machine, torchrun's --nnodes/--node-rank)")
    _node_flags(g)
    g.add_argument(
        "--node-rank",
        type=int,
        default=_env("node-rank", None, int),
        metavar="R",
        help="this node's position in --nodes, 0 first (under srun: SLURM_NODEID)",
    )
    g = p.add_argument_group("Network")
    g.add_argument(
        "--private-network",
        action="store_true",
        default=_env("private-network", False, bool),
        help="run every task in one new network namespace with only loopback up: nothing of "
        "the job is reachable from outside (one machine; needs user namespaces or root)",
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
        "(default 0); tasks see the attempt in TFSTRAT_RESTART. Not with --nodes: restart the "
        "whole job",
    )
    g.add_argument(
        "--grace",
        type=float,
        default=_env("grace", 5.0, float),
        metavar="SECONDS",
        help="seconds between SIGTERM and SIGKILL when stopping tasks (default 5)",
    )
    g = p.add_argument_group("Output")
    g.add_argument(
        "--show",
        default=_env("show", "chief"),
        metavar="WHO",
        help="whose output to print: chief (default: the chief, else worker:0), all, or task "
        "names such as worker:1 or worker:0,ps:0",
    )
    g.add_argument(
        "--log-dir",
        default=_env("log-dir"),
        metavar="DIR",
        help="one file per task with all its output (worker-1.log); default: a new directory "
        "under the temporary directory when --show hides a task",
    )
    g.add_argument(
        "--verbose",
        action="store_true",
        default=_env("verbose", False, bool),
        help="hide nothing: TensorFlow's start-up lines, and its log level in the tasks",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    p.set_defaults(run=_cmd_launch)

    p = sub.add_parser(
        "bench",
        help="benchmarks: scaling (Mirrored vs CollectiveAllReduce), sparse (embeddings), allreduce",
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
    g.add_argument(
        "--vocab",
        default=_env("vocab"),
        help="sparse: table rows, one run of the rows per value, e.g. 200000,2000000",
    )
    g = p.add_argument_group("Output")
    g.add_argument("--peer", action="store_true", default=_env("peer", False, bool))
    g.add_argument("--quick", action="store_true", help="tiny sizes, for smoke tests")
    g.add_argument(
        "--rows",
        default=_env("rows"),
        help="scaling/sparse: only these row ids, e.g. P-1,A-1,B-2 (default: every row)",
    )
    g.add_argument("--out", default=_env("out", "bench-out"), help="directory for NAME.md/json/png")
    p.set_defaults(run=_cmd_bench)

    p = sub.add_parser(
        "doctor",
        help="versions, devices, what tfstrat.auto() picks for $TF_CONFIG, this task's ports, "
        "and whether its peers resolve and answer; exit 1 if a check fails",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=_env("doctor-timeout", 2.0, float),
        metavar="SECONDS",
        help="how long each peer gets to accept a TCP connection (default 2)",
    )
    p.set_defaults(run=_cmd_doctor)

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
