"""`tfstrat launch` gives each training task its own GPUs (`tfstrat.launcher.gpus`).

The decisions are pure functions of literal GPU lists; the launch test names GPUs with `gpus=`
(honoured with no GPU present) and reads what each real task process was given.
"""

import io
import subprocess
import sys

import pytest

from tfstrat import LaunchConfig, launch
from tfstrat.launcher import gpus
from tfstrat.launcher.api import threads_per_task

W = [f"worker:{i}" for i in range(8)]


@pytest.mark.parametrize(
    "trainers,available,per_task,expected",
    [
        (W[:1], ["0"], None, {"worker:0": "0"}),
        (W[:2], ["0", "1"], None, {"worker:0": "0", "worker:1": "1"}),
        (W[:2], [str(i) for i in range(8)], None, {"worker:0": "0,1,2,3", "worker:1": "4,5,6,7"}),
        (W[:8], [str(i) for i in range(8)], None, {w: str(i) for i, w in enumerate(W)}),
        (
            W[:3],
            [str(i) for i in range(8)],
            2,
            {"worker:0": "0,1", "worker:1": "2,3", "worker:2": "4,5"},
        ),
        (["chief:0", "worker:0"], ["2", "5"], None, {"chief:0": "2", "worker:0": "5"}),  # a subset
        (W[:2], ["GPU-aa", "GPU-bb"], None, {"worker:0": "GPU-aa", "worker:1": "GPU-bb"}),  # UUIDs
        (W[:2], [], None, {}),  # a CPU-only host: nothing set
    ],
)
def test_each_training_task_gets_its_own_gpus(trainers, available, per_task, expected):
    assert gpus.bind(trainers, available, per_task) == expected


def test_ps_tasks_get_none_and_counts_that_do_not_split_are_refused():
    assert gpus.bind(W[:2], ["0", "1"], others=["ps:0"]) == {
        "worker:0": "0",
        "worker:1": "1",
        "ps:0": "",
    }
    with pytest.raises(
        ValueError, match=r"4 GPU\(s\) \(0,1,2,3\) for 3 training task.*--gpus-per-task 1"
    ):
        gpus.bind(W[:3], ["0", "1", "2", "3"])
    with pytest.raises(ValueError, match=r"gpus_per_task=2 for 3 training task.*6 GPUs.*has 4"):
        gpus.bind(W[:3], ["0", "1", "2", "3"], per_task=2)
    with pytest.raises(ValueError, match=r"gpus_per_task=1, but this launcher finds no GPU"):
        gpus.bind(W[:2], [], per_task=1)
    with pytest.raises(ValueError, match="gpus_per_task=0"):
        gpus.bind(W[:2], ["0", "1"], per_task=0)
    with pytest.raises(ValueError, match=r"at most 2 training task\(s\) here; or --gpus none"):
        gpus.bind(W[:3], ["0", "1"])
    with pytest.raises(ValueError, match="does not split evenly"):  # refused before any start
        LaunchConfig(["true"], workers=3, gpus=["0", "1"])


def test_found_gpus_that_do_not_split_go_evenly_fewer_are_refused_and_none_hides_them(
    monkeypatch,
):
    """Never every task on every card: three found GPUs for two workers bind one each (the
    third unused, said); one GPU for two workers is refused naming the fix (the two processes
    would share the card: memory taken twice, NCCL's "Duplicate GPU detected")."""
    three = {"CUDA_VISIBLE_DEVICES": "0,1,2"}
    binding, note = gpus.plan(W[:2], ["ps:0"], environ=three)
    assert binding == {"worker:0": "0", "worker:1": "1", "ps:0": ""}
    assert note.startswith("tfstrat launch: GPUs (CUDA_VISIBLE_DEVICES): worker:0 GPU 0, ")
    assert "3 GPU(s) do not split evenly among 2 training task(s): 1 each, 2 unused" in note
    found = {"CUDA_VISIBLE_DEVICES": "0"}  # one GPU, two workers
    with pytest.raises(ValueError, match=r"2 training task\(s\) on this machine, which has 1 GPU"):
        gpus.plan(W[:2], ["ps:0"], environ=found)
    with pytest.raises(ValueError, match="or pass --gpus none to train on the CPUs"):
        gpus.plan(W[:2], [], environ=found)
    with pytest.raises(ValueError, match="gpus_per_task=1 for 2 training task"):  # named: refused
        gpus.plan(W[:2], [], per_task=1, environ=found)
    for hidden in ([], ["none"]):
        assert gpus.plan(W[:2], ["ps:0"], hidden, environ=found) == (
            {"worker:0": "", "worker:1": "", "ps:0": ""},
            None,
        )
    assert gpus.plan(W[:2], [], environ=found | {"CUDA_VISIBLE_DEVICES": "3,4"}) == (
        {"worker:0": "3", "worker:1": "4"},
        None,
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ValueError, match="which has 1 GPU"):  # refused before any start
        LaunchConfig(["true"], workers=2)


