"""The compat tier: tfstrat on older (or newer) TensorFlow and Keras releases.

For each (TensorFlow, Keras) pair a venv of its own (`.venv/compat/tfX-kerasY`, made once and
kept) runs a short equivalence set of the main suite's own tests (`CASES`: MirroredNCCL,
CollectiveAllReduce, Hybrid with a ps and Keras's weight APIs on its tables (a plain Keras
model: keras-hub's BERT half runs in the main suite, the venvs have no keras-hub),
ParameterServer sync, ModelParallel's MLP on the (1, 2) and (2, 2) meshes with checkpoints,
save and load), each against one device on that same pair.
tfstrat comes from this checkout (on PYTHONPATH, as `pip install --no-deps -e .` would give).

Which pairs:
- `scripts/test --pair tf=2.22,keras=3.16` (repeatable; TFSTRAT_COMPAT_PAIRS="2.22/3.16;..."):
  those, listed or not; the way to try a new release.
- `scripts/test -m compat`: every pair of `tfstrat._compat.versions.PAIRS`.
- otherwise (the whole suite, CI): the oldest pair only; the main suite is the newest.
"""

import os
import re
import subprocess
from pathlib import Path

import pytest
from compat_venv import INSTALL_TIMEOUT, venv

from tfstrat._compat import versions

ROOT = Path(__file__).resolve().parents[1]
PAIRS_ENV = "TFSTRAT_COMPAT_PAIRS"
# The main suite's tests that the pair must pass (about 2 minutes on 2 cores).
CASES = (
    "tests/test_mirrored.py::test_equals_single_device_training[2-auto]",
    "tests/test_collective.py::test_two_workers_equal_single_device",
    "tests/test_hybrid.py::test_two_workers_equal_single_device[1]",
    "tests/test_hybrid.py::test_kerass_weight_apis_see_ps_held_tables_as_one_device_does",
    "tests/test_ps.py::test_two_workers_one_ps_equal_single_device",
    "tests/test_model_parallel.py::test_mlp_on_1x2_and_2x2_with_checkpoints",
    "tests/test_keras_reuse_save.py::test_strategy_twice_and_save_on_every_worker",
)
RUN_TIMEOUT = 900

pytestmark = [pytest.mark.compat, pytest.mark.timeout(INSTALL_TIMEOUT + RUN_TIMEOUT + 60)]


def parse_pairs(text: str) -> list[tuple[str, str]]:
    """ "2.19/3.10;2.22/3.16" as [("2.19", "3.10"), ("2.22", "3.16")]; a bad entry is named."""
    pairs = []
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        release = r"\d+\.\d+(?:\.\d+(?:rc\d+)?)?"  # 2.19, 2.19.1 or 2.22.0rc0
        match = re.fullmatch(rf"({release})/({release})", entry)
        if not match:
            raise pytest.UsageError(
                f"{PAIRS_ENV}: received {entry!r}; use TF/KERAS releases like 2.19/3.10 "
                "(scripts/test --pair tf=2.19,keras=3.10)"
            )
        pairs.append((match[1], match[2]))
    return pairs


def _pairs(config) -> list[tuple[str, str]]:
    if os.environ.get(PAIRS_ENV, "").strip():
        return parse_pairs(os.environ[PAIRS_ENV])
    if (config.getoption("markexpr") or "").strip() == "compat":
        return list(versions.PAIRS)
    return list(versions.PAIRS[:1])


def pytest_generate_tests(metafunc):
    if "pair" in metafunc.fixturenames:
        pairs = _pairs(metafunc.config)
        metafunc.parametrize("pair", pairs, ids=[f"tf{t}-keras{k}" for t, k in pairs])


def _venv(tf: str, keras: str) -> Path:
    """The pair's venv (`compat_venv.venv`: made once, under a lock; `scripts/test` may be
    making the oldest pair's in the background)."""
    try:
        return venv(tf, keras)
    except RuntimeError as e:
        pytest.fail(str(e))


def _installed(python: Path) -> tuple[str, str]:
    out = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; "
         "print(m.version('tensorflow'), m.version('keras'))"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.split()  # fmt: skip
    return out[0], out[1]


def test_the_equivalence_set_passes_on_the_pair(pair):
    tf, keras = pair
    python = _venv(tf, keras)
    found = _installed(python)
    for want, have in zip(pair, found):
        assert have == want or have.startswith(want + "."), (pair, found)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2"}
    env["TFSTRAT_TEST_WEIGHT_API_MODELS"] = "plain"  # no keras-hub here (the module docstring)
    env.pop(PAIRS_ENV, None)
    proc = subprocess.run(
        [str(python), "-m", "pytest", "-p", "no:cacheprovider", "-q", *CASES],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT,
    )  # fmt: skip
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    where = f"TensorFlow {found[0]} with Keras {found[1]}"
    assert proc.returncode == 0, f"{where}:\n{proc.stdout[-8000:]}\n{proc.stderr[-2000:]}"
    # every case ran and passed: none skipped or deselected
    assert re.fullmatch(rf"{len(CASES)} passed in .*", summary), (where, proc.stdout[-3000:])
