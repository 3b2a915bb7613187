"""What the subcommands share: flag defaults from the environment, list parsing, exit codes,
and the multi-node flags of `tf-config` and `launch`."""

from __future__ import annotations

import os
import sys

from tfstrat.cluster import TFConfigError

EXIT_USAGE = 2


def env(flag: str, default=None, kind=str):
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


def csv(text: str | None) -> list[str]:
    return [a.strip() for a in text.split(",") if a.strip()] if text else []


def task(text: str) -> tuple[str, int]:
    kind, sep, index = text.partition(":")
    if not sep or not index.isdigit():
        raise TFConfigError(f"Received: --task {text!r}. Write it as TYPE:INDEX, e.g. worker:1.")
    return kind, int(index)


def vocabs(text: str) -> tuple[int, ...]:
    try:
        vocabs = tuple(int(v) for v in csv(text))
    except ValueError:
        vocabs = ()
    if not vocabs or min(vocabs) < 1:
        raise SystemExit(
            f"tfstrat bench: --vocab {text}: give table row counts >= 1, e.g. 200000,2000000"
        )
    return vocabs


def node_flags(g) -> None:
    """--nodes, --workers-per-node, --ps-per-node, --port (tf-config and launch)."""
    g.add_argument(
        "--nodes",
        default=env("nodes"),
        metavar="HOSTS",
        help="the machines, the same list on every node: host1,host2 or node[01-04]; "
        "host:port gives a node its own first port; IPv6 as [fd00::1]:port",
    )
    g.add_argument(
        "--workers-per-node",
        default=env("workers-per-node"),
        metavar="N",
        help="workers on every node (default 1), or one count per node: 2,2,0",
    )
    g.add_argument(
        "--ps-per-node",
        default=env("ps-per-node"),
        metavar="M",
        help="ps tasks on every node (default 0), or one count per node: 0,0,1",
    )
    g.add_argument(
        "--port",
        type=int,
        default=env("port", None, int),
        metavar="P",
        help="first task's port on every node (default 12345); tasks at P, P+2, ...; each also "
        "uses the port above its own",
    )


def node_layout(args):
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
