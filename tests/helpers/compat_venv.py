"""The compat tier's venvs (tests/test_releases.py): one per (TensorFlow, Keras) pair under
`.venv/compat/tfX-kerasY`, made and installed once (a `.installed` stamp says it is complete),
under a lock, so that `scripts/test` can make the oldest pair's in the background while the
suite starts and the tier then waits for it instead of making it twice.

    python tests/helpers/compat_venv.py          # the oldest pair of tfstrat._compat.versions.PAIRS
    python tests/helpers/compat_venv.py 2.19 3.10
    python tests/helpers/compat_venv.py --latest  # prints the newest pair on the registry, as
                                                  # TF/KERAS, pre-releases included
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
from pathlib import Path

# What the venv needs besides the pair: what the cases import (tests/conftest.py included).
TEST_PACKAGES = ("pytest>=8,<10", "pytest-timeout>=2.3", "hypothesis>=6.100")
INSTALL_TIMEOUT = 600


def spec(name: str, release: str) -> str:
    """`2.19` as `name==2.19.*` (the newest patch), `2.19.1` as `name==2.19.1` (and a release
    candidate, `2.22.0rc0`, as itself)."""
    return f"{name}=={release}.*" if release.count(".") == 1 else f"{name}=={release}"


def venv(tf: str, keras: str) -> Path:
    """The pair's venv's python, made and installed once. Raises RuntimeError naming the pair
    and pip's error when pip cannot install it."""
    root = Path(sys.prefix) / "compat"
    root.mkdir(parents=True, exist_ok=True)
    venv_dir = root / f"tf{tf}-keras{keras}"
    python, stamp = venv_dir / "bin" / "python", venv_dir / ".installed"
    with open(root / f"tf{tf}-keras{keras}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process making it: wait for it
        if stamp.exists():
            return python
        subprocess.run(
            [sys.executable, "-m", "venv", "--clear", str(venv_dir)], check=True, timeout=120
        )
        proc = subprocess.run(
            [str(python), "-m", "pip", "install", "-qq", spec("tensorflow", tf),
             spec("keras", keras), *TEST_PACKAGES],
            capture_output=True, text=True, timeout=INSTALL_TIMEOUT,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(
                f"pip could not install TensorFlow {tf} with Keras {keras} "
                f"(is the pair on the registry, and does TensorFlow {tf} allow Keras {keras}?):\n"
                + proc.stderr[-3000:]
            )
        stamp.write_text(f"tensorflow {tf}, keras {keras}\n")
    return python


def latest() -> str:
    """The newest TensorFlow and Keras on the registry, pre-releases included, as "TF/KERAS"
    (pip's `index versions --pre`: its first listed version is the newest)."""
    newest = []
    for name in ("tensorflow", "keras"):
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "index", "versions", "--pre", name],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        line = next(
            (x for x in proc.stdout.splitlines() if x.startswith("Available versions:")), ""
        )
        if not line:
            raise RuntimeError(
                f"pip index versions --pre {name} listed nothing: {proc.stderr[-500:]}"
            )
        newest.append(line.split(":", 1)[1].split(",")[0].strip())
    return "/".join(newest)


if __name__ == "__main__":
    if sys.argv[1:] == ["--latest"]:
        try:
            print(latest())
        except RuntimeError as e:
            sys.exit(str(e))
        sys.exit(0)
    if len(sys.argv) == 3:
        pair = (sys.argv[1], sys.argv[2])
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from tfstrat._compat import versions

        pair = versions.PAIRS[0]
    try:
        print(venv(*pair))
    except RuntimeError as e:  # the tier makes it again and reports it
        sys.exit(str(e))
