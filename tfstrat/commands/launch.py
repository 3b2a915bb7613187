"""`tfstrat launch`: a real cluster of tasks on this machine, or one node of a multi-node job."""

from __future__ import annotations

import argparse
import sys

from tfstrat.cluster import TFConfigError
from tfstrat.commands import _args

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
port retries. With --restarts K and --backup-dir DIR (shared by every node), a failure or a lost
node does not end the job: the launchers meet at a rendezvous (each listens on its node's port
P - 1) and start the next attempt on every node that answers, at least --min-nodes; training
resumes from the chief's BackupAndRestore backup, and a node whose launcher starts again joins
at once (the job grows). Under srun with no --nodes,
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
With --restarts, every node's launcher instead stops its tasks and joins the next attempt; one
stopped by SIGINT/SIGTERM leaves the job (signal every launcher to stop it all). The ps tasks
of a lost node move to the first node left.
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


def run(args) -> int:
    from tfstrat.launcher.api import LaunchConfig, launch

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    try:
        nodes = _args.node_layout(args)
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
            gpus=_args.csv(args.gpus) if args.gpus is not None else None,
            gpus_per_task=args.gpus_per_task,
            grace=args.grace,
            restarts=args.restarts,
            nodes=nodes,
            private_network=args.private_network,
            show=args.show,
            log_dir=args.log_dir,
            verbose=args.verbose,
            secret_file=args.secret_file,
            peer_timeout=args.peer_timeout,
            backup_dir=args.backup_dir,
            min_nodes=args.min_nodes,
            rejoin_window=args.rejoin_window,
        )
    except ValueError as e:
        print(f"tfstrat launch: {e}", file=sys.stderr)
        return _args.EXIT_USAGE
    return launch(config)


def add_parser(sub) -> None:
    """The `tfstrat launch` subcommand, added to the parser `main` builds."""
    p = sub.add_parser(
        "launch",
        help="run a real cluster on 127.0.0.1: launch [flags] -- CMD",
        description=_LAUNCH_DESCRIPTION,
        epilog=_LAUNCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("Cluster (one machine)")
    g.add_argument(
        "--workers",
        type=int,
        default=_args.env("workers", None, int),
        help="worker tasks (default 1)",
    )
    g.add_argument("--ps", type=int, default=_args.env("ps", 0, int), help="ps tasks to start")
    g.add_argument("--chief", action="store_true", default=_args.env("chief", False, bool))
    g.add_argument(
        "--port-retries",
        type=int,
        default=_args.env("port-retries", 3, int),
        help="starts on fresh ports when TensorFlow finds a port taken (default 3); none with "
        "--nodes, whose ports are fixed",
    )
    g = p.add_argument_group("Nodes (one launcher per machine, torchrun's --nnodes/--node-rank)")
    _args.node_flags(g)
    g.add_argument(
        "--node-rank",
        type=int,
        default=_args.env("node-rank", None, int),
        metavar="R",
        help="this node's position in --nodes, 0 first (under srun: SLURM_NODEID)",
    )
    g = p.add_argument_group("Network")
    g.add_argument(
        "--private-network",
        action="store_true",
        default=_args.env("private-network", False, bool),
        help="run every task in one new network namespace with only loopback up: nothing of "
        "the job is reachable from outside (one machine; needs user namespaces or root)",
    )
    g.add_argument(
        "--secret-file",
        default=_args.env("secret-file", None, str),
        metavar="PATH",
        help="the job's secret, the same file on every node (also TFSTRAT_SECRET_FILE): "
        "tfstrat's ring and table servers let in only this job's tasks of this attempt; "
        "default: a random one per attempt on one machine, none across nodes",
    )
    g = p.add_argument_group("Devices")
    g.add_argument(
        "--threads-per-task",
        type=int,
        default=_args.env("threads-per-task", None, int),
        help="threads in each TensorFlow pool per task (TF_NUM_INTRAOP_THREADS and "
        "TF_NUM_INTEROP_THREADS); default: cores / (workers + chief); 0: TensorFlow's defaults",
    )
    g.add_argument(
        "--gpus",
        default=_args.env("gpus", None, str),
        metavar="LIST",
        help="the GPUs to hand out, e.g. 0,1,2,3, or none to hide them all (default: this "
        "launcher's CUDA_VISIBLE_DEVICES, else every GPU the NVIDIA driver lists): each chief "
        "and worker task gets its own CUDA_VISIBLE_DEVICES, the same number each, ps tasks none",
    )
    g.add_argument(
        "--gpus-per-task",
        type=int,
        default=_args.env("gpus-per-task", None, int),
        metavar="N",
        help="GPUs per chief and worker task (default: all of them split evenly; a count that "
        "does not divide is refused)",
    )
    g = p.add_argument_group("Run")
    g.add_argument(
        "--timeout",
        type=float,
        default=_args.env("timeout", None, float),
        metavar="SECONDS",
        help="stop everything after SECONDS (all restarts included) and exit 124",
    )
    g.add_argument(
        "--restarts",
        type=int,
        default=_args.env("restarts", 0, int),
        metavar="K",
        help="when a task fails, stop all and start all again on fresh ports, up to K times "
        "(default 0); tasks see the attempt in TFSTRAT_RESTART. With --nodes: on the nodes "
        "that answer the rendezvous (needs --backup-dir)",
    )
    g.add_argument(
        "--backup-dir",
        default=_args.env("backup-dir", None, str),
        metavar="DIR",
        help="the job's backup directory, given to every task as TFSTRAT_BACKUP_DIR "
        "(tfstrat.keras.callbacks.BackupAndRestore() reads it); with --nodes and --restarts, "
        "required and checked to be one directory every node shares",
    )
    g.add_argument(
        "--min-nodes",
        type=int,
        default=_args.env("min-nodes", 1, int),
        metavar="M",
        help="with --nodes and --restarts: the fewest nodes an attempt runs on (default 1)",
    )
    g.add_argument(
        "--rejoin-window",
        type=float,
        default=_args.env("rejoin-window", 60.0, float),
        metavar="SECONDS",
        help="with --nodes and --restarts: how long a restart waits for nodes that answer but "
        "have not joined (default 60); the first attempt waits --peer-timeout for every node",
    )
    g.add_argument(
        "--peer-timeout",
        type=float,
        default=_args.env("peer-timeout", 300.0, float),
        metavar="SECONDS",
        help="a node with only ps tasks gives up, naming them, when another node's workers "
        "have not come up within this (default 300)",
    )
    g.add_argument(
        "--grace",
        type=float,
        default=_args.env("grace", 5.0, float),
        metavar="SECONDS",
        help="seconds between SIGTERM and SIGKILL when stopping tasks (default 5)",
    )
    g = p.add_argument_group("Output")
    g.add_argument(
        "--show",
        default=_args.env("show", "chief"),
        metavar="WHO",
        help="whose output to print: chief (default: the chief, else worker:0), all, or task "
        "names such as worker:1 or worker:0,ps:0",
    )
    g.add_argument(
        "--log-dir",
        default=_args.env("log-dir"),
        metavar="DIR",
        help="one file per task with all its output (worker-1.log); default: a new directory "
        "under the temporary directory when --show hides a task",
    )
    g.add_argument(
        "--verbose",
        action="store_true",
        default=_args.env("verbose", False, bool),
        help="hide nothing: TensorFlow's start-up lines, and its log level in the tasks",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    p.set_defaults(run=run)
