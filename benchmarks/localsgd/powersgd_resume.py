"""What a resume costs PowerSGD: its error feedback and Q are not in the backup.

Trains a wide MLP (Dense 256 -> 512 relu -> 512 relu -> 10, SGD(0.05, momentum=0.9), batch
128, 4,096 rows of 256 Gaussian features labelled by argmax(x @ w + noise), seed-fixed; 32
steps an epoch) on 2 workers of `tfstrat launch` under
`CollectiveAllReduce(compression=PowerSGD(rank=4))` (100 warm-up steps, the default), three
ways: exact (`compression=None`), uninterrupted, and stopped after epoch K (with
`tfstrat.keras.callbacks.BackupAndRestore` keeping its backup) then launched again to resume
from it. The relaunch starts PowerSGD's state afresh; its warm-up counts the optimizer's steps,
so past step 100 it compresses at once. Prints each epoch's training loss and accuracy.

    .venv/bin/python benchmarks/localsgd/powersgd_resume.py [--stop-after 4] [--epochs 8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile


def train(out: str, mode: str, epochs: int, stop_after: int) -> None:
    """One worker: mode "exact", "full", "stopped" (after epoch `stop_after`, its backup kept)
    or "resumed" (from that backup)."""
    import tfstrat

    compression = None if mode == "exact" else tfstrat.PowerSGD(rank=4)
    strategy = tfstrat.CollectiveAllReduce(compression=compression, timeout=60)
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, 256)).astype("float32")
    w = rng.normal(size=(256, 10)).astype("float32")
    y = np.argmax(x @ w + rng.normal(size=(4096, 10)).astype("float32"), axis=1)
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((256,)),
                keras.layers.Dense(512, activation="relu"),
                keras.layers.Dense(512, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        model.compile(
            keras.optimizers.SGD(0.05, momentum=0.9),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    callbacks = []
    if mode in ("stopped", "resumed"):  # one backup directory, kept at the end of a run
        backup = os.path.join(out, "backup")
        callbacks.append(tfstrat.keras.callbacks.BackupAndRestore(backup, delete_checkpoint=False))
    if mode == "stopped":

        class Stop(keras.callbacks.Callback):  # every worker, after epoch `stop_after`
            def on_epoch_end(self, epoch, logs=None):
                self.model.stop_training = epoch + 1 == stop_after

        callbacks.append(Stop())
    history = model.fit(x, y, batch_size=128, epochs=epochs, verbose=0, callbacks=callbacks)
    if strategy.worker_index == 0:
        first = epochs - len(history.history["loss"])  # a resumed run's history starts there
        with open(os.path.join(out, f"{mode}.json"), "w") as f:
            json.dump({"first_epoch": first, **history.history}, f)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--stop-after", type=int, default=4)
    parser.add_argument("--out", default=None, help="a directory (default: a temporary one)")
    parser.add_argument("--worker", nargs=2, metavar=("OUT", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        train(*args.worker, args.epochs, args.stop_after)
        return 0
    from tfstrat import LaunchConfig, launch

    out = args.out or tempfile.mkdtemp(prefix="powersgd-resume-")
    os.makedirs(out, exist_ok=True)
    settings = ["--epochs", str(args.epochs), "--stop-after", str(args.stop_after)]

    def run(mode: str) -> int:
        command = [sys.executable, os.path.abspath(__file__), *settings, "--worker", out, mode]
        with open(os.path.join(out, f"{mode}.log"), "a") as log:
            return launch(LaunchConfig(command, workers=2, timeout=600, threads_per_task=1), log)

    for mode in ("exact", "full"):
        if run(mode) != 0:
            raise SystemExit(f"the {mode} run failed: {out}/{mode}.log")
    for mode in ("stopped", "resumed"):
        if run(mode) != 0:
            raise SystemExit(f"the {mode} run failed: {out}/{mode}.log")
    runs = {}
    for mode in ("exact", "full", "resumed"):
        with open(os.path.join(out, f"{mode}.json")) as f:
            runs[mode] = json.load(f)
    print("| epoch | exact: loss, accuracy | PowerSGD uninterrupted | PowerSGD resumed |")
    print("|---|---|---|---|")
    for epoch in range(args.epochs):
        cells = []
        for mode in ("exact", "full", "resumed"):
            run_ = runs[mode]
            i = epoch - run_["first_epoch"]
            if i < 0:
                cells.append("(before the stop: as uninterrupted)")
            else:
                cells.append(f"{run_['loss'][i]:.4f}, {run_['accuracy'][i]:.3f}")
        print(f"| {epoch + 1} | " + " | ".join(cells) + " |")
    print(f"\nStopped after epoch {args.stop_after} ({32 * args.stop_after} steps) and relaunched")
    print(f"from the backup; logs and results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
