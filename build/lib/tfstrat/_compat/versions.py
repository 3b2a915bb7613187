"""The TensorFlow and Keras releases tfstrat supports, checked when a strategy is created.

tfstrat reaches into both (`tfstrat._compat.tf`, `.keras`, `.patches`), so a release outside
these ranges may break it without an error: a strategy refuses to start on one, naming the
versions, unless `TFSTRAT_ALLOW_UNSUPPORTED=1` (then it warns once and goes on).
`pyproject.toml` pins the same ranges.
"""

from __future__ import annotations

import logging
import os
import re

from tfstrat.errors import VersionError

logger = logging.getLogger("tfstrat")

# (lowest supported, first unsupported) as (major, minor); pyproject.toml says the same.
TENSORFLOW = ((2, 21), (2, 22))
KERAS = ((3, 15), (3, 16))
ALLOW_ENV = "TFSTRAT_ALLOW_UNSUPPORTED"
_checked = False


def _minor(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def _text(bounds) -> str:
    (a, b), (c, d) = bounds
    return f">={a}.{b},<{c}.{d}"


def problems(tensorflow_version: str, keras_version: str) -> list[str]:
    """What is unsupported about these versions (empty when both are supported).

    Example:
        >>> problems("2.21.0", "3.15.1")
        []
        >>> problems("2.21.0", "3.16.0")
        ['Keras 3.16.0 (tfstrat supports keras>=3.15,<3.16)']
    """
    out = []
    for name, pip, version, bounds in (
        ("TensorFlow", "tensorflow", tensorflow_version, TENSORFLOW),
        ("Keras", "keras", keras_version, KERAS),
    ):
        minor = _minor(version)
        if minor is None or not bounds[0] <= minor < bounds[1]:
            out.append(f"{name} {version} (tfstrat supports {pip}{_text(bounds)})")
    return out


def check() -> None:
    """Raises VersionError when the installed TensorFlow or Keras is unsupported (once per
    process; `TFSTRAT_ALLOW_UNSUPPORTED=1` makes it a warning)."""
    global _checked
    if _checked:
        return
    import keras
    import tensorflow as tf

    found = problems(tf.__version__, keras.__version__)
    if found and os.environ.get(ALLOW_ENV, "") not in ("1", "true", "yes"):
        raise VersionError(
            f"Received: {' and '.join(found)}. Install the supported releases "
            f"(pip install 'tensorflow{_text(TENSORFLOW)}' 'keras{_text(KERAS)}'), or set "
            f"{ALLOW_ENV}=1 to try this one anyway."
        )
    if found:
        logger.warning("tfstrat: running on unsupported %s (%s=1).", " and ".join(found), ALLOW_ENV)
    _checked = True
