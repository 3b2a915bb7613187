"""LocalSGD and DiLoCo: real worker processes started by `tfstrat launch`.

One launch runs every scenario of tests/workers/localsgd_run.py in sequence (each under its
own strategy: the process's cluster and TCP ring are reused), and one plain-Keras process
computes the single-device reference and loads the chief's checkpoint without tfstrat.
"""

import json
import sys

import numpy as np
import pytest
from cluster import RUN_TIMEOUT, launch_script, run_script
from common import relative_errors

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("localsgd")
    # Bytes are counted on the ring's sockets: TCP alone, as between two machines (on one, two
    # workers exchange the payload through shared memory and only headers cross the sockets).
    code, log = launch_script(
        "localsgd_run.py", str(out), workers=2, env={"TFSTRAT_RING_SHARED_MEMORY": "0"}
    )
    assert code == 0, log[-6000:]
    run_script("localsgd_run.py", str(out), "--plain")
    reports = [json.loads((out / f"worker_{i}.json").read_text()) for i in range(2)]
    arrays = [np.load(out / f"worker_{i}.npz") for i in range(2)]
    return out, reports, arrays, np.load(out / "plain.npz"), log


def _series(npz, name):
    keys = sorted(
        (k for k in npz.files if k.startswith(f"{name}/w")), key=lambda k: int(k[len(name) + 2 :])
    )
    return [npz[k] for k in keys]


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 120)
def test_sync_every_1_equals_single_device(cluster_run):
    _, reports, arrays, plain, log = cluster_run
    assert "tfstrat: LocalSGD, sync every 1 step(s), plain averaging" in log
    reference = _series(plain, "sync1")
    for i, a in enumerate(arrays):
        errs = relative_errors(_series(a, "sync1"), reference)
        assert max(errs) <= TOLERANCE, (i, errs)
        assert reports[i]["sync1"]["iterations"] == 40


@pytest.mark.cluster
@pytest.mark.slow
def test_sync_every_8_workers_end_identical_and_plain_keras_loads_the_checkpoint(cluster_run):
    _, reports, arrays, plain, _ = cluster_run
    w0, w1 = _series(arrays[0], "sync8"), _series(arrays[1], "sync8")
    assert max(float(np.abs(a - b).max()) for a, b in zip(w0, w1)) == 0.0  # BN statistics too
    loaded = _series(plain, "sync8")
    assert len(loaded) == len(w0)
    assert max(float(np.abs(a - b).max()) for a, b in zip(loaded, w0)) == 0.0
    report = reports[0]["sync8"]
    assert report["iterations"] == 40  # steps_per_execution=3: no step lost or repeated
    assert report["state"] == {"since_sync": 0}  # the end of fit synced
    # Per epoch of 20 steps: syncs after steps 8 and 16 and at the epoch's end, the stop
    # agreement at the epoch's end, and Keras reading and resetting its 2 metrics' 2 states
    # at the epoch's ends (4 + 4 scalars, as under CollectiveAllReduce); the model agreement's
    # 2 gathers once. Nothing in the other 17 steps of an epoch.
    assert report["ring_calls"] == 2 * (3 + 1 + 4 + 4) + 2, report


@pytest.mark.cluster
@pytest.mark.slow
def test_bytes_per_step_drop_with_sync_every(cluster_run):
    _, reports, _, _, _ = cluster_run
    sent = reports[0]["bytes"]["per_step"]
    params_bytes = 4 * reports[0]["bytes"]["params"]
    assert sent["4"] < sent["1"] / 3, sent
    assert sent["16"] < sent["4"] / 2, sent
    # Counted on the ring's sockets only. Nothing between sync points: at 16 a step costs a
    # 16th of a sync plus under 16 bytes (the epoch's metric reads and stop agreement, spread
    # over its steps); one ring call more per step would add a header each way, 16 bytes or
    # more each.
    assert sent["16"] <= sent["1"] / 16 + 16, sent
    # sync_every=1 moves what CollectiveAllReduce does (one all-reduce of the weights or the
    # gradients a step): the ring's 2(n-1)/n x size = size on 2 workers, sent and received,
    # and headers within 1% of it.
    assert 0.8 * sent["collective"] < sent["1"] < 1.25 * sent["collective"], sent
    assert 2 * params_bytes <= sent["1"] <= 1.01 * 2 * params_bytes, (sent, params_bytes)


