"""All-reduce latency and bandwidth between local processes, beside stock and loopback TCP.

Run: python benchmarks/allreduce.py --workers 2 --peer --out bench-out
(the same as `tfstrat bench allreduce ...`).
"""

import sys

from tfstrat.commands.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "allreduce", *sys.argv[1:]]))
