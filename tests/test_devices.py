"""Device detection must not start TensorFlow's runtime (after `list_logical_devices`, a multi-worker strategy can no longer be created)."""

import subprocess
import sys

import tfstrat

# Each check runs in a fresh interpreter: once the runtime starts in this one it cannot be undone.
DEVICES_THEN_MULTIWORKER = """
import json, os, socket
import tfstrat
from tfstrat.cluster.devices import runtime_initialized
info = tfstrat.devices()
assert not runtime_initialized(), "devices() started the runtime"
assert info.cpu_count >= 1 and info.tpu is None
import tensorflow as tf
assert len(info.gpus) == len(tf.config.list_physical_devices("GPU")), info  # whatever the host has
assert not runtime_initialized(), "listing physical devices started the runtime"
cfg = tfstrat.TFConfig.local(workers=1).for_task("worker", 0)
os.environ.update(cfg.to_env())
import tensorflow as tf
tf.distribute.MultiWorkerMirroredStrategy()   # fails if the runtime had started
print("OK")
"""

SPLIT = """
import tfstrat, tensorflow as tf
assert tfstrat.split_cpu(3) == ["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"]
assert len(tf.config.list_logical_devices("CPU")) == 3
tfstrat.split_cpu(3)    # same split again: fine
try:
    tfstrat.split_cpu(2)
except RuntimeError as e:
    assert "split_cpu(2)" in str(e) and "before any TensorFlow op" in str(e), e
    print("OK")
"""


def _python(code):
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


def test_devices_then_multiworker_strategy_still_works():
    _python(DEVICES_THEN_MULTIWORKER)


def test_split_cpu_and_its_late_error():
    _python(SPLIT)


def test_split_cpu_rejects_bad_counts():
    import pytest

    with pytest.raises(ValueError, match="n=0"):
        tfstrat.split_cpu(0)


def test_device_table_reports_the_cpus_and_the_nccl_rule():
    info = tfstrat.devices()
    text = info.table()
    assert any(line.split() == ["CPUs", str(info.cpu_count)] for line in text.splitlines())
    assert info.to_dict()["nccl"] is (info.cuda_build and len(info.gpus) >= 1)


def test_nvidia_smi_gets_the_card_cuda_visible_devices_names():
    from tfstrat.cluster.devices import smi_index

    assert smi_index(0, {"CUDA_VISIBLE_DEVICES": "2,3"}) == "2"
    assert smi_index(1, {"CUDA_VISIBLE_DEVICES": "2, 3"}) == "3"
    assert smi_index(0, {"CUDA_VISIBLE_DEVICES": "GPU-5a1b"}) == "GPU-5a1b"
    assert smi_index(1, {}) == "1"


AUTO = """
import json, os, sys
import tfstrat
case = sys.argv[1]
if case == "alone":
    import tensorflow as tf
    s = tfstrat.auto()
    assert s is tf.distribute.get_strategy(), s
elif case == "ps":
    cfg = tfstrat.TFConfig.from_hosts(worker=["127.0.0.1:2000"], ps=["127.0.0.1:2001"])
    os.environ.update(cfg.for_task("worker", 0).to_env())
    try:  # no ps runs at that address: Hybrid names its table server after the timeout
        tfstrat.auto(timeout=1)
    except TimeoutError as e:
        assert "Could not reach ps:0 at 127.0.0.1:2002" in str(e), e
    else:
        raise AssertionError("auto() reached a ps that does not exist")
print("OK")
"""


def test_auto_alone_and_with_ps_tasks():
    for case in ("alone", "ps"):
        proc = subprocess.run(
            [sys.executable, "-c", AUTO, case], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
        if case == "alone":
            assert "tfstrat.auto: TensorFlow's default strategy" in proc.stderr
        else:
            assert "tfstrat.auto: Hybrid (TF_CONFIG has 1 ps task(s)" in proc.stderr
