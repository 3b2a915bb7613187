"""`python -m tfstrat.launcher.inner`: the launcher inside a private network namespace
(`tfstrat launch --private-network`); its LaunchConfig comes as JSON on stdin."""

import json
import sys

from tfstrat.launcher.api import LaunchConfig, launch


def main() -> int:
    return launch(LaunchConfig(**json.loads(sys.stdin.read())))


if __name__ == "__main__":
    sys.exit(main())
