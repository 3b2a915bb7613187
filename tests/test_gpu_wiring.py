"""The GPU code paths' decisions, checked where no GPU is: rules on literal dtypes and device
lists, graphs traced (not run) with the ops a GPU would run, and strategies constructed on
simulated GPUs (`simulated_gpus`: TensorFlow's device lists report them, its runtime has only
the CPU) followed to the devices and transports they would use."""

import json
import time

import pytest
import tensorflow as tf
from cluster import launch_script, run_script

from tfstrat.mesh import collectives


@pytest.mark.parametrize(
    "dtype,wire",
    [
        (tf.float32, tf.float32),
        (tf.float16, tf.float16),
        (tf.float64, tf.float64),
        (tf.int32, tf.int32),
        (tf.int64, tf.int64),
        (tf.bfloat16, tf.float32),  # no NcclAllReduce kernel: summed in float32
        (tf.int8, None),
        (tf.bool, None),
    ],
)
def test_nccl_sums_cross_in_a_dtype_nccl_has_a_kernel_for(dtype, wire):
    assert collectives.nccl_dtype(dtype) == wire


def test_a_bfloat16_nccl_sum_is_traced_in_float32_and_handed_back_in_bfloat16():
    """`NcclAllReduce` allows half, float, double, int32 and int64 (its op definition): a
    bfloat16 sum (ModelParallel under mixed_bfloat16 on GPUs) failed when the step was traced.
    Traced here on the CPU (building the graph needs no kernel)."""

    @tf.function(autograph=False)
    def sums(a, b):
        with tf.device("/device:GPU:0"):
            a = tf.identity(a)
        with tf.device("/device:GPU:1"):
            b = tf.identity(b)
        return collectives.nccl_all_sum([a, b])

    spec = tf.TensorSpec([4], tf.bfloat16)
    graph = sums.get_concrete_function(spec, spec).graph
    nccl = [op for op in graph.get_operations() if op.type == "NcclAllReduce"]
    assert len(nccl) == 2 and all(op.get_attr("T") == tf.float32 for op in nccl), nccl
    assert [t.dtype for t in graph.structured_outputs] == [tf.bfloat16, tf.bfloat16]
    assert [op.device for op in nccl] == ["/device:GPU:0", "/device:GPU:1"]
    with pytest.raises(TypeError, match="NCCL cannot sum int8"):
        collectives.nccl_all_sum([tf.zeros([2], tf.int8)] * 2)


# -- strategies constructed on simulated GPUs (tests/helpers/simulated_gpus.py) ------------------

GPU = "/job:localhost/replica:0/task:0/device:GPU:{}"
ONE_PROCESS = [
    "mirrored@1",
    "mirrored@2",
    "mirrored@8",
    "mirrored@1x2",  # one card split in two
    "collective@2",
    "collective@8",
    "collective@1x2",
    "model-parallel-1x2@2",
    "model-parallel-2x1@2",
    "model-parallel-1x2@1x2",
]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("wiring") / "wiring.json"
    run_script("gpu_wiring.py", str(out), *ONE_PROCESS)
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "case, transport, replicas",
    [
        ("mirrored@1", "ring", 1),  # one replica: nothing to all-reduce
        ("mirrored@2", "nccl", 2),
        ("mirrored@8", "nccl", 8),
        ("mirrored@1x2", "ring", 2),  # NCCL refuses two ranks on one card
        ("collective@2", "nccl", 2),
        ("collective@8", "nccl", 8),
        ("collective@1x2", "ring", 2),
    ],
)
def test_strategies_train_on_every_visible_gpu_over_the_transport_they_say(
    one_process, case, transport, replicas
):
    """Each strategy's constructor followed to the replica devices and the transport it
    would use: every simulated GPU (each logical one of a split card), never the CPU."""
    got = one_process[case]
    assert got["transport"] == transport, got
    assert got["replicas"] == replicas, got
    assert got["devices"] == [GPU.format(i) for i in range(replicas)], got


@pytest.mark.parametrize(
    "case, model, data",
    [
        ("model-parallel-1x2@2", "nccl", "copies"),  # the model axis over two cards
        ("model-parallel-2x1@2", "copies", "nccl"),  # the batch axis over two cards
        ("model-parallel-1x2@1x2", "copies", "copies"),  # one card split: no NCCL
    ],
)
def test_model_parallel_sums_over_nccl_on_separate_cards_only(one_process, case, model, data):
    got = one_process[case]
    assert (got["model_exchange"], got["data_exchange"]) == (model, data), got
    assert got["devices"] == [GPU.format(i) for i in range(2)], got


