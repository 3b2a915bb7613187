import sys

from tfstrat.cli import main

sys.exit(main())
