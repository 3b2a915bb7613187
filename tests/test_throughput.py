"""tfstrat.keras.callbacks.Throughput: examples/s in History, on the bar, in TensorBoard.

One process (tests/workers/throughput_run.py) runs every case; its report is shared. Bytes per
step to the ps are checked by tests/test_examples.py (word_lm under Hybrid with a ps).
"""

import json
import re

import pytest
from cluster import run_script


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("throughput")
    stdout = run_script("throughput_run.py", str(out), timeout=240)
    line = next(line for line in stdout.splitlines() if line.startswith("REPORT "))
    return json.loads(line[len("REPORT ") :]), stdout


def test_examples_per_s_in_history_is_rows_over_the_epochs_seconds(run):
    report, _ = run
    history, seconds = report["explicit"]["history"], report["explicit"]["seconds"]
    assert len(history["examples_per_s"]) == 2
    for rate, s in zip(history["examples_per_s"], seconds, strict=True):
        assert rate > 0
        # 640 rows over 10 batches of a fake clock that ticks 1 s per batch: 64 rows/s.
        assert s == 10 and rate == pytest.approx(640 / s, rel=1e-9), (rate, s)
    # A last partial batch counts as its rows: 650 rows, not 11 x 64.
    partial = report["partial"]
    rate, s = partial["history"]["examples_per_s"][0], partial["seconds"][0]
    assert s == 11 and rate == pytest.approx(650 / s, rel=1e-9), (rate, s)
    assert "ps_bytes_per_step" not in history  # no ps tasks


def test_on_the_progress_bar(run):
    _, stdout = run
    bar = stdout.split("PROGRESS BAR BEGIN")[1].split("PROGRESS BAR END")[0]
    values = re.findall(r"examples_per_s: ([0-9.]+)", bar)
    assert values and all(float(v) > 0 for v in values), bar[-2000:]


def test_tensorboard_writes_the_scalar_even_when_given_before_it(run):
    report, _ = run
    written = report["tensorboard"].get("train/epoch_examples_per_s")
    assert written is not None, sorted(report["tensorboard"])
    assert len(written) == 2 and all(v > 0 for v in written), written


def test_added_by_tfstrat_strategies_unless_disabled(run):
    report, _ = run
    assert len(report["auto"]["examples_per_s"]) == 2
    assert all(v > 0 for v in report["auto"]["examples_per_s"])
    assert "examples_per_s" not in report["disabled"]  # TFSTRAT_THROUGHPUT=0
    assert "loss" in report["disabled"]


def test_unknown_batch_size_gives_steps_per_s_until_told(run):
    report, _ = run
    assert "examples_per_s" not in report["dataset"]
    assert report["dataset"]["steps_per_s"][0] > 0
    assert any("Pass Throughput(batch_size=GLOBAL_BATCH)" in m for m in report["log"])
    assert report["dataset_sized"]["examples_per_s"][0] > 0
