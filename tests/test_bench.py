"""Smoke test of the benchmarks: they run and write their files. Never a speed."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tfstrat.commands.main import main


@pytest.fixture
def plots():
    """The quick runs write their PNG with matplotlib, which scripts/test installs into a
    directory of its own (tests/conftest.py); without it they skip (fail under CI=true)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        why = (
            "the bench smoke tests check the PNG each benchmark draws with matplotlib, which is "
            "not importable here: run scripts/test (it installs matplotlib into .venv/plots), "
            "or pip install matplotlib"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)


def test_speed_ups_and_efficiency_from_examples_per_s():
    from tfstrat.bench.scaling import _derive

    rows = [
        {"row": "P-1", "workers": 1, "examples_per_s": 200.0},
        {"row": "P-all", "workers": 1, "examples_per_s": 500.0},
        {"row": "A-1", "workers": 1, "examples_per_s": 160.0},
        {"row": "A-2", "workers": 1, "examples_per_s": 250.0},
        {"row": "B-1", "workers": 1, "examples_per_s": 150.0},
        {"row": "B-2", "workers": 2, "examples_per_s": 240.0},
        {"row": "PS-S-2", "workers": 2, "examples_per_s": 100.0},
        {"row": "PS-A-2", "workers": 2, "error": "failed"},
    ]
    _derive(rows)
    by_row = {r.pop("row"): r for r in rows}
    approx = pytest.approx
    want = {"vs_P1": 1.2, "vs_A1": 1.5, "vs_A2": 0.96, "efficiency": 0.8, "efficiency_P1": 0.6}
    # efficiency: 240 / (2 x B-1's 150); efficiency_P1: 240 / (2 x P-1's 200)
    assert {k: by_row["B-2"][k] for k in want} == approx(want)
    assert by_row["B-1"]["efficiency"] == approx(1.0)
    assert by_row["PS-S-2"]["efficiency_P1"] == approx(0.25)
    assert "efficiency" not in by_row["PS-S-2"]  # only B rows scale CollectiveAllReduce
    assert by_row["P-all"]["vs_P1"] == approx(2.5) and "efficiency_P1" not in by_row["P-all"]
    assert by_row["PS-A-2"]["vs_P1"] is None and "efficiency_P1" not in by_row["PS-A-2"]


@pytest.mark.cluster
@pytest.mark.slow
def test_scaling_quick_writes_the_table(tmp_path, capsys, plots):
    # Three of the seven rows (CI time: each row is its own cluster); sparse runs H.
    ids = ["P-1", "B-2", "PS-S-2"]
    args = ["--quick", "--workers", "2", "--rows", ",".join(ids), "--out", str(tmp_path)]
    code = main(["bench", "scaling", *args])
    assert code == 0, capsys.readouterr()
    for ext in ("md", "json", "png"):
        assert (tmp_path / f"scaling.{ext}").stat().st_size > 0
    rows = json.loads((tmp_path / "scaling.json").read_text())
    assert [r["row"] for r in rows] == ids
    for r in rows:
        assert "error" not in r, r
        assert r["examples_per_s"] > 0 and r["machine"]["cpus"] >= 1
        assert r["global_batch"] == 8 * r["total_devices"]
    assert rows[ids.index("B-2")]["efficiency_P1"] > 0  # its arithmetic: the literal test below
    assert "efficiency vs P-1" in (tmp_path / "scaling.md").read_text()
    table = (tmp_path / "scaling.md").read_text()
    assert "| B-2 | CollectiveAllReduce | 2 | 1 | 2 |" in table


