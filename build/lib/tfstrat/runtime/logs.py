"""tfstrat's own log lines: shown by default at INFO, since they say what tfstrat chose.

Set `TFSTRAT_LOG_LEVEL=WARNING` to hide them. If the application configures logging itself
(a handler on the root logger), tfstrat's records simply propagate there instead.
"""

import logging
import os
import sys


def setup() -> None:
    logger = logging.getLogger("tfstrat")
    level = os.environ.get("TFSTRAT_LOG_LEVEL", "INFO").upper()
    logger.setLevel(getattr(logging, level, logging.INFO))
    if logging.getLogger().handlers or logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.propagate = False
