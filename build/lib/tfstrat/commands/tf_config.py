"""`tfstrat tf-config`: a valid TF_CONFIG for one task, from addresses, `--nodes` or $TF_CONFIG;
with `--explain`, what every task listens on."""

from __future__ import annotations

import os

from tfstrat.cluster import TFConfig, TFConfigError
from tfstrat.commands import _args


def run(args) -> int:
    task_type, index = _args.task(args.task) if args.task else (None, None)
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
            worker=_args.csv(args.worker),
            ps=_args.csv(args.ps),
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


def add_parser(sub) -> None:
    """The `tfstrat tf-config` subcommand, added to the parser `main` builds."""
    p = sub.add_parser(
        "tf-config",
        help="print a valid TF_CONFIG for one task (from addresses, --nodes, or $TF_CONFIG), "
        "or with --explain what every task listens on",
    )
    g = p.add_argument_group("Cluster")
    g.add_argument("--worker", default=_args.env("worker"), help="worker addresses H:P,H:P")
    g.add_argument("--ps", default=_args.env("ps"), help="ps addresses H:P,...")
    g.add_argument("--chief", default=_args.env("chief"), help="the chief's address H:P")
    g.add_argument("--evaluator", default=_args.env("evaluator"), help="the evaluator's address")
    g.add_argument(
        "--task", default=_args.env("task"), help="this task, TYPE:INDEX (e.g. worker:1)"
    )
    g = p.add_argument_group("Nodes (the cluster `tfstrat launch --nodes` builds)")
    _args.node_flags(g)
    p.add_argument("--export", action="store_true", default=_args.env("export", False, bool))
    p.add_argument(
        "--explain",
        action="store_true",
        default=_args.env("explain", False, bool),
        help="print what every task listens on, where (TensorFlow's port P on all interfaces; "
        "tfstrat's ring or table server on P+1, at the task's own address), and the ports to "
        "open between the hosts, instead of the JSON",
    )
    p.set_defaults(run=run)
