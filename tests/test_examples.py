"""The examples of examples/ train to a useful metric, not just exit 0.

CI runs each new example `--quick` under one strategy; `scripts/examples`
(`TFSTRAT_EXAMPLES=all`) runs every strategy that fits each example, and resnet_scaling's
table. Thresholds are far from chance and from what a model that ignores its input reaches;
each run's report (the chief's `--report` JSON) holds the metric and examples/s.
"""

import json
import os
import subprocess
import sys

import pytest
from cluster import RUN_TIMEOUT, launch_script

import tfstrat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")

EVERY = os.environ.get("TFSTRAT_EXAMPLES") == "all"  # scripts/examples


def _word_lm(r):
    # A model that ignores the context reaches the unigram perplexity; the true model's is the
    # floor (about 85 and 6.5 for --quick's language).
    assert r["value"] < 0.6 * r["unigram_perplexity"], r


def _wide_deep(r):
    assert r["value"] > 0.75, r  # 0.5 is chance; the true click probabilities reach ~0.90
    assert r["best_auc"] > r["value"] - 0.01, r


def _resnet(r):
    assert r["value"] > 0.5, r  # 10 classes: chance is 0.1


CHECKS = {"word_lm": _word_lm, "wide_deep": _wide_deep, "resnet_scaling": _resnet}

# (example, strategy, workers, ps); workers 0: one process, no launcher.
CI = [
    ("word_lm", "mirrored", 0, 0),
    ("wide_deep", "mirrored", 0, 0),
    ("resnet_scaling", "mirrored", 0, 0),
]
ALL = CI + [
    ("word_lm", "hybrid", 2, 1),
    ("word_lm", "car", 2, 0),
    ("word_lm", "ps", 2, 1),
    ("word_lm", "auto", 0, 0),
    ("wide_deep", "hybrid", 2, 1),
    ("wide_deep", "car", 2, 0),
    ("wide_deep", "ps", 2, 1),
    ("resnet_scaling", "car", 2, 0),
    ("resnet_scaling", "auto", 2, 0),
]
if EVERY and hasattr(tfstrat, "LocalSGD"):  # (imports TensorFlow: only here)
    ALL += [(name, "localsgd", 2, 0) for name in CHECKS]
CASES = ALL if EVERY else CI


def _id(case) -> str:
    name, strategy, workers, ps = getattr(case, "values", case)
    return f"{name}-{strategy}-{workers}w{ps}ps"


def _run(name, strategy, workers, ps, report, *extra):
    script = os.path.join(EXAMPLES, f"{name}.py")
    args = [script, "--quick", "--strategy", strategy, "--report", str(report), *extra]
    if workers:
        code, output = launch_script(*args, workers=workers, ps=ps)
    else:
        proc = subprocess.run(
            [sys.executable, *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT,
        )
        code, output = proc.returncode, proc.stdout + proc.stderr
    assert code == 0, output[-6000:]
    assert "result: " in output, output[-3000:]
    return json.loads(report.read_text()), output


@pytest.mark.cluster
@pytest.mark.parametrize("name,strategy,workers,ps", CASES, ids=[_id(c) for c in CASES])
def test_example_quick_reaches_its_metric(name, strategy, workers, ps, tmp_path):
    result, output = _run(name, strategy, workers, ps, tmp_path / "report.json")
    print(f"\n{name} --strategy {strategy}: {json.dumps(result)}")  # scripts/examples shows it
    CHECKS[name](result)
    assert result["examples_per_s"] > 0, result  # from tfstrat's Throughput callback
    assert result["workers"] == max(workers, 1)
    if ps and strategy in ("hybrid", "ps", "auto"):
        # Bytes to the ps, measured on the sockets: the tables' rows (and under
        # ParameterServer every weight) travel every step.
        assert result["ps_bytes_per_step"] > 1000, result
    else:
        assert result["ps_bytes_per_step"] is None, result


if CASES is ALL:  # scripts/examples only: three clusters one after another

    @pytest.mark.cluster
    @pytest.mark.timeout(900)
    def test_resnet_scaling_table(tmp_path):
        report = tmp_path / "table.json"
        proc = subprocess.run(
            [sys.executable, os.path.join(EXAMPLES, "resnet_scaling.py"), "--quick"]
            + ["--report", str(report)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=850,
        )
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
        rows = json.loads(report.read_text())
        assert [r["row"] for r in rows] == ["Mirrored", "CAR-1", "CAR-2"], rows
        for r in rows:
            assert r["value"] > 0.5 and r["examples_per_s"] > 0, r
        assert rows[2]["global_batch"] == 2 * rows[1]["global_batch"]
        assert "| CAR-2 | CollectiveAllReduce | 2 |" in proc.stdout, proc.stdout[-3000:]
        print(proc.stdout[-2500:])


def test_a_strategy_that_does_not_fit_says_how_to_run_it():
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "word_lm.py"), "--strategy", "ps", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "TF_CONFIG"},
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "tfstrat launch --workers 2 --ps 1" in proc.stderr, proc.stderr
