"""`tfstrat devices`: what this host has (CPUs, GPUs and whether NCCL can run, a TPU)."""

from __future__ import annotations

import json

from tfstrat.commands import _args


def run(args) -> int:
    from tfstrat.cluster.devices import devices
    from tfstrat.runtime.quiet import quiet_tensorflow_import

    with quiet_tensorflow_import():  # TensorFlow's import prints C++ start-up lines
        info = devices()
    print(json.dumps(info.to_dict(), indent=2) if args.json else info.table())
    return 0


def add_parser(sub) -> None:
    """The `tfstrat devices` subcommand, added to the parser `main` builds."""
    p = sub.add_parser("devices", help="what this host has: CPUs, GPUs (NCCL?), TPU")
    p.add_argument("--json", action="store_true", default=_args.env("json", False, bool))
    p.set_defaults(run=run)
