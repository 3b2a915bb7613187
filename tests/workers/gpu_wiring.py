"""Strategies constructed on simulated GPUs (`simulated_gpus`): what each would train on and
what would carry its sums, without running a step (tests/test_gpu_wiring.py).

Usage: python gpu_wiring.py OUT CASE...

CASE: STRATEGY[@CARDS[xSPLIT]], STRATEGY one of mirrored, collective, ps, hybrid,
model-parallel-1x2 and model-parallel-2x1; CARDS GPUs are simulated (each split into SPLIT
logical GPUs), or without @ one per entry of this task's CUDA_VISIBLE_DEVICES (as `tfstrat
launch` bound them). Writes OUT (OUT/TYPE_INDEX.json under a TF_CONFIG) as JSON, one entry per
case: the replica devices, the transport, the task's CUDA_VISIBLE_DEVICES, and per strategy
what its input and sums would use; under a TF_CONFIG also every launched task's
CUDA_VISIBLE_DEVICES, read from its environment. TFSTRAT_TEST_NVIDIA_DRIVER: a directory
laid out as the NVIDIA driver's /proc/driver/nvidia/gpus, read for the GPUs' UUIDs instead.
"""

import json
import os
import pathlib
import sys

import simulated_gpus
import tensorflow as tf

import tfstrat
from tfstrat.launcher import gpus

if os.environ.get("TFSTRAT_TEST_NVIDIA_DRIVER"):
    gpus._DRIVER = os.environ["TFSTRAT_TEST_NVIDIA_DRIVER"]


def launched_tasks() -> dict:
    """{task: its CUDA_VISIBLE_DEVICES (None: unset)} for every task of this cluster (ps tasks
    included), read from the environments of the processes whose TF_CONFIG has this cluster
    (only a task's own process holds it: `tfstrat.launcher.watch`)."""
    mine = json.loads(os.environ["TF_CONFIG"])["cluster"]
    tasks = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                pairs = [e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e]
        except OSError:  # gone meanwhile, or not ours to read
            continue
        env = {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}
        config = json.loads(env.get("TF_CONFIG") or "{}")
        if config.get("cluster") == mine:
            task = config["task"]
            tasks[f"{task['type']}:{task['index']}"] = env.get("CUDA_VISIBLE_DEVICES")
    return tasks


def construct(kind: str) -> dict:
    result = {}
    if kind == "mirrored":
        strategy = tfstrat.MirroredNCCL()
        impl = strategy.extended._communication_options.implementation
        result["transport"] = impl.name.lower()
    elif kind in ("collective", "hybrid"):
        strategy = tfstrat.CollectiveAllReduce() if kind == "collective" else tfstrat.Hybrid()
        result["transport"] = strategy._transport.kind
    elif kind == "ps":
        strategy = tfstrat.ParameterServer()
        result["compute_device"] = strategy.extended._device
        # Keras's input: the devices its global batches are fetched to.
        from tfstrat.strategies import parameter_server

        dataset = tf.data.Dataset.from_tensor_slices(tf.zeros([8, 3])).batch(4)
        parameter_server._keras_input.active = True
        try:
            keras_input = strategy.experimental_distribute_dataset(dataset)
        finally:
            parameter_server._keras_input.active = False
        workers = keras_input._input_workers
        result["keras_input_devices"] = list(workers.compute_devices_for_worker(0))
    elif kind.startswith("model-parallel-"):
        shape = tuple(int(n) for n in kind.rsplit("-", 1)[1].split("x"))
        devices = [f"gpu:{i}" for i in range(shape[0] * shape[1])]
        mesh = tfstrat.DeviceMesh(shape, ["batch", "model"], devices=devices)
        strategy = tfstrat.ModelParallel(layout_map=tfstrat.LayoutMap(mesh))
        result["model_exchange"] = strategy.extended._tfstrat_model_exchange
        result["data_exchange"] = getattr(strategy.extended._cross_device_ops, "exchange", None)
    else:
        raise SystemExit(f"gpu_wiring.py: unknown strategy {kind!r}")
    result["replicas"] = strategy.num_replicas_in_sync
    result["devices"] = list(strategy.extended.worker_devices)
    return result


out = pathlib.Path(sys.argv[1])
results = {}
for case in sys.argv[2:]:
    kind, _, simulated = case.partition("@")
    if simulated:
        cards, _, split = simulated.partition("x")
        simulated_gpus.simulate(int(cards), int(split or 1))
    else:
        cards = simulated_gpus.from_environment()
    results[case] = {
        "cards": int(cards),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        **construct(kind),
    }
config = os.environ.get("TF_CONFIG")
if config:
    task = json.loads(config)["task"]
    out = out / f"{task['type']}_{task['index']}.json"
    results["launched"] = launched_tasks()
out.write_text(json.dumps(results))
print("WIRING", json.dumps(results), flush=True)
