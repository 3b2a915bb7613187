"""A 2019 ResNet-50 Mirrored vs CollectiveAllReduce scaling table, remade on this host.

Run: python benchmarks/scaling.py --workers 1,2 --peer --out bench-out
(the same as `tfstrat bench scaling ...`; see `tfstrat bench --help`).
"""

import sys

from tfstrat.commands.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "scaling", *sys.argv[1:]]))
