"""A small ResNet on CIFAR-10-shaped images, and a 2019 ResNet-50 scaling table
(MirroredStrategy vs CollectiveAllReduce, 8 GPUs per worker) remade for this machine.

Alone, with no `--strategy` and no TF_CONFIG, it prints that table: the same training
run as one process under MirroredNCCL, then with `tfstrat.launch` as 1, 2 and 3 CollectiveAllReduce
workers (64 images per worker per step, so the global batch grows with the workers), with
global steps/s, examples/s, efficiency (examples/s over workers x the 1-worker row's) and the
held-out accuracy of each run:

    python examples/resnet_scaling.py --quick                  # rows: Mirrored, 1 and 2 workers
    python examples/resnet_scaling.py --workers 1,2,3

With `--strategy` (or under `tfstrat launch`, which sets TF_CONFIG) it trains once:

    python examples/resnet_scaling.py --strategy mirrored --quick
    tfstrat launch --workers 2 --threads-per-task 1 -- python examples/resnet_scaling.py --quick

Data: CIFAR-10 from tensorflow-datasets when it is already in its data_dir or with
`--download` (not with --quick); else generated 32x32x3 images of 10 classes (a blurred
colour template per class under noise, shifted at random), printed as such.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
import time

import _common
import numpy as np

PER_WORKER_BATCH = 64


def synthetic(n: int, seed: int = 0):
    """Images float32 (n, 32, 32, 3) in [0, 1] and labels int64 (n,), learnable."""
    rng = np.random.default_rng(seed)
    coarse = rng.random((10, 4, 4, 3))
    templates = coarse.repeat(8, axis=1).repeat(8, axis=2)  # 10 blocky colour patterns
    labels = rng.integers(0, 10, n)
    shifts = rng.integers(-3, 4, (n, 2))
    images = np.empty((n, 32, 32, 3), np.float32)
    for i in range(n):  # a shifted template: the network has to look, not memorise pixels
        images[i] = np.roll(templates[labels[i]], tuple(shifts[i]), axis=(0, 1))
    images = 0.5 * images + 0.5 * rng.random(images.shape, dtype=np.float32)
    return images, labels.astype(np.int64)


def cifar10(data_dir, download: bool):
    import tensorflow_datasets as tfds

    train, test = tfds.load(
        "cifar10",
        split=["train", "test"],
        batch_size=-1,
        as_supervised=True,
        data_dir=data_dir,
        download=download,
    )
    to_np = lambda d: (np.asarray(d[0], np.float32) / 255.0, np.asarray(d[1], np.int64))
    return to_np(tfds.as_numpy(train)), to_np(tfds.as_numpy(test))


def resnet(keras, width: int = 16, blocks: int = 1):
    """A CIFAR ResNet: a stem and three stages (width, 2x, 4x) of `blocks` residual blocks."""

    def bn():
        # momentum 0.9, not Keras's 0.99: the moving statistics settle within a short run.
        return keras.layers.BatchNormalization(momentum=0.9)

    def block(x, filters, stride):
        shortcut = x
        if stride != 1 or x.shape[-1] != filters:
            shortcut = keras.layers.Conv2D(filters, 1, strides=stride, use_bias=False)(x)
            shortcut = bn()(shortcut)
        y = keras.layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)(x)
        y = keras.layers.Activation("relu")(bn()(y))
        y = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(y)
        y = bn()(y)
        return keras.layers.Activation("relu")(keras.layers.Add()([shortcut, y]))

    inputs = keras.Input((32, 32, 3))
    x = keras.layers.Conv2D(width, 3, padding="same", use_bias=False)(inputs)
    x = keras.layers.Activation("relu")(bn()(x))
    for stage, filters in enumerate((width, 2 * width, 4 * width)):
        for b in range(blocks):
            x = block(x, filters, 2 if stage and not b else 1)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x))


def train(args) -> None:
    """One training run under `--strategy` (auto under `tfstrat launch`)."""
    strategy = _common.make_strategy(args.strategy or "auto")  # before any other TF op
    import keras

    workers = len(_common.tf_config().get("cluster", {}).get("worker", [])) or 1
    global_batch = PER_WORKER_BATCH * workers
    data = "synthetic"
    if not args.quick and _common.tfds_available("cifar10", args.data_dir, args.download):
        (x, y), (x_test, y_test) = cifar10(args.data_dir, args.download)
        data = "cifar10"
    else:
        if not args.quick:
            print("data: generated CIFAR-10-shaped images instead of CIFAR-10")
        steps = args.steps or (20 if args.quick else 80)
        x, y = synthetic(steps * global_batch + 1024)
        x, y, x_test, y_test = x[:-1024], y[:-1024], x[-1024:], y[-1024:]
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = resnet(keras, blocks=1 if args.quick else 2)
        model.compile(
            optimizer=keras.optimizers.Adam(3e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    epochs = args.epochs or (3 if args.quick else 10)
    history = model.fit(
        x,
        y,
        batch_size=global_batch,
        epochs=epochs,
        verbose=2,
        callbacks=[_common.throughput()],
    )
    _, accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
    rate = history.history["examples_per_s"][-1]
    _common.report(
        args,
        "resnet_scaling",
        strategy,
        history,
        "held-out accuracy",
        accuracy,
        data=data,
        global_batch=global_batch,
        steps_per_s=rate / global_batch,
    )


def table(args) -> None:
    """The scaling table: MirroredNCCL in one process, then 1, 2, 3... CollectiveAllReduce
    workers through `tfstrat.launch`, each a run of this script."""
    import tfstrat

    counts = [int(w) for w in (args.workers or ("1,2" if args.quick else "1,2,3")).split(",")]
    script = os.path.abspath(__file__)
    common = ["--quick"] if args.quick else []
    for flag, value in (("--epochs", args.epochs), ("--steps", args.steps)):
        if value:
            common += [flag, str(value)]
    if args.download:
        common.append("--download")
    if args.data_dir:
        common += ["--data-dir", args.data_dir]
    rows = []
    with tempfile.TemporaryDirectory(prefix="resnet-scaling-") as tmp:
        # One process, one thread in each TensorFlow pool, as each launched worker gets.
        out = os.path.join(tmp, "mirrored.json")
        env = dict(os.environ, TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1")
        env.pop("TF_CONFIG", None)
        print("== MirroredNCCL, one process", flush=True)
        proc = subprocess.run(
            [sys.executable, script, "--strategy", "mirrored", "--report", out, *common],
            env=env,
            capture_output=True,
            text=True,
        )
        rows.append(
            (
                "Mirrored",
                "MirroredNCCL",
                1,
                _result(out, proc.returncode, proc.stdout + proc.stderr),
            )
        )
        for w in counts:
            out = os.path.join(tmp, f"car{w}.json")
            print(f"== CollectiveAllReduce, {w} worker(s) (tfstrat.launch)", flush=True)
            log = io.StringIO()
            code = tfstrat.launch(
                tfstrat.LaunchConfig(
                    [sys.executable, script, "--strategy", "car", "--report", out, *common],
                    workers=w,
                    threads_per_task=1,
                    timeout=900,
                ),
                log,
            )
            rows.append((f"CAR-{w}", "CollectiveAllReduce", w, _result(out, code, log.getvalue())))
    _print_table(rows)
    if args.report:
        with open(args.report, "w") as f:
            json.dump([{"row": r, "workers": w, **(res or {})} for r, _, w, res in rows], f)


def _result(path: str, code: int, output: str) -> dict | None:
    if code == 0 and os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    print(f"   failed (exit code {code}); its last lines:\n{output[-3000:]}", flush=True)
    return None


def _print_table(rows) -> None:
    base = next((r[3] for r in rows if r[0] == "CAR-1" and r[3]), None)
    print()
    print(
        "| row | strategy | workers | global batch | global steps/s | examples/s | efficiency "
        "| held-out accuracy |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row, strategy, workers, res in rows:
        if res is None:
            print(f"| {row} | {strategy} | {workers} | - | failed | - | - | - |")
            continue
        rate = res["examples_per_s"]
        eff = (
            f"{rate / (workers * base['examples_per_s']):.0%}"
            if base and row != "Mirrored"
            else "-"
        )
        print(
            f"| {row} | {strategy} | {workers} | {res['global_batch']} | {res['steps_per_s']:.2f} "
            f"| {rate:,.0f} | {eff} | {res['value']:.4f} |"
        )
    print(
        f"\n{PER_WORKER_BATCH} examples per worker per step; rates are each run's last epoch "
        "(Throughput); one thread in each TensorFlow pool per process; efficiency(W) = "
        "examples/s(W) / (W x examples/s(CAR-1)). The 2019 table measured, with ResNet-50 on 8 GPUs "
        "a worker: Mirrored 1.26 global steps/s; CollectiveAllReduce 1.06, 1.98, 2.925 at 1, "
        "2, 3 workers."
    )


def main():
    parser = _common.parser(__doc__.splitlines()[0])
    parser.set_defaults(strategy=None)
    parser.add_argument(
        "--workers", default=None, help="table rows: worker counts (default 1,2,3; quick 1,2)"
    )
    parser.add_argument("--epochs", type=int, default=None, help="per run (the last is timed)")
    parser.add_argument("--steps", type=int, default=None, help="steps per epoch (synthetic)")
    args = parser.parse_args()
    if args.strategy is None and "TF_CONFIG" not in os.environ:
        start = time.perf_counter()
        table(args)
        print(f"(the table took {time.perf_counter() - start:.0f} s)")
    else:
        train(args)


if __name__ == "__main__":
    main()