@pytest.mark.cluster
@pytest.mark.slow
def test_allreduce_quick_writes_the_table(tmp_path, capsys, plots):
    code = main(
        ["bench", "allreduce", "--quick", "--peer", "--workers", "2", "--out", str(tmp_path)]
    )
    assert code == 0, capsys.readouterr()
    rows = json.loads((tmp_path / "allreduce.json").read_text())
    assert [r["bytes"] for r in rows] == [4, 64, 1024, 16384]
    for r in rows:
        assert r["workers"] == 2 and r["tcp_GBps"] > 0
        for impl in ("tfstrat", "tfstrat-tcp", "tfstrat-grpc", "stock"):
            assert r[f"{impl}_ms"] > 0
            assert r[f"{impl}_busbw_GBps"] == pytest.approx(r[f"{impl}_algbw_GBps"])  # 2(n-1)/n = 1
    assert (tmp_path / "allreduce.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_model_parallel_quick_fits_wider_models_in_the_same_bytes(tmp_path, capsys, plots):
    code = main(["bench", "model-parallel", "--quick", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr()
    every = json.loads((tmp_path / "model-parallel.json").read_text())
    # --quick: one of each kind, and the speed rows of TensorFlow
    assert [r["row"] for r in every] == ["DP-2", "MP-1x2", "FSDP-2x1", "S-TF-1", "S-TF-MP-1x2"]
    rows, speed = every[:3], every[3:]
    for r in rows:
        assert max(r["held_bytes"]) == r["bookkeeping_bytes"] <= r["budget_bytes"], r
    dp, mp2, fsdp = rows
    assert dp["dim"] < mp2["dim"] and dp["params"] < mp2["params"]
    # FSDP on the same two devices as DP-2 holds about half of each kernel: a wider model
    assert dp["dim"] < fsdp["dim"] and dp["params"] < fsdp["params"], (dp, fsdp)
    # Data parallel moves gradients over the batch axis only; ModelParallel (1, n) the
    # layers' activations within the model group only; FSDP's all-gathers and
    # reduce-scatters cross the batch axis, more than data parallel's sums of its model.
    assert dp["model_axis_bytes"] == 0 and dp["batch_axis_bytes"] > 0
    assert mp2["batch_axis_bytes"] == 0 and mp2["model_axis_bytes"] > 0
    assert fsdp["model_axis_bytes"] == 0 and fsdp["batch_axis_bytes"] > 0
    # The speed rows: examples/s, each row's ratio to its backend's one device, the same
    # training (the split is exact: the same loss within float32's reach).
    one, split = speed
    assert one["ratio"] == 1.0 and split["ratio"] > 0, speed
    assert split["examples_per_s"] == pytest.approx(split["ratio"] * one["examples_per_s"])
    assert split["loss"] == pytest.approx(one["loss"], rel=1e-4), speed
    text = (tmp_path / "model-parallel.md").read_text()
    assert "vs its backend on one device" in text and one["machine"]["cpu"] in text, text
    assert (tmp_path / "model-parallel.png").stat().st_size > 0


@pytest.mark.cluster
@pytest.mark.slow
def test_sparse_quick_writes_the_table(tmp_path, capsys, plots):
    # Two rows at two table sizes (CI time); the table server's rows are H-2k's.
    ids = ["P-1", "H-2k"]
    args = ["--quick", "--workers", "2", "--rows", ",".join(ids), "--vocab", "3000,6000"]
    code = main(["bench", "sparse", *args, "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr()
    rows = json.loads((tmp_path / "sparse.json").read_text())
    assert [(r["vocab"], r["row"]) for r in rows] == [(v, i) for v in (3000, 6000) for i in ids]
    for r in rows:
        assert "error" not in r, r
        assert r["examples_per_s"] > 0 and r["final_loss"] > 0 and r["peak_rss_mb"] > 0
        assert r["table_bytes"] == r["vocab"] * 64 * 4
        # The Hybrid table server reports its own memory; no other row has one. H-2k's model
        # has a plain keras.layers.Embedding: its table is on the ps too.
        assert (r["ps_peak_rss_mb"] is not None) == r["row"].startswith("H-"), r
        assert r["ps_peak_rss_mb"] is None or r["ps_peak_rss_mb"] > 0
        assert r["vs_P1"] > 0  # against the P-1 of the same table size
        # Measured from what the strategy handed its collectives (a packed sparse gather was
        # there), and for ParameterServer and Hybrid on the sockets to the ps.
        assert r["row"] == "P-1" or r["bytes_sent_per_step"] > 0
    assert "| 6,000 |" in (tmp_path / "sparse.md").read_text()
    assert (tmp_path / "sparse.png").stat().st_size > 0


def test_a_bad_vocab_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit, match=r"--vocab 2e5: give table row counts"):
        main(["bench", "sparse", "--quick", "--vocab", "2e5", "--out", str(tmp_path)])


@pytest.mark.parametrize("name", ["scaling", "sparse"])
def test_every_stock_row_has_a_tuned_twin(name):
    # The twin runs the same peer with the allocator tfstrat gives its own tasks; the stock
    # row keeps TensorFlow's default (run_row adds TFSTRAT_CPU_ALLOCATOR=default to it).
    from tfstrat.bench import scaling, sparse

    module, config = {
        "scaling": (scaling, scaling.ScalingConfig(workers=(1, 2), peer=True, threads=1)),
        "sparse": (sparse, sparse.SparseConfig(workers=(2,), peer=True, threads=1)),
    }[name]
    rows = {r["row"]: r for r in module._rows(config, 2)}
    stock = [i for i in rows if i.startswith("S-") and not i.endswith("t")]
    assert stock and "S-1" in stock
    stock.append("P-1")  # plain Keras, so A-1 / P-1t compares one allocator with itself
    assert "P-allt" not in rows
    for i in stock:
        twin = rows[i + "t"]
        assert twin["strategy"] == rows[i]["strategy"] and twin["workers"] == rows[i]["workers"]
        assert twin["env"] == {**(rows[i]["env"] or {}), "TF_CPU_ALLOCATOR_USE_BFC": "true"}
        assert "TF_CPU_ALLOCATOR_USE_BFC" not in (rows[i]["env"] or {})
    assert not any(i.endswith("t") for i in rows if not i.startswith(("S-", "P-1")))


def test_an_unknown_row_is_refused_naming_the_rows_there_are(tmp_path, capsys):
    code = main(["bench", "sparse", "--quick", "--rows", "P-1,X-9", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "--rows X-9" in err and "P-1,P-1t,P-all,P-1x2,C-2" in err, err


def test_multi_worker_rows_are_read_against_the_side_by_side_limit():
    from tfstrat.bench import _report

    rows = [
        {"row": "P-1", "workers": 1, "examples_per_s": 100.0},
        {"row": "P-1x2", "workers": 2, "examples_per_s": 200.0},
        {"row": "C-2", "workers": 2, "examples_per_s": 170.0},
        {"row": "C-3", "workers": 3, "examples_per_s": 250.0},  # no P-1x3 in this run
    ]
    for r in rows:
        _report.against_limit(r, rows)
    assert [r["vs_limit"] for r in rows] == [None, None, 0.85, None]


def _tasks_with(marker: str) -> list[int]:
    """The pids of processes whose environment holds `marker` (the bench's tasks inherit it)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_ctrl_c_stops_the_bench_and_its_tasks_keeping_the_rows_measured(tmp_path):
    """Before: each SIGINT ended the current row's tasks and the benchmark went on to the next
    row, and the rows measured were lost with it."""
    marker = f"TFSTRAT_TEST_BENCH_MARK={tmp_path.name}"
    args = ["--quick", "--workers", "2", "--rows", "P-1,P-1x2,C-2", "--vocab", "3000"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tfstrat", "bench", "sparse", *args, "--out", str(tmp_path)],
        env={**os.environ, marker.split("=")[0]: marker.split("=")[1]},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen = []
    for line in proc.stdout:  # until the first row is done and the second one's tasks run
        seen.append(line)
        if "[1/3] P-1 " in line:
            break
    deadline = time.monotonic() + 60
    while len(_tasks_with(marker)) < 3 and time.monotonic() < deadline:  # bench + 2 tasks
        time.sleep(0.2)
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    took = time.monotonic() - started
    assert proc.returncode == 130, "".join(seen) + out
    assert "interrupted; the rows measured before it are in" in out, out
    assert took < 60, took  # not the next row: the bench stopped
    assert "[2/3]" not in out and "[3/3]" not in out, out
    rows = json.loads((tmp_path / "sparse.json").read_text())
    assert [r["row"] for r in rows] == ["P-1"] and rows[0]["examples_per_s"] > 0
    assert _tasks_with(marker) == [], "tasks left running"


def test_scaling_rows_on_a_gpu_host_split_its_gpus_among_the_workers():
    """A rows train on all 8 GPUs; B-W's W workers split them (the launcher gives each its
    own); a worker count that does not divide them has no row."""
    from tfstrat.bench import scaling

    config = scaling.ScalingConfig(workers=(1, 2, 3, 4), threads=1)
    rows = {r["row"]: r for r in scaling._rows(config, 16, gpus=8)}
    assert rows["A-1"]["devices_per_worker"] == rows["A-2"]["devices_per_worker"] == 8
    assert [rows[f"B-{w}"]["devices_per_worker"] for w in (1, 2, 4)] == [8, 4, 2]
    assert "B-3" not in rows
    assert "splitting this host's 8 GPUs" in rows["B-2"]["label"]
    cpu = {r["row"]: r for r in scaling._rows(config, 2)}
    assert cpu["B-2"]["devices_per_worker"] == 1 and cpu["B-2"]["label"] == "CollectiveAllReduce"


def test_a_gpu_hosts_rows_give_each_task_its_rows_gpus_and_its_share_of_memory(monkeypatch):
    """On an 8-GPU host each task is launched with its row's GPUs (LocalSGD's and
    ParameterServer's rows one per worker, which is all they accept; B-2 four each), and each
    worker is told how many processes share the host's memory."""
    from tfstrat.bench import _report, scaling

    launched = {}

    def run_row(module, config, **kw):  # the launch itself is tested in tests/test_launch_gpus.py
        launched[config["strategy"], kw["workers"]] = (kw["gpus_per_task"], config)
        return {"error": "not run"}

    monkeypatch.setattr(_report, "run_row", run_row)
    config = scaling.ScalingConfig(workers=(1, 2), threads=1, model="small", image=32)
    config = scaling._resolve(config, {"gpus": 8, "cpus": 16})
    scaling._measure(scaling._rows(config, 16, gpus=8), config, {"gpus": 8, "cpus": 16})
    assert launched["collective", 2][0] == 4 and launched["mirrored", 1][0] == 8
    for strategy in ("localsgd-1", "localsgd-16", "ps-sync", "ps-async"):
        gpus, worker_config = launched[strategy, 2]
        assert gpus == 1 and worker_config["devices"] == 1, (strategy, gpus)
        assert worker_config["host_processes"] == 2
    launched.clear()
    scaling._measure(scaling._rows(config, 2), config, {"gpus": 0, "cpus": 2})
    assert {gpus for gpus, _ in launched.values()} == {None}  # no GPU: the launcher's default


def test_a_worker_holds_what_fits_the_host_and_refuses_a_batch_that_cannot():
    """The B rows' 224x224 images: 32 global batches wanted per process; on a host with less
    memory, fewer (whole global batches), and a row whose one global batch cannot fit is
    refused, naming the memory it needs and what there is."""
    from tfstrat.bench._worker import examples_in_memory
    from tfstrat.errors import UsageError

    small = {"image": 32, "host_processes": 2, "accuracy": True}
    assert examples_in_memory(small, 128, 16 * 2**30) == 128 * 32  # the CPU rows: all of it
    big = {"image": 224, "host_processes": 2, "accuracy": True}
    assert examples_in_memory(big, 1024, 2**40) == 1024 * 32
    fits = examples_in_memory(big, 1024, 40 * 2**30)
    assert fits % 1024 == 0 and 1024 <= fits < 1024 * 32
    held_out = 602_116 * 8192  # the accuracy rows' held-out images, beside the data
    assert 2 * 2 * (2 * 602_116 * fits + held_out) <= 40 * 2**30
    with pytest.raises(UsageError, match=r"needs about .* GiB of host memory; this host has "):
        examples_in_memory({**big, "host_processes": 8}, 1024, 16 * 2**30)


@pytest.mark.timeout(120)
def test_the_worker_measures_held_out_accuracy_against_training_time():
    """`curve_every`: the held-out accuracy every N steps (each epoch in chunks of N), with the
    training time until then; the last point is the run's final accuracy."""
    config = {
        "strategy": "none", "model": "wide", "image": 8, "batch_per_device": 16,
        "accuracy": True, "steps": 4, "repeats": 1, "curve_every": 2,
    }  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "tfstrat.bench._worker", json.dumps(config)],
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    steps = [p[0] for p in result["curve"]]
    seconds = [p[1] for p in result["curve"]]
    assert steps == [2, 4, 6, 8]  # a warm-up epoch and one timed epoch of 4 steps
    assert all(0 < a < b for a, b in zip(seconds, seconds[1:]))
    assert all(0.0 <= p[2] <= 1.0 for p in result["curve"])
    assert result["curve"][-1][2] == result["accuracy"]
    assert len(result["epoch_s"]) == 1


@pytest.mark.parametrize(
    "config, words",
    [
        ({"steps": 64, "curve_every": 16}, "without accuracy"),
        ({"steps": 64, "curve_every": 24, "accuracy": True}, "Use a divisor of steps"),
    ],
)
def test_a_bad_curve_is_refused_before_tensorflow_starts(config, words):
    from tfstrat.bench import _worker
    from tfstrat.errors import UsageError

    with pytest.raises(UsageError, match=words):
        _worker.main({"strategy": "none", **config})


def test_time_to_accuracy_is_read_from_each_seeds_curve():
    """benchmarks/localsgd's column: the first point at B-2's final accuracy less 1 point, per
    seed; B-2's time over the row's; a seed that never gets there is counted, not hidden."""
    import importlib.util

    from paths import ROOT

    path = os.path.join(ROOT, "benchmarks", "localsgd", "run.py")
    spec = importlib.util.spec_from_file_location("localsgd_run", path)
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    net = "veth 1gbit"

    def row(name, *seeds):  # seeds: (final accuracy, curve)
        return {
            "row": name,
            "seeds": {
                str(i): {net: {"accuracy": acc, "curve": curve}} for i, (acc, curve) in enumerate(seeds)
            },
        }  # fmt: skip

    base = row(
        "B-2-wide",
        (0.70, [[16, 10.0, 0.50], [32, 20.0, 0.69], [48, 30.0, 0.70]]),
        (0.80, [[16, 10.0, 0.60], [32, 20.0, 0.75], [48, 30.0, 0.80]]),
    )
    fast = row(
        "C-2-psgd4w-wide",
        (0.71, [[16, 4.0, 0.40], [32, 8.0, 0.69], [48, 12.0, 0.71]]),  # 0.69 >= 0.70 - 0.01
        (0.78, [[16, 4.0, 0.60], [32, 8.0, 0.78], [48, 12.0, 0.78]]),  # never 0.79
    )
    assert run._time_to_target(base, base, net) == ["25 s (20-30)", "1.00 (1.00-1.00)"]
    assert run._time_to_target(fast, base, net) == [
        "8 s, step 32; not reached on 1 of 2 seeds",
        "2.50",
    ]
    assert run._time_to_target(row("old", (0.7, [])), base, net) == ["-", "-"]
