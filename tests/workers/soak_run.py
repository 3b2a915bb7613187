"""One task of a long run (run by `tfstrat launch`, or alone for the one-process strategies):
trains a small Embedding + Dense model for many steps and samples this process's threads,
open files, resident memory and step time as it goes.

Usage: python soak_run.py OUT_DIR KIND --steps N [--spe K[,K...]] [--devices D] [--every S]
       [--max-threads G] [--timeout T] [--gpus]

KIND: car (CollectiveAllReduce; `--communication ring` for TensorFlow's ring with one device),
hybrid (with or without ps tasks), localsgd, ps (ParameterServer sync), mirrored (MirroredNCCL
over D logical CPUs, one process; stock-mirrored: TensorFlow's MirroredStrategy so), model-parallel (ModelParallel on a (1, D) mesh, one process). `--gpus` (car and
mirrored): on every GPU the task sees instead of logical CPUs.

Each K of `--spe` is a phase: the model compiled with steps_per_execution K, then N steps of
`fit`. Every S steps (at a batch end) a sample {step, threads, open files, RSS KiB, time, traces
of train_step} is taken. Growth is measured from the phase's first sample after `--warmup`
steps. When the threads grew by more than G, training is asked to stop (every
worker stops after the same step) and the run is marked `stopped`: a leaking build ends in
seconds instead of exhausting the machine. Writes OUT_DIR/<task>.json.
"""

import argparse
import json
import os
import time

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("kind")
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--spe", default="1", help="steps_per_execution, or a list: 1,4 (a phase each)")
parser.add_argument("--devices", type=int, default=1)
parser.add_argument("--every", type=int, default=40)
parser.add_argument("--warmup", type=int, default=100)
parser.add_argument("--max-threads", type=int, default=50)
parser.add_argument("--timeout", type=float, default=60)
parser.add_argument("--communication", default="auto")
parser.add_argument("--rows", type=int, default=1536)
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--gpus", action="store_true", help="car, mirrored: on the visible GPUs")
args = parser.parse_args()

import tfstrat  # noqa: E402

if args.gpus and args.kind not in ("car", "mirrored"):
    raise SystemExit(f"--gpus: only car and mirrored run on GPUs here, not {args.kind!r}")
if not args.gpus and (
    args.devices > 1 or args.kind in ("mirrored", "stock-mirrored", "model-parallel")
):
    tfstrat.split_cpu(max(args.devices, 2))
devices = [f"/cpu:{i}" for i in range(args.devices)] if args.devices > 1 else None
if args.gpus:  # every GPU this task sees (`tfstrat launch` bound them), as users run
    devices = None
kind = args.kind
if kind == "mirrored" and args.gpus:
    strategy = tfstrat.MirroredNCCL(timeout=args.timeout)
elif kind == "car":
    strategy = tfstrat.CollectiveAllReduce(
        timeout=args.timeout, devices=devices, communication=args.communication
    )
elif kind == "hybrid":
    strategy = tfstrat.Hybrid(timeout=args.timeout, devices=devices)
elif kind == "localsgd":
    strategy = tfstrat.LocalSGD(sync_every=4, timeout=args.timeout)
elif kind == "ps":
    strategy = tfstrat.ParameterServer(mode="sync", timeout=args.timeout)
elif kind == "mirrored":
    cpus = [f"/cpu:{i}" for i in range(max(args.devices, 2))]
    strategy = tfstrat.MirroredNCCL(cpus, timeout=args.timeout)
elif kind == "stock-mirrored":  # the peer: TensorFlow's own MirroredStrategy
    import tensorflow as tf

    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(max(args.devices, 2))])
elif kind == "model-parallel":
    mesh = tfstrat.DeviceMesh((1, max(args.devices, 2)), ["batch", "model"])
    layout = tfstrat.LayoutMap(mesh)
    layout["dense.*kernel"] = (None, "model")
    strategy = tfstrat.ModelParallel(layout_map=layout, batch_dim_name="batch")
