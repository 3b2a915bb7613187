"""Creates a CollectiveAllReduce whose peers may never come up.

Usage (under TF_CONFIG): python faults_startup.py TIMEOUT_SECONDS
"""

import sys

import tfstrat

tfstrat.CollectiveAllReduce(timeout=float(sys.argv[1]))
print("the cluster came up", flush=True)
