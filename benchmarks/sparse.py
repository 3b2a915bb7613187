"""An embedding-heavy LM1B-like model: one process, CollectiveAllReduce and the stock peers.

Run: python benchmarks/sparse.py --workers 2 --peer --out bench-out
(the same as `tfstrat bench sparse ...`).
"""

import sys

from tfstrat.commands.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "sparse", *sys.argv[1:]]))
