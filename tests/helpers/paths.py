"""Where the tests' parts are: the repository, the helper libraries, the worker programs."""

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
HELPERS = TESTS / "helpers"  # libraries: common (models, data, references), cluster, netns, paths
WORKERS = TESTS / "workers"  # programs the tests run as tasks, each a real process
