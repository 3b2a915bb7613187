"""Side-by-side ratios of `overhead.py`'s variants: one process per (variant, allocator,
code tree), all alive at once, asked in rotation for a window of steps each round.

Usage:
    python run.py --threads 1 --procs none:default,none:bfc,tfmir:auto,car:auto \\
        [--tree base=/tmp/base] [--rounds 6] [--steps 21]

A process is VARIANT[@TREE]:ALLOCATOR. Allocators: default (TensorFlow's own:
TF_CPU_ALLOCATOR_USE_BFC unset, TFSTRAT_CPU_ALLOCATOR=default), bfc
(TF_CPU_ALLOCATOR_USE_BFC=true exported), auto (neither: whatever creating the strategy does).
A tree is another copy of tfstrat put first on PYTHONPATH (e.g. the code before a change:
`git archive HEAD tfstrat | tar -x -C /tmp/base`). "none:default" (plain Keras in a stock
process: P-1) is always added; it is the reference.

Prints each round, then a table: median examples/s; the median over rounds of the process's
speed divided by P-1's in the same round, with the rounds' min-max (the spread is the noise of
a shared machine); CPU ms per step (system) and the ratio of P-1's CPU time per step to this
one's (steadier than the clock when other jobs load the machine); minor page faults per step;
the process's peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REFERENCE = "none:default"


class Proc:
    def __init__(self, spec: str, threads: int, trees: dict[str, str]):
        self.spec = spec
        variant_tree, alloc = spec.split(":")
        variant, _, tree = variant_tree.partition("@")
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TFSTRAT_LOG_LEVEL": "WARNING"}
        env.pop("TF_CPU_ALLOCATOR_USE_BFC", None)
        env.pop("TFSTRAT_CPU_ALLOCATOR", None)
        if alloc == "bfc":
            env["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
        elif alloc == "default":
            env["TFSTRAT_CPU_ALLOCATOR"] = "default"
        elif alloc != "auto":
            raise SystemExit(f"unknown allocator {alloc!r} in {spec!r}: default, bfc or auto")
        if tree:
            env["PYTHONPATH"] = trees[tree] + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, str(HERE / "overhead.py"), "--variant", variant]
        self.p = subprocess.Popen(
            [*cmd, "--threads", str(threads)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.results: list[dict] = []

    def wait_ready(self):
        for line in self.p.stdout:
            if line.startswith("READY"):
                return
        raise RuntimeError(f"{self.spec}: ended before it was ready (exit {self.p.wait()})")

    def run(self, steps: int) -> dict:
        self.p.stdin.write(f"run {steps}\n")
        self.p.stdin.flush()
        for line in self.p.stdout:
            if line.startswith("RESULT "):
                r = json.loads(line[7:])
                self.results.append(r)
                return r
        raise RuntimeError(f"{self.spec}: ended (exit {self.p.wait()})")

    def close(self):
        self.p.stdin.close()
        self.p.wait(timeout=60)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=1, help="TF pools' threads; 0 = default")
    p.add_argument("--procs", default="none:bfc,tfmir:auto,car:auto")
    p.add_argument("--tree", action="append", default=[], help="NAME=DIR")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=21)
    a = p.parse_args()
    trees = dict(t.split("=", 1) for t in a.tree)
    specs = a.procs.split(",")
    if REFERENCE not in specs:
        specs.insert(0, REFERENCE)
    started = time.monotonic()
    procs = [Proc(s, a.threads, trees) for s in specs]
    try:
        for proc in procs:
            proc.wait_ready()
        for r in range(a.rounds):
            order = procs[r % len(procs) :] + procs[: r % len(procs)]
            this = {proc.spec: proc.run(a.steps)["ex_s"] for proc in order}
            print(f"round {r}: " + ", ".join(f"{k}={v:.0f}" for k, v in this.items()), flush=True)
    finally:
        for proc in procs:
            proc.close()
    ref = procs[0].results
    print(
        f"\nthreads={a.threads or 'default'}, {a.rounds} rounds of {a.steps - 1} timed steps, "
        f"{time.monotonic() - started:.0f} s"
    )
    print(
        "| process | ex/s | / P-1 (min-max) | CPU ms/step (system) | P-1 CPU / this "
        "| faults/step | peak RSS MB |"
    )
    print("|---|---|---|---|---|---|---|")
    for proc in procs:
        res = proc.results
        speed = [x["ex_s"] / y["ex_s"] for x, y in zip(res, ref)]
        cpu = [y["cpu_ms"] / max(x["cpu_ms"], 1e-9) for x, y in zip(res, ref)]
        med = statistics.median
        print(
            f"| {proc.spec} | {med(x['ex_s'] for x in res):.0f} | {med(speed):.2f} "
            f"({min(speed):.2f}-{max(speed):.2f}) | {med(x['cpu_ms'] for x in res):.0f} "
            f"({med(x['sys_ms'] for x in res):.0f}) | {med(cpu):.2f} "
            f"| {med(x['faults'] for x in res):.0f} | {res[-1]['max_rss_mb']:.0f} |"
        )


if __name__ == "__main__":
    main()
