"""Nothing lost, exact resume: backups that survive a kill at any point, and a relaunch that
ends bit-identical to an uninterrupted run.

The cluster tests train three small models in one worker script (tests/workers/
faults_resume_run.py) under each strategy: each model once uninterrupted, once interrupted
(an exception on every worker, a SIGTERM, or the chief SIGKILLed while it writes a backup),
then a relaunch resumes the interrupted ones from their backups. Every variable of the model,
of the optimizer and (Hybrid) of the ps-held tables' slots must equal the uninterrupted run's,
bit for bit. The single-process parts (order of epochs, damaged backups, stale files) run in
one subprocess (tests/workers/faults_resume_local.py).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from cluster import RUN_TIMEOUT, launch_script
from paths import WORKERS

pytestmark = pytest.mark.faults


# -- one process -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume_local")
    proc = subprocess.run(
        [sys.executable, "faults_resume_local.py", str(out)],
        cwd=WORKERS,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        env=dict(os.environ, TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "results.json").read_text()), proc.stdout + proc.stderr


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_shuffled_epochs_differ_and_a_run_started_later_replays_them(local):
    order = local[0]["order"]
    epochs = [sum(order["epochs"][3 * e : 3 * e + 3], []) for e in range(3)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3, epochs  # a new order every epoch
    assert order["from_epoch_1"] == order["epochs"][3:]  # (seed, epoch) decides, not history
    assert order["skipping_1"] == order["epochs"][4:]


def test_a_writer_killed_between_weights_and_metadata_resumes_from_the_weights(local):
    between = local[0]["between"]
    assert between["metadata_epoch"] == 1  # the metadata still names the previous backup
    assert between["seen"] == [[2, 3]]  # the weights' own state wins: epoch 2, not 1
    assert between["same"]


def test_sigterm_saves_mid_epoch_and_the_relaunch_trains_the_rest_exactly(local):
    sigterm = local[0]["sigterm"]
    assert sigterm["first"] == [[0, 3], [1, 2]]
    assert sigterm["metadata"] == {"epoch": 1, "batch": 1, "batches_done": 2}
    assert sigterm["kept"] and sigterm["removed_after_resume"]
    assert sigterm["seen"] == [[1, 1], [2, 3]]  # the rest of epoch 1, in its order
    assert sigterm["iterations"] == 9  # no step repeated or run past the data
    assert sigterm["same"]


def test_double_checkpoint_falls_back_when_the_latest_is_damaged(local):
    damaged, output = local[0]["damaged"], local[1]
    backup = ["latest.weights.h5", "training_metadata.json"]
    assert damaged["files"] == sorted(backup + [f + ".bkp" for f in backup])
    for how in ("truncated", "overwritten"):  # overwritten: it opens, its checksum differs
        assert damaged[how]["seen"] == [[2, 3]], how  # from the previous backup (epoch 2)
        assert damaged[how]["same"], how
        assert damaged[how]["files"] == damaged["files"], how
    assert "checksum differs" in output
    error = damaged["alone"]["error"]
    assert "damaged backup" in error and "latest.weights.h5" in error and "Remove" in error


def test_stale_temporaries_of_dead_writers_are_removed(local):
    stale = local[0]["stale"]
    assert not stale["dead"] and not stale["mine"]
    assert stale["live"]  # another live process's file is left alone


def test_scratch_directories_are_named_per_job_and_task(tmp_path, monkeypatch):
    from tfstrat.keras.callbacks import _Scratch

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    monkeypatch.setenv("TF_CONFIG", json.dumps({"task": {"type": "worker", "index": 1}}))
    a, b, other = _Scratch("ckpt"), _Scratch("ckpt"), _Scratch("other")
    assert a.get() == b.get() != other.get()  # a restart reuses its directory
    assert os.path.basename(a.get()).startswith("tfstrat-worker-")
    assert a.get().endswith("-worker1")
    a.remove()
    assert not os.path.exists(b.path)


# -- clusters ----------------------------------------------------------------------------------

# Per strategy: (optimizer:interruption, ...) and the exit of the interrupted run. Hybrid's
# ps-held tables take SGD without momentum. Every interruption stops at a backup taken after
# epoch 0 (crash), after batch 4 of epoch 1 (crash-mid with save_freq=5, sigterm), or after
# epoch 1 (kill: the chief dies between that backup's weights and its metadata).
PLANS = {
    "collective": (["sgdm:crash-mid", "adagrad:crash", "adam:sigterm"], 143),
    "ps": (["adam:crash-mid", "sgdm:crash", "adagrad:kill"], 137),
    "hybrid": (["sgd:crash", "adam:crash-mid", "adagrad:sigterm"], 143),
}
RESUMED = {
    "crash": [[1, 10], [2, 10]],
    "crash-mid": [[1, 5], [2, 10]],
    "sigterm": [[1, 5], [2, 10]],
    "kill": [[2, 10]],
}


def _arrays(path) -> dict:
    import h5py

    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(
            lambda name, obj: (
                out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None
            )
        )
    return out


def _relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / (np.linalg.norm(a) or 1.0))


def _weights_state(path) -> dict:
    import h5py

    with h5py.File(path, "r") as f:
        return json.loads(f.attrs["tfstrat_backup"])


def _check_killed_between_writes(backup):
    """The chief died after the new weights, before their metadata: both are on disk."""
    names = os.listdir(backup)
    assert any(n.startswith(".tmp-") and n.endswith("training_metadata.json") for n in names)
    metadata = json.loads((backup / "training_metadata.json").read_text())
    assert metadata["epoch"] == 1 and _weights_state(backup / "latest.weights.h5")["epoch"] == 2


@pytest.mark.cluster
@pytest.mark.slow  # 60-130 s each on 2 idle cores: two cluster runs of six and three fits
@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
@pytest.mark.parametrize("kind", ["collective", "ps", "hybrid"])
def test_a_relaunch_resumes_bit_identical_to_an_uninterrupted_run(tmp_path, kind):
    plan, exit_code = PLANS[kind]
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {"TMPDIR": str(scratch)}
    ps = 0 if kind == "collective" else 1
    run = lambda phase: launch_script(  # noqa: E731
        "faults_resume_run.py", str(tmp_path), kind, phase, *plan, workers=2, ps=ps, env=env
    )
    code, out = run("first")
    assert code == exit_code, out[-6000:]
    if kind == "ps":
        _check_killed_between_writes(tmp_path / "backup" / "adagrad")
    code, out = run("resume")
    assert code == 0, out[-6000:]
    if kind == "ps":
        assert "removed" in out  # the dead chief's temporary
    trained = {}
    for task in ("worker1", "worker0"):
        trained = json.loads((tmp_path / f"resumed-{task}.json").read_text())
        for name, stop in (item.split(":") for item in plan):
            assert trained[name] == RESUMED[stop], (task, name, trained)
    differences = {}
    for name, _ in (item.split(":") for item in plan):
        full = _arrays(tmp_path / f"full-{name}.weights.h5")
        resumed = _arrays(tmp_path / f"resumed-{name}.weights.h5")
        assert full.keys() == resumed.keys(), (name, full.keys() ^ resumed.keys())
        differences[name] = max(_relative(full[k], resumed[k]) for k in full)
        unequal = [k for k in full if not np.array_equal(full[k], resumed[k])]
        assert not unequal, (name, unequal, differences)
        if kind == "hybrid" and name != "sgd":
            slots = {k.rsplit("/", 1)[1] for k in full if "/table_slots/" in k}
            assert slots == ({"accumulator"} if name == "adagrad" else {"momentum", "velocity"})
        assert trained[f"stock-{name}"] == 0.0  # loads into a plain Keras model
    # Nothing left behind: backups deleted at the end, no temporaries, no scratch copies.
    assert not [p for p in (tmp_path / "backup").rglob("*") if p.is_file()]
    assert not [p for p in tmp_path.rglob(".tmp-*")]
    assert not [p for p in scratch.iterdir() if p.name.startswith("tfstrat-worker-")]
