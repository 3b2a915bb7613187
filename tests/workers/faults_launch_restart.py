"""A worker for the launcher's restart tests; no TensorFlow, so each attempt takes a second.

Usage (under `tfstrat launch`): python faults_launch_restart.py OUT MODE
    MODE once:    worker 1 fails (exit 1) on attempt 0, every task succeeds on attempt 1
    MODE always:  worker 1 fails (exit 1) on every attempt
    MODE usage:   worker 1 exits 2 (a usage error: never restarted)
Every task appends "ATTEMPT TASK TF_CONFIG" to OUT/attempts.txt before anything else.
"""

import os
import sys
import time

out, mode = sys.argv[1], sys.argv[2]
attempt = int(os.environ.get("TFSTRAT_RESTART", "0"))
task = os.environ["TFSTRAT_TASK"]
with open(os.path.join(out, "attempts.txt"), "a") as f:
    f.write(f"{attempt} {task} {os.environ['TF_CONFIG']}\n")
print(f"attempt {attempt} of {task}", flush=True)
if task == "worker:1":
    deadline = time.monotonic() + 30  # worker 0 is up and running when worker 1 fails
    while f"{attempt} worker:0 " not in open(os.path.join(out, "attempts.txt")).read():
        assert time.monotonic() < deadline, "worker 0 did not start within 30 s"
        time.sleep(0.05)
    if mode == "usage":
        print("usage: faults_launch_restart.py OUT MODE", flush=True)
        sys.exit(2)
    if mode == "always" or attempt == 0:
        print(f"RuntimeError: planned failure on attempt {attempt}", flush=True)
        sys.exit(1)
    sys.exit(0)
if attempt == 0 or mode == "always":
    time.sleep(60)  # the launcher stops it when worker 1 fails
