"""The transport decision (`tfstrat.strategies.transport.choose`) over literal device lists.

What stock TensorFlow does is the bar: `MultiWorkerMirroredStrategy` takes NCCL with one or
more GPUs per worker, on one host or many; NCCL refuses two ranks on one card (virtual GPUs).
"""

import pytest

from tfstrat.strategies.transport import choose, normalize

GPU = [f"/device:GPU:{i}" for i in range(8)]
CPU = [f"/device:CPU:{i}" for i in range(4)]


@pytest.mark.parametrize(
    "replicas,workers,kind",
    [
        (GPU[:1], 2, "nccl"),  # one GPU per worker: the common multi-node layout
        (GPU[:1], 3, "nccl"),
        (GPU[:2], 1, "nccl"),  # one machine, two GPUs (MirroredNCCL)
        (GPU[:2], 3, "nccl"),
        (GPU[:8], 1, "nccl"),
        (GPU[:8], 2, "nccl"),
        (GPU[:1], 1, "ring"),  # one replica in all: nothing to all-reduce
        (CPU[:1], 2, "tcp"),  # CPU-only workers, one device each: tfstrat's ring
        (CPU[:1], 3, "tcp"),
        (CPU[:1], 1, "ring"),
        (CPU[:2], 1, "ring"),  # logical CPUs (tfstrat.split_cpu)
        (CPU[:2], 2, "tcp"),  # each worker sums its logical CPUs, then tfstrat's ring
        (CPU[:4], 3, "tcp"),
        (["/device:GPU:0", "/device:CPU:0"], 2, "ring"),  # mixed
    ],
)
def test_auto_picks_nccl_for_every_all_gpu_cluster(replicas, workers, kind):
    assert choose("auto", replicas, workers).kind == kind


def test_no_nccl_without_cuda_or_with_virtual_gpus():
    assert choose("auto", GPU[:2], 2, cuda_build=False).kind == "ring"
    virtual = choose("auto", GPU[:2], 1, virtual_gpus=True)
    assert virtual.kind == "ring" and "virtual" in virtual.why


def test_what_is_asked_for_is_honoured_or_refused_with_the_reason():
    assert choose("nccl", GPU[:1], 2).kind == "nccl"
    assert choose("ring", GPU[:1], 2).kind == "ring"
    assert choose("tcp", CPU[:1], 2).kind == "tcp"
    assert choose("nccl", GPU[:1], 2).implementation == "NCCL"
    assert choose("tcp", CPU[:1], 2).implementation == "RING"
    with pytest.raises(ValueError, match=r"communication='nccl'.*not all GPUs.*'auto' or 'ring'"):
        choose("nccl", CPU[:1], 2)
    with pytest.raises(ValueError, match=r"communication='nccl'.*virtual GPUs"):
        choose("nccl", GPU[:2], 1, virtual_gpus=True)
    with pytest.raises(ValueError, match=r"communication='nccl'.*no CUDA"):
        choose("nccl", GPU[:2], 1, cuda_build=False)
    # Several devices per worker: the worker sums them, then the ring (`sums_locally`).
    assert choose("tcp", CPU[:2], 2).kind == "tcp"
    with pytest.raises(ValueError, match=r"communication='carrier-pigeon'"):
        choose("carrier-pigeon", CPU[:1], 2)


@pytest.mark.parametrize(
    "name,expected",
    [
        ("/gpu:0", "/device:GPU:0"),
        ("GPU:1", "/device:GPU:1"),
        ("/device:GPU:2", "/device:GPU:2"),
        ("/cpu:1", "/device:CPU:1"),
        ("/job:worker/replica:0/task:1/device:GPU:3", "/job:worker/replica:0/task:1/device:GPU:3"),
    ],
)
def test_device_names_are_read_as_tensorflow_reads_them(name, expected):
    assert normalize(name) == expected


def test_a_name_that_is_no_device_is_refused():
    with pytest.raises(ValueError, match=r"device 'gpu0'.*'/gpu:0'"):
        normalize("gpu0")


def test_a_parameter_server_worker_computes_on_its_gpu():
    from tfstrat.ps.connect import compute_device

    assert compute_device("worker", 1, 1) == "/job:worker/replica:0/task:1/device:GPU:0"
    assert compute_device("chief", 0, 0) == "/job:chief/replica:0/task:0/device:CPU:0"
    with pytest.raises(ValueError, match=r"2 GPUs visible to worker:0.*one worker per GPU"):
        compute_device("worker", 0, 2)


def test_auto_counts_the_gpus_this_process_may_use():
    from tfstrat.cluster.devices import GPU, DeviceInfo
    from tfstrat.strategies.choice import choose as pick

    two = tuple(GPU(f"/physical_device:GPU:{i}") for i in range(2))
    assert pick(None, DeviceInfo(8, (), two, True, None, "2.21.0", None))[0] == "MirroredNCCL"
    hidden = DeviceInfo(8, (), two, True, None, "2.21.0", None, visible_gpus=1)
    assert pick(None, hidden) == ("default", "one worker, 1 GPU(s), no TPU")
