"""A worker whose error is followed by many warning lines (run by `tfstrat launch`, no TF).

Worker 0 fails with an error naming worker 1, and Python then prints 60 warnings as it tears
down, as TensorFlow does for every optimizer slot of an unfinished checkpoint restore. Worker 1
waits to be stopped. The launcher's box must still show the error and blame worker 1.
"""

import atexit
import json
import os
import sys
import time

index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]


def teardown():
    for i in range(60):
        print(
            "WARNING:tensorflow:Value in checkpoint could not be found in the restored object: "
            f"(root).optimizer._variables.{i}",
            file=sys.stderr,
            flush=True,
        )


if index == 0:
    atexit.register(teardown)
    raise TimeoutError("no reply from /job:worker/replica:0/task:1 after 60 s")
time.sleep(120)
