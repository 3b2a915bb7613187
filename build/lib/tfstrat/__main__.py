import sys

from tfstrat.commands.main import main

sys.exit(main())
