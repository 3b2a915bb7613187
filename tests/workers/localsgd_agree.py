"""Two workers that create LocalSGD with different outer optimizers (run by `tfstrat launch`):
both must fail at start-up with an error naming worker:1 and the differing option.

Usage: python localsgd_agree.py
"""

import os

import tfstrat

rate = 0.5 if os.environ["TFSTRAT_TASK"] == "worker:1" else 0.7
outer = {"class_name": "SGD", "config": {"learning_rate": rate, "momentum": 0.9, "nesterov": True}}
try:
    tfstrat.LocalSGD(sync_every=8, outer_optimizer=outer, timeout=60)
except ValueError as e:  # AgreementError
    print(f"localsgd_agree: refused: {e}", flush=True)
    os._exit(3)  # at once: no TensorFlow teardown, which waits for the peer's coordination
print("localsgd_agree: not refused", flush=True)
