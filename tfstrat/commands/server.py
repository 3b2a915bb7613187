"""`tfstrat server`: this host's ps task (from TF_CONFIG), served until the process is stopped."""

from __future__ import annotations

import sys

from tfstrat.cluster import TFConfig
from tfstrat.commands import _args


def run(args) -> int:
    from tfstrat.errors import ServerError
    from tfstrat.ps.server import serve

    try:
        serve(TFConfig.from_env(), _args.task(args.task) if args.task else None)
    except ServerError as e:
        print(f"tfstrat server: {e}", file=sys.stderr)
        return 1
    return 0


def add_parser(sub) -> None:
    """The `tfstrat server` subcommand, added to the parser `main` builds."""
    p = sub.add_parser("server", help="run this host's ps task (from TF_CONFIG) until stopped")
    p.add_argument("--task", default=_args.env("task"), help="TYPE:INDEX, default TF_CONFIG's task")
    p.set_defaults(run=run)