def test_the_gpus_to_hand_out_come_from_the_flag_then_cuda_visible_devices():
    assert gpus.available(["0", " 3"], {"CUDA_VISIBLE_DEVICES": "1"}) == ["0", "3"]
    assert gpus.available(None, {"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert gpus.available(None, {"CUDA_VISIBLE_DEVICES": ""}) == []
    assert gpus.available(None, {"CUDA_VISIBLE_DEVICES": "-1"}) == []


def test_a_gpu_named_twice_is_refused():
    with pytest.raises(ValueError, match=r"GPUs 0,1,0, naming 0 more than once.*once"):
        gpus.bind(W[:3], ["0", "1", "0"])
    with pytest.raises(ValueError, match="naming 0 more than once"):  # before any start
        LaunchConfig(["true"], workers=2, gpus=["0", "0"])


def test_a_task_reads_its_gpus_uuids_as_cuda_selects_them_and_shared_cards_are_named(tmp_path):
    """Each task's GPUs by UUID from the driver's files (in PCI order, CUDA's order), chosen
    by CUDA_VISIBLE_DEVICES as CUDA chooses: by index, by UUID or unique prefix, up to the first
    entry that names no single GPU. Tasks of one machine that share a UUID are named."""
    for i, pci in enumerate(["0000:3b:00.0", "0000:1a:00.0", "0000:5e:00.0"]):
        (tmp_path / pci).mkdir()
        (tmp_path / pci / "information").write_text(
            f"Model: \t\t Tesla V100\nGPU UUID: \t GPU-{i}{i}{i}-x\nBus Location: \t {pci}\n"
        )
    by_pci = ["GPU-111-x", "GPU-000-x", "GPU-222-x"]  # 1a < 3b < 5e
    uuids = lambda visible: gpus.uuids(  # noqa: E731
        {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}, str(tmp_path)
    )
    assert uuids(None) == by_pci
    assert uuids("2,0") == ["GPU-222-x", "GPU-111-x"]
    assert uuids("GPU-000,1") == ["GPU-000-x", "GPU-000-x"]  # CUDA itself refuses this one
    assert uuids("0,7,1") == ["GPU-111-x"]  # 7 names no GPU: CUDA stops there
    assert uuids("GPU-,1") == []  # a prefix of every card names none
    assert uuids("") == uuids("-1") == []
    assert gpus.uuids({}, str(tmp_path / "none")) == []  # no driver
    assert gpus.shared({"worker:0": uuids("0,1"), "worker:1": uuids("2"), "ps:0": []}) == {}
    records = {"worker:0": uuids("0,1"), "worker:1": uuids("1"), "worker:2": uuids("GPU-0")}
    assert gpus.shared(records) == {"GPU-000-x": ["worker:0", "worker:1", "worker:2"]}
    refusal = gpus.sharing(records)
    assert refusal.startswith("worker:0, worker:1 and worker:2 all see GPU GPU-000-x: "), refusal
    assert "Give each task its own GPUs" in refusal


@pytest.mark.cluster
def test_launched_workers_see_their_own_cuda_visible_devices_and_keep_tensorflows_pools(
    monkeypatch,
):
    """Each worker its card; a task with GPUs keeps TensorFlow's thread pools (its math is on
    the card: a share of the cores would starve its input pipeline and kernel launches), the
    ps (no GPU) gets its share of the cores, and `threads_per_task` given is honoured."""
    for name in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    script = (
        "import os; e = os.environ.get; print('CVD', repr(e('CUDA_VISIBLE_DEVICES')), "
        "e('TF_NUM_INTRAOP_THREADS'), e('TF_NUM_INTEROP_THREADS'), e('OMP_NUM_THREADS'))"
    )
    command = [sys.executable, "-c", script]
    out = io.StringIO()
    config = LaunchConfig(command, workers=2, ps=1, gpus=["0", "1"], timeout=60)
    assert launch(config, out) == 0, out.getvalue()
    lines = out.getvalue().splitlines()
    line = "tfstrat launch: GPUs (CUDA_VISIBLE_DEVICES): worker:0 GPU 0, worker:1 GPU 1, ps:0 none"
    assert line in lines, lines
    assert "[worker:0] CVD '0' None None None" in lines, lines
    assert "[worker:1] CVD '1' None None None" in lines, lines
    # The ps (its output may be cut when the workers end): 16 cores over 2 training tasks.
    assert threads_per_task(config, gpus=False) == 8
    out = io.StringIO()
    config = LaunchConfig(command, workers=2, gpus=["0", "1"], threads_per_task=3, timeout=60)
    assert launch(config, out) == 0, out.getvalue()
    assert "[worker:1] CVD '1' 3 3 3" in out.getvalue().splitlines(), out.getvalue()


def test_the_command_line_refuses_gpus_that_do_not_split_with_exit_2():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfstrat",
            "launch",
            "--workers",
            "3",
            "--gpus",
            "0,1",
            "--",
            "true",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "2 GPU(s) (0,1) for 3 training task(s)" in proc.stderr
