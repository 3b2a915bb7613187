"""The `tfstrat` command's own behaviour: output formats, bad input, exit codes."""

import json
import subprocess
import sys

import pytest

from tfstrat.commands.main import main

TF_CONFIG_ARGS = [
    "tf-config",
    "--worker",
    "127.0.0.1:2222,127.0.0.1:2223",
    "--ps",
    "127.0.0.1:2224",
    "--task",
    "worker:1",
]


def test_tf_config_is_what_tensorflow_reads(capsys, monkeypatch):
    import tensorflow as tf

    assert main(TF_CONFIG_ARGS) == 0
    text = capsys.readouterr().out.strip()
    monkeypatch.setenv("TF_CONFIG", text)
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    assert resolver.cluster_spec().as_dict() == {
        "worker": ["127.0.0.1:2222", "127.0.0.1:2223"],
        "ps": ["127.0.0.1:2224"],
    }
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)


def test_tf_config_export_line(capsys):
    assert main([*TF_CONFIG_ARGS, "--export"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("export TF_CONFIG='") and line.endswith("'")
    json.loads(line[len("export TF_CONFIG='") : -1])


def test_flags_fall_back_to_environment(capsys, monkeypatch):
    monkeypatch.setenv("TFSTRAT_WORKER", "127.0.0.1:3000")
    monkeypatch.setenv("TFSTRAT_TASK", "worker:0")
    assert main(["tf-config"]) == 0
    assert json.loads(capsys.readouterr().out)["cluster"] == {"worker": ["127.0.0.1:3000"]}


@pytest.mark.parametrize(
    "args, named",
    [
        (["--worker", "127.0.0.1:2222", "--task", "worker:5"], "worker:5"),
        (["--worker", "127.0.0.1:99999", "--task", "worker:0"], "99999"),
        (["--worker", "nohostport", "--task", "worker:0"], "nohostport"),
        (["--worker", "127.0.0.1:2222", "--task", "boss:0"], "boss"),
        (["--worker", "127.0.0.1:2222", "--task", "worker"], "worker"),
    ],
)
def test_tf_config_bad_input_is_one_line_and_exit_2(args, named):
    proc = subprocess.run(
        [sys.executable, "-m", "tfstrat", "tf-config", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert named in proc.stderr and "Traceback" not in proc.stderr


def test_devices_json(capsys):
    import os

    import tensorflow as tf

    assert main(["devices", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    # Against what the OS and TensorFlow report themselves.
    assert info["cpu_count"] == len(os.sched_getaffinity(0))
    gpus = tf.config.list_physical_devices("GPU")
    assert [g["name"] for g in info["gpus"]] == [d.name for d in gpus]
    assert info["cuda_build"] is tf.test.is_built_with_cuda()
    assert info["nccl"] is (tf.test.is_built_with_cuda() and len(gpus) >= 1)


@pytest.mark.parametrize(
    "cuda_build, gpus, usable",
    [(True, 2, True), (True, 4, True), (True, 1, True), (True, 0, False), (False, 2, False)],
)
def test_nccl_is_usable_with_a_cuda_build_and_a_gpu(cuda_build, gpus, usable):
    """One GPU: NCCL across workers (one GPU per worker), as stock."""
    from tfstrat.cluster.devices import GPU, DeviceInfo

    info = DeviceInfo(
        cpu_count=8,
        physical_devices=(),
        gpus=tuple(GPU(f"/physical_device:GPU:{i}") for i in range(gpus)),
        cuda_build=cuda_build,
        tpu=None,
        tensorflow_version="2.21.0",
        keras_version=None,
    )
    assert info.to_dict()["nccl"] is usable
    assert ("NCCL usable  yes" in info.table()) is usable, info.table()


def test_devices_table(capsys):
    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert "TensorFlow" in out and "CPUs" in out and "NCCL usable" in out


def test_launch_without_command_is_usage_error(capsys):
    assert main(["launch", "--workers", "2"]) == 2
    assert "command" in capsys.readouterr().err


def test_version(capsys):
    from importlib import metadata

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"tfstrat {metadata.version('tfstrat')}"
