"""Shared test setup: the helper libraries on the path (`tests/helpers`; `tests/keras_patterns`
holds the keras.io-style programs and their runner), for the test modules
and for every process they start (the worker programs in `tests/workers` import `common`),
the `launch_script` fixture, and `requires_gpus(n)` (tests/helpers/gpus.py) for the GPU tier."""

import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(_HERE, "helpers"), os.path.join(_HERE, "keras_patterns")]

from gpus import requires_gpus  # noqa: E402, F401  (re-exported: `from gpus import requires_gpus`)
from paths import HELPERS  # noqa: E402

# matplotlib, for the plots the benchmarks' smoke tests write from this process: scripts/test
# installs it into a directory of its own (TFSTRAT_TEST_PLOTS), not into the venv, where Keras
# would import it into every TensorFlow process the suite starts (half a second each). Last on
# the path: the venv's own packages come first.
if os.environ.get("TFSTRAT_TEST_PLOTS"):
    sys.path.append(os.environ["TFSTRAT_TEST_PLOTS"])

# Worker programs run as their own processes (through tfstrat's launcher, in network namespaces,
# by hand): PYTHONPATH carries the helpers to them.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(HELPERS), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
)


@pytest.fixture
def launch_script():
    """`launch_script("worker.py", "--flag", workers=2, ps=0, env=None)`: `tfstrat launch` of a
    program in tests/workers through tfstrat's own launcher; returns (exit code, output)."""
    from cluster import launch_script as run

    return run