@pytest.mark.cluster
@pytest.mark.slow
def test_diloco_on_digits_within_2_points_of_collective(cluster_run):
    _, reports, _, _, _ = cluster_run
    acc = reports[0]["digits"]
    assert acc["collective"] > 0.9, acc
    assert acc["diloco"] >= acc["collective"] - 0.02, acc
    assert acc["state"]["since_sync"] == 0 and acc["state"]["outer_iterations"] > 0, acc
    assert reports[1]["digits"]["diloco"] == acc["diloco"]  # one model on both workers


@pytest.mark.cluster
@pytest.mark.slow
def test_backup_and_restore_resume_is_exact(cluster_run):
    _, reports, _, _, _ = cluster_run
    for r in reports:
        resume = r["resume"]
        assert resume["epochs"] == [0, 1, 2, 3], resume  # the second fit resumed at epoch 2
        assert resume["max_diff"] == 0.0, resume  # weights, slots, outer slots, period
        assert resume["state"]["since_sync"] == 0


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.faults
def test_workers_with_different_outer_optimizers_are_refused_at_start():
    code, log = launch_script("localsgd_agree.py", workers=2)
    assert code != 0, log[-3000:]
    assert "not refused" not in log
    assert "worker:1 has outer_optimizer=" in log and "worker:0 (the chief) has" in log, log[-3000:]
    assert "Create the strategy with the same arguments on every task." in log


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"sync_every": 0}, "Received: sync_every=0."),
        ({"sync_every": 2.5}, "Received: sync_every=2.5."),
        ({"sync_every": True}, "Received: sync_every=True."),
        ({"outer_optimizer": "adam"}, "Received: outer_optimizer='adam'."),
        ({"outer_optimizer": object()}, "The outer optimizer must be a Keras optimizer"),
        ({"outer_optimizer": {"config": {}}}, "A dict must be"),
        ({"sync_slots": "yes"}, "Received: sync_slots='yes'."),
        ({"timeout": 0}, "Received: timeout=0."),
    ],
)
def test_bad_arguments_name_the_value_and_the_fix(kwargs, words):
    from tfstrat.strategies.localsgd import _check_arguments, _outer_config

    args = {"sync_every": 8, "outer_optimizer": None, "sync_slots": False, "timeout": 300}
    args.update(kwargs)
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(".", r"\.")):
        _check_arguments(**args)
        _outer_config(args["outer_optimizer"])


AUTO_PICKS = """
import os
import tfstrat
from tfstrat.strategies import collective

def picked(self, *args, **kwargs):  # which class auto() builds; then stop before any network
    print("PICKED", type(self).__name__, flush=True)
    raise SystemExit(0)

collective.CollectiveAllReduce.__init__ = picked  # LocalSGD is a CollectiveAllReduce
config = tfstrat.TFConfig.from_hosts(worker=["127.0.0.1:2000", "127.0.0.1:2002"])
os.environ.update(config.for_task("worker", 0).to_env())
tfstrat.auto()
"""


def test_auto_never_picks_localsgd():
    """LocalSGD changes the training algorithm: `auto()` with several workers builds
    CollectiveAllReduce itself."""
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-c", AUTO_PICKS], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "PICKED CollectiveAllReduce" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_weights_set_between_fits_are_the_next_periods_anchor(tmp_path):
    out = tmp_path / "reload.json"
    run_script("localsgd_reload.py", str(out))
    result = json.loads(out.read_text())
    assert result["moved"] > 1e-3, result  # the first fit trained
    assert result["outer_iterations"] == 3, result  # 2 syncs, then 1
    assert result["after"] == 0.0, result  # was half-way back to the first fit's weights


def test_the_outer_nesterov_step_is_dilocos_rule_written_out(tmp_path):
    out = tmp_path / "outer.json"
    run_script("localsgd_outer.py", str(out))
    result = json.loads(out.read_text())
    assert result["moved"] > 1e-2, result  # trained
    assert result["syncs"] == 11 and result["outer_iterations"] == 11, result  # 4, 4, 3
    assert result["since_sync"] == 0, result
    assert max(result["errors"]) < TOLERANCE, result


@pytest.mark.cluster
@pytest.mark.slow
def test_diloco_on_two_workers_is_the_algorithm_written_out(cluster_run):
    # Each worker steps on its half of every global batch; every 3 steps (and at the epoch's
    # end) the average's change is stepped by SGD(0.7, momentum=0.9, nesterov=True).
    _, reports, arrays, plain, _ = cluster_run
    reference = _series(plain, "diloco2")
    assert reference
    for i, a in enumerate(arrays):
        errs = relative_errors(_series(a, "diloco2"), reference)
        assert max(errs) <= TOLERANCE, (i, errs)
        assert reports[i]["diloco2"] == {"since_sync": 0, "outer_iterations": 8}, reports[i]
