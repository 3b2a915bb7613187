"""Faults of CollectiveAllReduce and Hybrid: a peer that never comes up, workers that stop
(stop_training, SIGTERM), bad input. Real worker processes; every run has a hard time limit."""

import json
import os
import re
import subprocess
import sys
import time

import pytest
from cluster import launch_script, start_task

from tfstrat import TFConfig

pytestmark = [pytest.mark.faults, pytest.mark.cluster]


TIMEOUT = 15  # the strategies' `timeout=` in these scripts
START_UP = 60  # importing TensorFlow and tracing, on a loaded 2-core machine


NEVER_UP = 5  # the start-up deadline of the peer that never comes up: only waited out here


@pytest.mark.timeout(NEVER_UP + START_UP + 60)
def test_peer_that_never_comes_up_is_named():
    config = TFConfig.local(workers=2)
    started = time.monotonic()
    proc = start_task(config, "worker", 0, "faults_startup.py", str(NEVER_UP))
    try:
        out, _ = proc.communicate(timeout=NEVER_UP + START_UP + 30)
    finally:
        proc.kill()
    took = time.monotonic() - started
    # A plain failure (was -9: the watchdog's SIGKILL, which reads as an out-of-memory kill).
    assert proc.returncode == 1, out[-3000:]
    assert took < NEVER_UP + 15 + START_UP, took
    peer = config.addresses("worker")[1]
    assert f"worker:1 at {peer} did not come up within {NEVER_UP} s" in out, out[-3000:]


@pytest.mark.timeout(TIMEOUT + START_UP + 60)
def test_a_worker_whose_ring_port_is_taken_listens_on_another_and_says_so():
    """Ray picks each worker's TF_CONFIG port free but cannot reserve the one above it (where
    the ring listens); another socket holding it must not fail the job at start."""
    import socket

    config = TFConfig.local(workers=2)
    host, port = config.addresses("worker")[1].rsplit(":", 1)
    with socket.socket() as taken:
        taken.bind((host, int(port) + 1))
        taken.listen(1)
        procs = [start_task(config, "worker", i, "faults_startup.py", "60") for i in (0, 1)]
        try:
            outs = [p.communicate(timeout=START_UP + 60)[0] for p in procs]
        finally:
            for p in procs:
                p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0 and "the cluster came up" in out, out[-3000:]
    said = f"worker:1: its ring port {int(port) + 1} (TF_CONFIG port + 1) is in use"
    assert said in outs[1] and said not in outs[0], outs[1][-3000:]