else:
    raise SystemExit(f"unknown KIND {kind!r}")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from common import data  # noqa: E402

task = os.environ.get("TFSTRAT_TASK", "worker:0")
TRACES = [0]


class Counted(keras.Model):
    def train_step(self, batch):
        TRACES[0] += 1  # Python runs only while the step is traced
        return super().train_step(batch)


def sample() -> dict:
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {
        "threads": len(os.listdir("/proc/self/task")),
        "files": len(os.listdir("/proc/self/fd")),
        "rss_kib": rss,
    }


def thread_names() -> dict:
    """How many of this process's threads have each name (where a leak shows who made it)."""
    names = {}
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                name = f.read().strip()
        except OSError:  # ended meanwhile
            continue
        names[name] = names.get(name, 0) + 1
    return names


class Sampler(keras.callbacks.Callback):
    """Samples every `--every` steps; asks to stop when the threads grew past the bound."""

    def __init__(self, spe):
        super().__init__()
        self.spe, self.samples, self.base, self.stopped = spe, [], None, False
        self.step, self.epoch_start, self.next, self.first_epoch_traces = 0, 0, 0, None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch_start = self.step

    def on_epoch_end(self, epoch, logs=None):
        if self.first_epoch_traces is None:
            self.first_epoch_traces = TRACES[0]

    def on_train_batch_end(self, batch, logs=None):
        self.step = self.epoch_start + batch + 1  # Keras passes an execution's last step
        if self.step < self.next:
            return
        self.next = self.step + args.every
        now = {"step": self.step, "time": time.monotonic(), "traces": TRACES[0], **sample()}
        self.samples.append(now)
        if self.base is None and self.step >= args.warmup:
            self.base = now
        if self.base is not None and now["threads"] - self.base["threads"] > args.max_threads:
            self.stopped = True
            self.model.stop_training = True  # a request: every worker stops after one step


keras.utils.set_random_seed(7)
x, y = data(args.rows)
with strategy.scope():
    inputs = keras.Input((x.shape[1],), dtype="int32")
    h = keras.layers.Embedding(1000, 8, name="emb")(inputs)
    h = keras.layers.GlobalAveragePooling1D()(h)
    h = keras.layers.Dense(16, activation="relu", name="dense_a")(h)
    model = Counted(inputs, keras.layers.Dense(4, name="dense_b")(h))
before = sample()
phases = []
for spe in [int(k) for k in args.spe.split(",")]:
    with strategy.scope():
        model.compile(
            optimizer=keras.optimizers.SGD(0.05),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=spe,
        )
    sampler = Sampler(spe)
    per_epoch = args.rows // args.batch
    started = time.monotonic()
    model.fit(
        x,
        y,
        batch_size=args.batch,
        epochs=-(-args.steps // per_epoch),
        shuffle=False,
        verbose=0,
        callbacks=[sampler],
    )
    took = time.monotonic() - started
    phases.append(
        {
            "spe": spe,
            "steps": sampler.step,
            "seconds": took,
            "base": sampler.base,
            "samples": sampler.samples,
            "stopped": sampler.stopped,
            "first_epoch_traces": sampler.first_epoch_traces,
            "traces": TRACES[0],
        }
    )
    print(
        f"{task}: spe {spe}: {sampler.step} steps in {took:.1f} s, threads "
        f"{sampler.samples[0]['threads']} -> {sample()['threads']}, stopped={sampler.stopped}",
        flush=True,
    )
os.makedirs(args.out, exist_ok=True)
result = {
    "task": task,
    "kind": kind,
    "devices": args.devices,
    "before": before,
    "after": sample(),
    "phases": phases,
    "thread_names": thread_names(),
    "loss": float(np.asarray(model.evaluate(x, y, batch_size=args.batch, verbose=0))),
}
with open(os.path.join(args.out, task.replace(":", "_") + ".json"), "w") as f:
    json.dump(result, f)
