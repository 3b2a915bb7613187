"""The `tfstrat` command: a thin skin over tfstrat's functions, one module per subcommand
(`devices`, `tf_config`, `launch`, `server`, `doctor`, `bench`), each with its `add_parser`.

Every flag falls back to an environment variable `TFSTRAT_<FLAG>` (dashes as underscores), so
`TFSTRAT_WORKERS=3 tfstrat launch -- python train.py` works like `--workers 3`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from tfstrat.cluster import TFConfigError
from tfstrat.commands import bench, devices, doctor, launch, server, tf_config
from tfstrat.commands._args import EXIT_USAGE

SUBCOMMANDS = (devices, tf_config, launch, bench, doctor, server)  # in `tfstrat --help`'s order


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
    for command in SUBCOMMANDS:
        command.add_parser(sub)
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
