"""One benchmark process: trains a model on synthetic images and prints `RESULT {json}`.

Run by the benchmark drivers through `tfstrat launch`, one per task:
    python -m tfstrat.bench._worker '{"strategy": "collective", "model": "small", ...}'

Strategies: "none" (no strategy), "mirrored" (MirroredNCCL), "collective"
(CollectiveAllReduce; "collective-fp16", "collective-bf16", "collective-powersgdR" (PowerSGD of
rank R from the first step), "collective-powersgdRwN" (after N exact warm-up steps): with
`compression=`), "ps-sync" / "ps-async" (ParameterServer), "hybrid", "localsgd-N"
(LocalSGD, sync every N steps), "diloco-N" (LocalSGD with DiLoCo's outer Nesterov step;
"diloco-N-lrX": its outer learning rate X instead of 0.7), and
the stock peers "tfkeras-none", "tfkeras-mirrored", "tfkeras-mwms"
(tf-keras, TF_USE_LEGACY_KERAS=1) and "keras3-mwms" (stock MWMS under Keras 3).
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time

from tfstrat.errors import UsageError


def _serve_until_chief_exits():
    """A worker of stock ParameterServerStrategy: serve until the coordinator (chief) is gone."""
    import socket

    from tfstrat.cluster import TFConfig
    from tfstrat.ps.server import start_server

    config = TFConfig.from_env()
    server = start_server(config)  # noqa: F841 (kept alive while we wait)
    host, port = config.addresses("chief")[0].rsplit(":", 1)
    seen, deadline = False, time.monotonic() + 1800
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            seen = True
        except OSError:
            if seen:
                sys.exit(0)
        time.sleep(0.5)
    sys.exit("tfstrat bench: the chief never finished; giving up")


def _strategy(tf, name: str, devices: int):
    """Creates the strategy first, before any other op (collectives start with the program).
    With GPUs, a worker trains on every GPU it sees (`tfstrat launch` gave it its own)."""
    gpus = bool(tf.config.list_physical_devices("GPU"))
    if devices > 1 and not gpus:
        import tfstrat

        tfstrat.split_cpu(devices)
    cpus = [f"/device:CPU:{i}" for i in range(devices)]
    if name in ("none", "tfkeras-none"):
        return None
    if name == "mirrored":
        import tfstrat

        return tfstrat.MirroredNCCL(timeout=120)
    if name == "collective":
        import tfstrat

        cpus_given = devices if devices > 1 and not gpus else None
        return tfstrat.CollectiveAllReduce(devices=cpus_given, timeout=120)
    if name.startswith("collective-"):  # "collective-fp16", "collective-bf16", "-powersgdR"
        import tfstrat

        method = name.split("-", 1)[1]
        if method.startswith("powersgd"):  # "powersgd4": from the first step; "powersgd4w100"
            rank, _, warmup = method[8:].partition("w")
            if not rank.isdigit() or not (warmup.isdigit() or not warmup):
                raise UsageError(
                    f"Received: strategy={name!r}. Use collective-powersgdR or "
                    "collective-powersgdRwN, e.g. collective-powersgd4w100."
                )
            method = tfstrat.PowerSGD(rank=int(rank), warmup_steps=int(warmup or 0))
        return tfstrat.CollectiveAllReduce(compression=method, timeout=120)
    if name == "hybrid":
        import tfstrat

        return tfstrat.Hybrid(timeout=120)
    if name.startswith(("localsgd-", "diloco-")):
        import tfstrat

        kind, every, *lr = name.split("-")
        outer = "diloco" if kind == "diloco" else None
        if lr:  # "diloco-16-lr0.5"; a config, not a Keras optimizer: no TF op before this
            if kind != "diloco" or len(lr) != 1 or not lr[0].startswith("lr"):
                raise UsageError(
                    f"Received: strategy={name!r}. Use diloco-N-lrX, e.g. diloco-16-lr0.5."
                )
            sgd = {"learning_rate": float(lr[0][2:]), "momentum": 0.9, "nesterov": True}
            outer = {"class_name": "SGD", "config": sgd}
        return tfstrat.LocalSGD(sync_every=int(every), outer_optimizer=outer, timeout=120)
    if name in ("ps-sync", "ps-async"):
        import tfstrat

        return tfstrat.ParameterServer(mode=name[3:], timeout=120)
    if name == "tfkeras-mirrored":
        return tf.distribute.MirroredStrategy(
            cpus if not tf.config.list_physical_devices("GPU") else None
        )
    if name == "tfkeras-ps":  # stock async PS: the chief coordinates, workers only serve
        if not os.environ.get("TFSTRAT_TASK", "").startswith("chief"):
            _serve_until_chief_exits()
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        return tf.distribute.experimental.ParameterServerStrategy(resolver)
    if name in ("tfkeras-mwms", "keras3-mwms"):
        # TensorFlow's defaults, as its users run: a per-op timeout_seconds would start a
        # thread per collective op and slow the peer down (the launch's timeout ends a hang).
        return tf.distribute.MultiWorkerMirroredStrategy()
    raise UsageError(f"Received: strategy={name!r}. Unknown benchmark strategy.")


def _sparse_model(keras, vocab: int, dim: int, seq: int, classes: int):
    """LM1B-like: a large embedding table and a small dense head with real compute.

    Keras 3 rows use tfstrat's Embedding (Keras 3's reads the whole table every step), or
    Keras's own with TFSTRAT_BENCH_EMBEDDING=keras (under Hybrid both tables live on the ps);
    the tf-keras peers use tf-keras's, which gathers rows already.
    """
    import os

    layers = keras.layers
    embedding = layers.Embedding
    if keras.__name__ == "keras" and os.environ.get("TFSTRAT_BENCH_EMBEDDING") != "keras":
        from tfstrat.keras.layers import Embedding as embedding
    inputs = keras.Input((seq,), dtype="int32")
    x = embedding(vocab, dim)(inputs)
    x = layers.Conv1D(256, 3, padding="same", activation="relu")(x)
    x = layers.Conv1D(256, 3, padding="same", activation="relu")(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dense(256, activation="relu")(x)
    return keras.Model(inputs, layers.Dense(classes)(x))


#: Held-out images for the accuracy rows (the same for every seed and row). 1,024 is too few: a
#: standard error of 1.4 points at 75%, too coarse for a "within 1 point" goal.
HELD_OUT = 8192


def _teacher_data(np, seed: int, n: int, image: int):
    """Images a CNN with global pooling can learn to label: noise over a per-image colour;
    the label is a fixed random linear map of the colour (argmax of 10 scores)."""
    rng = np.random.default_rng(seed)
    color = rng.random((n, 1, 1, 3), dtype=np.float32)
    x = (0.5 * rng.random((n, image, image, 3), dtype=np.float32) + 0.5 * color).astype("float32")
    weights = np.random.default_rng(123).standard_normal((3, 10))
    return x, ((color.reshape(n, 3) - 0.5) @ weights).argmax(1).astype("int32")


@functools.lru_cache(maxsize=1)
def _held_out(image: int):
    """The held-out images and labels (made once: the curve evaluates them every few steps)."""
    import numpy as np

    return _teacher_data(np, 1, HELD_OUT, image)


def _held_out_accuracy(tf, np, model, image: int) -> float:
    """This worker's model on the held-out images, in slices (no collective)."""
    held_out, labels = _held_out(image)
    logits = np.concatenate(
        [model(tf.constant(held_out[i : i + 512]), training=False) for i in range(0, HELD_OUT, 512)]
    )
    return float((np.asarray(logits).argmax(1) == labels).mean())