@pytest.mark.cluster
def test_a_launch_with_ps_tasks_gives_the_ps_no_gpu_and_workers_keep_the_batch_on_the_host(
    tmp_path,
):
    """`tfstrat launch --workers 2 --ps 1 --gpus 0,1`: each worker its own card, the ps none
    (read from the tasks' environments); ParameterServer computes on the worker's GPU and
    leaves Keras's global batches on the host, where the step cuts the worker's rows."""
    env = {"TFSTRAT_TEST_NVIDIA_DRIVER": str(driver(tmp_path / "driver", 2))}
    code, out = launch_script(
        "gpu_wiring.py", str(tmp_path), "ps", workers=2, ps=1, gpus=["0", "1"], env=env
    )
    assert code == 0, out[-6000:]  # each worker's card its own: no refusal
    for w in range(2):
        got = json.loads((tmp_path / f"worker_{w}.json").read_text())
        assert got["launched"] == {"ps:0": "", "worker:0": "0", "worker:1": "1"}, got
        ps = got["ps"]
        assert ps["cards"] == 1 and ps["cuda_visible_devices"] == str(w), ps
        assert ps["compute_device"] == f"/job:worker/replica:0/task:{w}/device:GPU:0", ps
        assert ps["keras_input_devices"] == [f"/job:worker/replica:0/task:{w}/device:CPU:0"], ps


def driver(where, cards: int):
    """A directory laid out as the NVIDIA driver's /proc/driver/nvidia/gpus with `cards`
    GPUs (tfstrat.launcher.gpus reads their UUIDs from it)."""
    for i in range(cards):
        card = where / f"0000:{i + 1:02x}:00.0"
        card.mkdir(parents=True)
        (card / "information").write_text(
            f"Model: \t\t NVIDIA A100-SXM4-40GB\nIRQ: \t\t {100 + i}\n"
            f"GPU UUID: \t GPU-{i:08d}-aaaa-bbbb-cccc-dddddddddddd\nVideo BIOS: \t ??.??\n"
        )
    return where


@pytest.mark.cluster
@pytest.mark.parametrize("strategy,ps", [("collective", 0), ("ps", 1)])
def test_two_workers_that_see_one_gpu_are_refused_by_name_at_start(tmp_path, strategy, ps):
    """`tfstrat launch --workers 2` on a one-GPU machine left both tasks on the card (nothing
    bound them here): the tasks compare their GPUs' UUIDs at start and each refuses, naming
    both tasks and the card, before a collective or a variable."""
    env = {"TFSTRAT_TEST_NVIDIA_DRIVER": str(driver(tmp_path / "driver", 1))}
    start = time.monotonic()
    code, out = launch_script(
        "gpu_wiring.py", str(tmp_path), f"{strategy}@1", workers=2, ps=ps, env=env, timeout=120
    )
    took = time.monotonic() - start
    assert code != 0, out[-4000:]
    card = "GPU-00000000-aaaa-bbbb-cccc-dddddddddddd"
    chief = "worker:0 (the chief)" if ps else "worker:0"  # ParameterServer's name for it
    for me in (chief, "worker:1"):
        assert f"UsageError: tfstrat: {me}: {chief} and worker:1 both see GPU {card}" in out, out[
            -6000:
        ]
    assert "Give each task its own GPUs" in out
    assert not list(tmp_path.glob("worker_*.json"))  # no strategy was made
    assert took < 100, took  # refused at start, not after a timeout


@pytest.mark.cluster
def test_two_workers_of_two_gpus_each_sum_their_cards_over_nccl(tmp_path):
    """The GPU tier's 2 x 2 case as far as it goes without a collective: `tfstrat launch
    --workers 2 --gpus 0,1,2,3` gives each worker two cards (distinct UUIDs), and each worker's
    two cards become two replicas summed over NCCL (MirroredNCCL over what the worker sees, as
    CollectiveAllReduce's local replicas: `collective@2` above). CollectiveAllReduce itself
    cannot be built across tasks here: its start-up agreement runs a collective on the GPUs."""
    env = {"TFSTRAT_TEST_NVIDIA_DRIVER": str(driver(tmp_path / "driver", 4))}
    code, out = launch_script(
        "gpu_wiring.py", str(tmp_path), "mirrored", workers=2, gpus=["0", "1", "2", "3"], env=env,
        timeout=120,
    )  # fmt: skip
    assert code == 0, out[-6000:]
    for w in range(2):
        got = json.loads((tmp_path / f"worker_{w}.json").read_text())
        assert got["launched"] == {"worker:0": "0,1", "worker:1": "2,3"}, got
        mine = got["mirrored"]
        assert mine["cards"] == 2 and mine["transport"] == "nccl", mine
        assert mine["replicas"] == 2, mine
        assert mine["devices"] == [GPU.format(0), GPU.format(1)], mine