@pytest.mark.timeout(TIMEOUT + START_UP + 60)
@pytest.mark.parametrize("case", ["size", "address"])
def test_workers_given_different_clusters_fail_naming_both(case):
    """Both tasks start (TensorFlow's coordination service knows them by name); without the
    agreement they failed in their first collective with TensorFlow's "Device ... is joining
    a group with size 3, but that group has size 2" (size) or in a connect (address)."""
    a, b, c = TFConfig.local(workers=3).addresses("worker")
    chief, other = {"size": ([a, b], [a, b, c]), "address": ([a, b], [a, c])}[case]
    views = [TFConfig.from_dict({"cluster": {"worker": w}}) for w in (chief, other)]
    started = time.monotonic()
    procs = [start_task(views[i], "worker", i, "faults_startup.py", str(TIMEOUT)) for i in (0, 1)]
    try:
        outs = [p.communicate(timeout=TIMEOUT + START_UP + 30)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    took = time.monotonic() - started
    said = (
        f"worker:1 has worker {other} in its TF_CONFIG cluster; worker:0 (the chief) has {chief}",
        f"worker:0 (the chief) has worker {chief} in its TF_CONFIG cluster; worker:1 has {other}",
    )
    for p, out, line in zip(procs, outs, said):
        assert p.returncode == 1 and "the cluster came up" not in out, out[-3000:]
        assert f"AgreementError: tfstrat: {line}" in out, out[-3000:]
    assert took < START_UP + TIMEOUT, took


def _results(out_dir, case):
    return [json.loads((out_dir / f"{case}_{i}.json").read_text()) for i in range(2)]


@pytest.mark.timeout(400)
def test_a_stop_on_one_worker_stops_every_worker_after_the_same_step(tmp_path):
    code, out = launch_script("faults_stop.py", str(tmp_path), "batch,epoch,nan")
    assert code == 0, out[-6000:]
    # batch: worker 1 alone stops after batch 7; the request rides in step 8's all-reduce.
    batch = _results(tmp_path, "batch")
    assert [r["iterations"] for r in batch] == [9, 9], batch
    assert [r["stop"] for r in batch] == ["requested"] * 2
    # epoch: worker 0 alone stops at the end of epoch 1 (20 steps per epoch): two epochs.
    epoch = _results(tmp_path, "epoch")
    assert [r["epochs"] for r in epoch] == [[0, 1], [0, 1]], epoch
    assert [r["iterations"] for r in epoch] == [40, 40], epoch
    # nan: TerminateOnNaN on worker 1 (its rows of batch 5 hold a NaN) stops both workers.
    nan = _results(tmp_path, "nan")
    assert nan[0]["iterations"] == nan[1]["iterations"] <= 8, nan
    assert "RingError" not in out and "different places" not in out, out[-6000:]


@pytest.mark.timeout(400)
def test_sigterm_stops_every_worker_saves_and_exits_143(tmp_path):
    started = time.monotonic()
    code, out = launch_script("faults_stop.py", str(tmp_path), "sigterm")
    took = time.monotonic() - started
    assert code == 143, out[-6000:]
    results = _results(tmp_path, "sigterm")
    # Worker 1 got SIGTERM after batch 6: both stop after step 8 at the latest.
    assert results[0]["iterations"] == results[1]["iterations"] <= 8, results
    assert [r["stop"] for r in results] == ["sigterm"] * 2
    assert os.listdir(tmp_path / "backup"), "BackupAndRestore saved nothing"
    assert "second SIGTERM: exiting now" not in out
    assert took < 300, took


@pytest.mark.timeout(120)
def test_empty_tf_config_is_a_clear_error():
    env = dict(os.environ, TF_CONFIG="")
    proc = subprocess.run(
        [sys.executable, "-c", "import tfstrat; tfstrat.CollectiveAllReduce()"],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode != 0
    assert "TFConfigError: Received: TF_CONFIG='' (set but empty)" in proc.stderr, proc.stderr
    assert "JSONDecodeError" not in proc.stderr


NO_TASK = """
import tfstrat
for name in ("CollectiveAllReduce", "Hybrid", "LocalSGD", "ParameterServer"):
    try:
        getattr(tfstrat, name)()
        print(name, "CREATED")
    except Exception as e:
        print(name, type(e).__name__, e)
"""


@pytest.mark.timeout(120)
def test_a_cluster_without_a_task_is_a_clear_error_for_every_strategy():
    """TensorFlow's own error ("When cluster_spec is given, you must also specify task_type and
    task_id") names neither TF_CONFIG nor the fix."""
    cluster = '{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:3"], "ps": ["127.0.0.1:5"]}}'
    proc = subprocess.run(
        [sys.executable, "-c", NO_TASK],
        env=dict(os.environ, TF_CONFIG=cluster),
        capture_output=True,
        text=True,
        timeout=100,
    )
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    assert set(lines) == {"CollectiveAllReduce", "Hybrid", "LocalSGD", "ParameterServer"}, (
        proc.stdout + proc.stderr[-3000:]
    )
    for name, line in lines.items():
        assert line.startswith(
            "TFConfigError Received: TF_CONFIG with a cluster (2 worker, 1 ps) but no 'task'. "
            f"{name} needs this process's own task: TF_CONFIG['task'] = "
        ), line
        assert "tfstrat tf-config --task worker:N" in line, line


@pytest.mark.timeout(400)
def test_input_that_cannot_train_is_refused_and_empty_slices_train_exactly(tmp_path):
    from cluster import run_script

    run_script("faults_input.py", str(tmp_path), "--reference")
    code, out = launch_script("faults_input.py", str(tmp_path))
    assert code == 0, out[-6000:]
    reference = json.loads((tmp_path / "reference.json").read_text())
    for i in range(2):
        r = json.loads((tmp_path / f"worker_{i}.json").read_text())
        assert r["empty"].startswith("UsageError: Received: input with no batches"), r["empty"]
        # Batches of 1 row: every step, one worker's slice is empty; it trains as one device.
        for key, value in reference["tiny"].items():
            assert r["tiny"][key] == pytest.approx(value, rel=1e-5), (key, r, reference)
        # 33 rows in batches of 16: worker 1's slice of the last batch is empty; the epoch's
        # logs still equal one device's (they were NaN).
        for key, value in reference["partial"].items():
            assert r["partial"][key] == pytest.approx(value, rel=1e-5), (key, r, reference)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", ["model", "options"])
def test_workers_that_disagree_all_fail_naming_the_difference(case):
    code, out = launch_script("faults_agree.py", case)
    ended = time.time()
    assert code == 1, out[-6000:]
    assert "trained, which it must not" not in out
    expected = {
        # Found as the kernel is created (its initial value is broadcast from the chief).
        "model": r"worker [01] creating variable 'kernel': another worker created a variable "
        "of another shape",
        "options": "worker:1",
    }[case]
    # Both workers fail; the launcher may stop the second before it prints its line.
    lines = [line for line in out.splitlines() if line.startswith("[worker:")]
    assert any("AgreementError" in line and re.search(expected, line) for line in lines), out[
        -6000:
    ]
    # From the first worker creating its strategy (the difference is there from the start,
    # TensorFlow imported): the agreement's one wait (30 s), and a busy machine's slack.
    starts = [float(line.split(" at ")[-1]) for line in lines if "strategy starts at " in line]
    took = ended - min(starts)
    assert took < 30 + 30, (took, out[-6000:])


@pytest.mark.timeout(400)
def test_hybrid_workers_name_a_ps_that_died():
    config = TFConfig.local(workers=2, ps=1)
    ps = start_task(config, "ps", 0, "-m", "tfstrat", "server")
    workers = [start_task(config, "worker", i, "faults_hybrid_ps.py") for i in range(2)]
    try:
        outs = [w.communicate(timeout=300)[0] for w in workers]
        ended = time.time()  # both workers have exited
    finally:
        for p in (ps, *workers):
            p.kill()
    # From the kill: the strategy's 20 s timeout, and a busy machine's slack.
    took = ended - float(outs[0].split("killing ps:0 at ")[1].split()[0])
    assert took < 20 + 30, (took, outs[0][-3000:])
    table = config.addresses("ps")[0].rsplit(":", 1)[0]
    named = f"on ps:0 (table server at {table}:"
    for w, out in zip(workers, outs):
        assert w.returncode not in (0, None), out[-3000:]
        assert "must not" not in out
        # Was: "Connection reset by peer (at emb/RpcGetValue)", naming no task. A worker whose
        # peer failed first on the dead ps may end on the ring instead, naming that peer.
        assert named in out or "closed the connection: it failed" in out, out[-3000:]
    assert any(named in out for out in outs), [out[-3000:] for out in outs]


def _mailed(config, step: int, worker: int, seconds: float) -> None:
    """Waits until ps 0 holds `worker`'s mail of `step` (group 0). Asked as a wait of 0 ms for
    a step that cannot be complete (the chief is gone), which only reads the mails."""
    from tfstrat.ps import steps, tables

    client = steps.Client(tables.rpc_address(config.addresses("ps")[0]), 10, "", 0, worker)
    deadline = time.monotonic() + seconds
    try:
        while True:
            ready, _, _, _, *mailed = client.call("wait_mailed", step, 0)
            assert not ready, "a step without the chief's mail cannot be complete"
            if mailed[worker] == step:
                return
            assert time.monotonic() < deadline, f"worker {worker} did not mail step {step}"
            time.sleep(0.1)
    finally:
        client.connection.close()


def _run_against(config, kind, mode):
    """Both workers of one run; under `ps fail`, worker 1 is killed once ps 0 holds its mail of
    step 3 (it then waits for the chief, who exited before step 3)."""
    args = ("relaunch_run.py", kind, mode)
    workers = [start_task(config, "worker", i, *args) for i in range(2)]
    try:
        if kind == "ps" and mode == "fail":
            first = workers[0].communicate(timeout=150)[0], workers[0].returncode
            _mailed(config, 3, 1, 30)
            workers[1].kill()
            return [first, (workers[1].communicate(timeout=30)[0], workers[1].returncode)]
        return [(w.communicate(timeout=150)[0], w.returncode) for w in workers]
    finally:
        for w in workers:
            w.kill()


@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind", ["hybrid", "ps"])
def test_a_relaunch_against_a_ps_that_outlived_its_workers_starts_afresh(kind):
    """Hybrid was: workers relaunched against a ps that still held a failed step's push failed
    with "a push for step 0 while step 3 has 1 of 2 pushes" until the ps restarted (and would
    have read the failed run's rows). ParameterServer was silently wrong: the relaunched chief
    counted worker 1's mail of the failed step as the new worker 1's, applied that stale
    gradient, and dropped the new worker's. Now each run begins on the ps (Hybrid: an id the
    workers agree on; ParameterServer: a rendezvous on ps 0), which drops the earlier run's
    tables, pushes and step state: the relaunch trains as on a fresh ps, to the same bits."""
    config = TFConfig.local(workers=2, ps=1)
    ps = start_task(config, "ps", 0, "-m", "tfstrat", "server")
    try:
        failed = _run_against(config, kind, "fail")
        assert all(code != 0 for _, code in failed), [out[-2000:] for out, _ in failed]
        dies = 1 if kind == "hybrid" else 0
        assert f"worker {dies} exits before step 3" in failed[dies][0], failed[dies][0][-2000:]
        digests = []
        for _ in range(2):  # the relaunch, then another run: each must find a fresh ps
            done = _run_against(config, kind, "train")
            for out, code in done:
                assert code == 0, out[-3000:]
            found = {re.search(r"trained: (\w+), dropped 0", out).group(1) for out, _ in done}
            assert len(found) == 1, found  # the two workers agree
            digests.append(found.pop())
        assert digests[0] == digests[1]
    finally:
        ps.kill()
        ps_out = ps.communicate(timeout=30)[0]
    if kind == "hybrid":
        said = r"a new run of the job began; (\d+) table\(s\) and (\d+) pending"
        # The relaunch dropped the table and the failed step's one push; the next run, the
        # table.
        assert re.findall(said, ps_out) == [("1", "1"), ("1", "0")], ps_out[-3000:]
    else:
        said = (
            r"group 0 began; the earlier run's step state dropped \(global step (\d+), the step "
            r"each worker last mailed: (\[.*?\])"
        )
        # The failed run's state: step 3 applied by nobody, worker 1's mail of it; then the
        # relaunch's (6 steps, both mailed the last).
        assert re.findall(said, ps_out) == [("3", "[2, 3]"), ("6", "[5, 5]")], ps_out[-3000:]


@pytest.mark.timeout(120)
def test_a_ps_whose_table_port_is_taken_fails_at_start_naming_it():
    import socket

    config = TFConfig.local(workers=1, ps=1)
    host, port = config.addresses("ps")[0].rsplit(":", 1)
    with socket.socket() as taken:
        taken.bind((host, int(port) + 1))
        taken.listen(1)
        proc = start_task(config, "ps", 0, "-m", "tfstrat", "server")
        try:
            out, _ = proc.communicate(timeout=100)
        finally:
            proc.kill()
    assert proc.returncode == 1, out[-3000:]
    expected = (
        f"ps:0: its table server (TF_CONFIG port + 1) cannot listen on {host}:{int(port) + 1}"
    )
    assert expected in out, out[-3000:]


@pytest.mark.timeout(400)
@pytest.mark.slow
def test_many_evaluates_do_not_crash_a_worker():
    """Before tfstrat skipped Keras's read-once build batch, 5 of 5 runs of 300 evaluates lost
    a worker to a SIGSEGV in TensorFlow's MultiDeviceIterator (one evaluate in 50-150 crashed).
    A CPU worker now reads through a plain iterator (no MultiDeviceIterator to crash), which
    this asserts; 30 calls keep the run's evaluates consistent (100 cost 4 min of CI)."""
    code, out = launch_script("stress_evaluate.py", "30")
    assert code == 0, out[-6000:]
    iterators = [line for line in out.splitlines() if "] iterator " in line]
    assert len(iterators) == 2 and all(x.endswith(" OwnedIterator") for x in iterators), out
    done = [line for line in out.splitlines() if "] done 30 " in line]
    assert len(done) == 2, out[-3000:]
    assert len(set(line.split("] ", 1)[1] for line in done)) == 1, done  # one loss, both workers