def _available_bytes() -> int:
    """The host memory a new allocation can take now (`MemAvailable`), else the physical size."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def examples_in_memory(config: dict, global_batch: int, available: int) -> int:
    """How many distinct examples this process generates and repeats: 32 global batches for
    the accuracy rows (4 else), fewer when that would not fit its share of the host's
    `available` bytes (half of them over `host_processes` processes, each briefly holding two
    copies while the dataset is made, and the held-out images beside them); at least one
    global batch, else the row is refused naming what it needs.

    Example:
        >>> config = {"image": 224, "host_processes": 2, "accuracy": True}
        >>> examples_in_memory(config, 1024, 80 * 2**30)  # B-2 on 8 GPUs: 32,768 wanted
        13312
    """
    wanted = global_batch * (32 if config.get("accuracy") else 4)
    if config.get("workload") == "sparse":
        each = 4 * int(config["seq"]) + 4
    else:
        each = 4 * 3 * int(config["image"]) ** 2 + 4
    held_out = each * HELD_OUT if config.get("accuracy") else 0
    processes = max(1, int(config.get("host_processes", 1)))
    share = available // 2 // processes
    fit = (share - held_out) // (2 * each) // global_batch * global_batch
    if fit < global_batch:
        need = (2 * each * global_batch + held_out) * 2 * processes
        raise UsageError(
            f"Received: a global batch of {global_batch:,} examples of {each:,} bytes in each "
            f"of {processes} process(es), which needs about "
            f"{need / 2**30:.1f} GiB of host memory; this host has {available / 2**30:.1f} GiB "
            "available. Use a smaller --batch-per-device or --image, or fewer workers per host."
        )
    return min(wanted, fit)


def _data(tf, np, config: dict, global_batch: int):
    rng = np.random.default_rng(0)
    n = config["examples"]  # `examples_in_memory`, sized once in `main`
    if config.get("accuracy"):  # learnable labels; accuracy measured on held-out images
        seed = int(config.get("seed", 0))  # 0: the data every earlier run used
        x, y = _teacher_data(np, 1000 + seed if seed else 0, n, int(config["image"]))
    elif config.get("workload") == "sparse":
        seq, vocab = int(config["seq"]), int(config["vocab"])
        x = ((rng.zipf(1.2, (n, seq)) - 1) % vocab).astype("int32")  # Zipf-distributed ids
        y = (x[:, 0] % int(config["classes"])).astype("int32")
    else:
        image = int(config["image"])
        x = rng.random((n, image, image, 3), dtype=np.float32)
        y = rng.integers(0, 10, n).astype("int32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch, drop_remainder=True)
    return data.repeat().prefetch(2)


def _build(keras, config: dict):
    if config.get("workload") == "sparse":
        model = _sparse_model(
            keras,
            int(config["vocab"]),
            int(config["dim"]),
            int(config["seq"]),
            int(config["classes"]),
        )
        return model, keras.optimizers.Adagrad(0.1)
    return _model(keras, config["model"], int(config["image"])), keras.optimizers.SGD(
        0.01, momentum=0.9
    )


def _model(keras, name: str, image: int):
    if name == "resnet50":
        return keras.applications.ResNet50(weights=None, input_shape=(image, image, 3), classes=10)
    if name in ("mlp", "wide"):  # bound by the link; `bench cluster`'s dense row is "mlp"
        # mlp: 1.84M weights (7.4 MB of gradients a step); wide: ~10.5M (42 MB)
        width = 512 if name == "mlp" else 2048
        return keras.Sequential(
            [
                keras.Input((image, image, 3)),
                keras.layers.Flatten(),
                keras.layers.Dense(width, activation="relu"),
                keras.layers.Dense(width, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
    layers = keras.layers
    inputs = keras.Input((image, image, 3))
    x = layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
    for filters in (32, 64):  # two residual stages, ResNet-like
        shortcut = layers.Conv2D(filters, 1, strides=2)(x)
        y = layers.Conv2D(filters, 3, strides=2, padding="same", activation="relu")(x)
        y = layers.Conv2D(filters, 3, padding="same")(y)
        x = layers.Activation("relu")(layers.Add()([shortcut, y]))
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(10)(x))


def _curve_every(config: dict) -> int:
    """Held-out accuracy every this many steps (0: none); each epoch runs in such chunks."""
    every, steps = int(config.get("curve_every") or 0), int(config["steps"])
    if every and not config.get("accuracy"):
        raise UsageError(
            f"Received: curve_every={every} without accuracy. The curve is held-out accuracy: "
            "set accuracy too."
        )
    if every and (every < 0 or steps % every):
        raise UsageError(
            f"Received: curve_every={every} with steps={steps}. Use a divisor of steps."
        )
    return every


def main(config: dict) -> dict:
    every = _curve_every(config)  # before TensorFlow starts: a bad value costs nothing
    threads = int(config.get("threads") or 0)
    import tensorflow as tf

    if threads:  # thread pools are configuration: set before the runtime starts
        # Both pools: with 2 inter-op threads, one "single-threaded" process keeps 1.3-1.4
        # cores busy (independent ops run side by side), so 2 workers on 2 cores would fight.
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(int(config.get("inter_op", threads)))
    devices = int(config.get("devices", 1))
    strategy = _strategy(tf, config["strategy"], devices)
    created_at = time.time()  # wall clock: tasks on one machine's emulated hosts compare it
    created_cpu = time.process_time()
    if config["strategy"].startswith("tfkeras"):
        import tf_keras as keras
    else:
        import keras
    import numpy as np

    ps_mode = config["strategy"] == "tfkeras-ps"
    replicas = strategy.num_replicas_in_sync if strategy and not ps_mode else 1
    ps_ports = None
    if config["strategy"].startswith("ps-"):  # tfstrat's: the dataset carries the global batch
        replicas = strategy.num_workers
        addresses = strategy.extended.tf_config.addresses("ps")
        ps_ports = {int(a.rsplit(":", 1)[1]) for a in addresses}
    if config["strategy"] == "hybrid" and strategy.ps_addresses:  # tables: RPC on port + 1
        ps_ports = {int(a.rsplit(":", 1)[1]) + 1 for a in strategy.ps_addresses}
    global_batch = int(config["batch_per_device"]) * replicas  # PS: one worker's batch a step
    # Sized once, before any copy is made, so that every worker's dataset holds the same rows.
    config = {**config, "examples": examples_in_memory(config, global_batch, _available_bytes())}
    data = _data(tf, np, config, global_batch)
    if ps_mode:  # built on each worker from the function, not shipped from the coordinator
        data = keras.utils.experimental.DatasetCreator(
            lambda context: _data(tf, np, config, global_batch)
        )
    scope = strategy.scope() if strategy else tf.distribute.get_strategy().scope()
    if config.get("accuracy"):  # rows compared on accuracy start from the same weights
        keras.utils.set_random_seed(int(config.get("seed", 0)))
    with scope:
        model, optimizer = _build(keras, config)
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )

    class Curve(keras.callbacks.Callback):
        """Held-out accuracy every `curve_every` steps (each a short epoch: no sync in between)
        against the training time until then (from `fit`'s start, tracing included; the
        evaluations' own time left out)."""

        def on_train_begin(self, logs=None):
            self.points, self.eval_s = [], 0.0
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            if not every:
                return
            began = time.perf_counter()
            accuracy = _held_out_accuracy(tf, np, model, int(config["image"]))
            step = (epoch + 1) * every
            self.points.append([step, began - self.start - self.eval_s, accuracy])
            self.eval_s += time.perf_counter() - began

    class Clock(keras.callbacks.Callback):  # epoch times without the curve's evaluations
        def on_train_begin(self, logs=None):
            self.seconds = []

        def on_epoch_begin(self, epoch, logs=None):
            self.start, self.eval_start = time.perf_counter(), curve.eval_s

        def on_epoch_end(self, epoch, logs=None):
            evaluating = curve.eval_s - self.eval_start
            self.seconds.append(time.perf_counter() - self.start - evaluating)
            self.loss = float(logs.get("loss", float("nan")))

    class Traffic(keras.callbacks.Callback):  # bytes to and from the ps tasks, timed epochs
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == chunks:
                self.start = sum(tcp_bytes(ps_ports))

        def on_train_end(self, logs=None):
            self.per_step = (sum(tcp_bytes(ps_ports)) - self.start) / (steps * repeats)

    ring = getattr(
        getattr(getattr(strategy, "extended", None), "_cross_device_ops", None), "ring", None
    )

    class RingBytes(keras.callbacks.Callback):  # what the TCP ring sent, timed epochs
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == chunks:
                self.start = ring.bytes_sent

        def on_train_end(self, logs=None):
            self.per_step = (ring.bytes_sent - self.start) / (steps * repeats)

    class Marks(keras.callbacks.Callback):  # for a driver that reads counters outside
        first_step_at = None

        def on_epoch_begin(self, epoch, logs=None):
            if epoch == chunks:
                print("TIMED-BEGIN", flush=True)

        def on_train_end(self, logs=None):
            print("TIMED-END", flush=True)

    class FirstStep(Marks):  # stock ParameterServerStrategy refuses batch-level callbacks
        def on_train_batch_end(self, batch, logs=None):
            if self.first_step_at is None:
                self.first_step_at = time.time()
                self.first_step_cpu = time.process_time() - created_cpu

    from tfstrat.runtime.traffic import tcp_bytes

    marks = Marks() if ps_mode else FirstStep()
    curve, clock, traffic, ring_bytes = Curve(), Clock(), Traffic(), RingBytes()
    steps, repeats = int(config["steps"]), int(config["repeats"])
    chunks = steps // every if every else 1
    local_sgd = config["strategy"].startswith(("localsgd-", "diloco-"))
    if local_sgd:  # what this worker sends: on its sockets, every peer, and shared memory
        shared = lambda: ring.shared_bytes if ring is not None else 0  # noqa: E731
        tcp_bytes = lambda ports: (_sent_bytes() + shared(),)  # noqa: E731
    callbacks = [curve, clock] + ([traffic] if ps_ports or local_sgd else [])
    callbacks += [ring_bytes] if ring is not None and not local_sgd else []
    callbacks += [marks] if os.environ.get("TFSTRAT_BENCH_MARKS") else []
    model.fit(
        data,
        steps_per_epoch=steps // chunks,
        epochs=(1 + repeats) * chunks,
        verbose=0,
        callbacks=callbacks,
    )
    epochs = [sum(clock.seconds[i : i + chunks]) for i in range(0, len(clock.seconds), chunks)]
    timed = epochs[1:]  # epoch 0 traces and warms up
    profile_dir = os.environ.get("TFSTRAT_BENCH_PROFILE")
    if profile_dir:  # 10 more steps, traced: `python benchmarks/profile_summary.py DIR/TASK`
        task = os.environ.get("TFSTRAT_TASK", "worker:0").replace(":", "-")
        tf.profiler.experimental.start(os.path.join(profile_dir, task))
        model.fit(data, steps_per_epoch=10, epochs=1, verbose=0)
        tf.profiler.experimental.stop()
    rates = [steps * global_batch / s for s in timed]
    ops = getattr(getattr(strategy, "extended", None), "_cross_device_ops", None)
    sent = ops.bytes_sent_per_worker() if hasattr(ops, "bytes_sent_per_worker") else None
    if ring is not None and not local_sgd:  # measured on the ring, not computed
        sent = ring_bytes.per_step
    if ps_ports:  # measured on the sockets to the ps tasks, both directions
        sent = traffic.per_step + (sent or 0)
    if local_sgd:
        sent = traffic.per_step
    accuracy = None
    if config.get("accuracy"):
        accuracy = _held_out_accuracy(tf, np, model, int(config["image"]))
    import resource

    ps_rss = None
    if config["strategy"] == "hybrid" and strategy.ps_addresses:  # the table servers' memory
        clients = strategy._clients
        ps_rss = max(float(clients.call(i, "stats")[0]) for i in range(len(clients.addresses)))
    return {
        "ps_peak_rss_mb": ps_rss,
        "bytes_sent_per_step": None if ps_mode else (sent if replicas > 1 else 0),
        "final_loss": clock.loss,
        "accuracy": accuracy,
        "curve": curve.points,  # [step, training seconds, held-out accuracy]
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "replicas": replicas,
        "global_batch": global_batch,
        "examples_in_memory": config["examples"],
        "threads": tf.config.threading.get_intra_op_parallelism_threads(),
        "warmup_s": epochs[0],
        "created_at": created_at,  # the strategy made (wall clock)
        "first_step_at": marks.first_step_at,  # the first step done (with TFSTRAT_BENCH_MARKS)
        "startup_cpu_s": getattr(marks, "first_step_cpu", None),  # this process's CPU till then
        "epoch_s": timed,
        "steps_per_s": statistics.median(steps / s for s in timed),
        "examples_per_s": statistics.median(rates),
        "examples_per_s_min": min(rates),
        "examples_per_s_max": max(rates),
        "keras": getattr(keras, "__version__", "?"),
        "tensorflow": tf.__version__,
    }


def _sent_bytes() -> int:
    from tfstrat.runtime.traffic import tcp_bytes

    return tcp_bytes()[0]


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    result["task"] = os.environ.get("TFSTRAT_TASK", "worker:0")
    print("RESULT " + json.dumps(result), flush=True)
