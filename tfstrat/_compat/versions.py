"""The TensorFlow and Keras releases tfstrat supports and the ones its tests run, checked when
a strategy is created.

Three ranges:
- supported (`TENSORFLOW`, `KERAS`): what `pyproject.toml` allows, from the oldest release
  tfstrat works on to the next major, so installing tfstrat never downgrades a TensorFlow or
  Keras and never blocks the next minor release. Outside it a strategy refuses to start,
  naming the versions, unless `TFSTRAT_ALLOW_UNSUPPORTED=1` (then it warns once and goes on).
- tested (`TESTED_TENSORFLOW`, `TESTED_KERAS`, `PAIRS`): the releases the suite runs
  (`scripts/test -m compat` runs every pair; CI the oldest, the main suite the newest). A
  supported release newer than these gets one warning that it has not been tested.
- what tfstrat patches (`surface.PATCHED`): every Keras attribute it replaces, checked for
  presence and signature on whatever release is installed; a difference refuses to start
  (or warns, with `TFSTRAT_ALLOW_UNSUPPORTED=1`), naming the attribute and the releases that
  have it.
"""

from __future__ import annotations

import logging
import os
import re

from tfstrat.errors import VersionError

logger = logging.getLogger("tfstrat")

# Supported: (oldest, first unsupported) as (major, minor); pyproject.toml says the same.
TENSORFLOW = ((2, 19), (3, 0))
KERAS = ((3, 10), (4, 0))
# Tested: (oldest, newest) minor releases the suite runs.
TESTED_TENSORFLOW = ((2, 19), (2, 21))
TESTED_KERAS = ((3, 10), (3, 15))
# The (TensorFlow, Keras) pairs of the compat tier (tests/test_releases.py), oldest first: the
# corners of the tested range and every Keras minor at least once, where pip allows the pair
# (TensorFlow 2.20 requires keras>=3.10, 2.21 keras>=3.12). The main suite runs the newest.
PAIRS = (
    ("2.19", "3.10"),
    ("2.19", "3.15"),
    ("2.20", "3.11"),
    ("2.20", "3.14"),
    ("2.21", "3.12"),
    ("2.21", "3.13"),
)
NEWEST = ("2.21", "3.15")
ALLOW_ENV = "TFSTRAT_ALLOW_UNSUPPORTED"
_checked = False


def _minor(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def spec(bounds) -> str:
    """pip's form of a (oldest, first unsupported) range, e.g. ">=2.19,<3"."""
    (a, b), (c, d) = bounds
    return f">={a}.{b},<{c}" if d == 0 else f">={a}.{b},<{c}.{d}"


def _span(tested) -> str:
    (a, b), (c, d) = tested
    return f"{a}.{b}-{c}.{d}"


def _after(tested):
    """A tested (oldest, newest) as a range (oldest, the minor after the newest)."""
    (a, b), (c, d) = tested
    return (a, b), (c, d + 1)


def problems(tensorflow_version: str, keras_version: str) -> list[str]:
    """What is unsupported about these versions (empty when both are supported).

    Example:
        >>> problems("2.21.0", "3.16.0")
        []
        >>> problems("2.18.1", "3.15.1")
        ['TensorFlow 2.18.1 (tfstrat supports tensorflow>=2.19,<3)']
    """
    out = []
    for name, pip, version, bounds in (
        ("TensorFlow", "tensorflow", tensorflow_version, TENSORFLOW),
        ("Keras", "keras", keras_version, KERAS),
    ):
        minor = _minor(version)
        if minor is None or not bounds[0] <= minor < bounds[1]:
            out.append(f"{name} {version} (tfstrat supports {pip}{spec(bounds)})")
    return out


def untested(tensorflow_version: str, keras_version: str) -> list[str]:
    """The supported versions newer than the tested ones (empty when both were tested).

    Example:
        >>> untested("2.21.0", "3.16.0")
        ['Keras 3.16.0 (tested: 3.10-3.15)']
    """
    out = []
    for name, version, tested in (
        ("TensorFlow", tensorflow_version, TESTED_TENSORFLOW),
        ("Keras", keras_version, TESTED_KERAS),
    ):
        minor = _minor(version)
        if minor is not None and minor > tested[1]:
            out.append(f"{name} {version} (tested: {_span(tested)})")
    return out


def allowed() -> bool:
    return os.environ.get(ALLOW_ENV, "").strip().lower() in ("1", "true", "yes")


def check() -> None:
    """Raises VersionError when the installed TensorFlow or Keras is unsupported, or a Keras
    attribute tfstrat patches is missing or changed (once per process;
    `TFSTRAT_ALLOW_UNSUPPORTED=1` makes both a warning); warns once on a supported release
    newer than the tested ones."""
    global _checked
    if _checked:
        return
    import keras
    import tensorflow as tf

    from tfstrat._compat import patches, surface

    found = problems(tf.__version__, keras.__version__)
    if found and not allowed():
        raise VersionError(
            f"Received: {' and '.join(found)}. Install supported releases "
            f"(pip install 'tensorflow{spec(TENSORFLOW)}' 'keras{spec(KERAS)}'), or set "
            f"{ALLOW_ENV}=1 to try this one anyway."
        )
    if found:
        logger.warning("tfstrat: running on unsupported %s (%s=1).", " and ".join(found), ALLOW_ENV)
    changed = surface.problems(keras.__version__, patches.original)
    if changed and not allowed():
        raise VersionError(
            f"Keras {keras.__version__} differs from the releases tfstrat was written for: "
            f"{'; '.join(changed)}. Install a tested Keras "
            f"(pip install 'keras{spec(_after(TESTED_KERAS))}'), or set "
            f"{ALLOW_ENV}=1 to try this one anyway."
        )
    if changed:
        logger.warning("tfstrat: %s (%s=1).", "; ".join(changed), ALLOW_ENV)
    newer = untested(tf.__version__, keras.__version__)
    if newer and not found:
        logger.warning(
            "tfstrat: %s has not been tested with tfstrat; every Keras attribute tfstrat "
            "patches checked out. If something fails, install the tested releases and say "
            "which failed.",
            " and ".join(newer),
        )
    _checked = True
