# Sourced by scripts/demo and scripts/test: makes .venv (if missing) and installs tfstrat into it.
# Usage: ensure_venv EXTRAS   (EXTRAS like "test" or "" for none)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TFSTRAT_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"

ensure_venv() {
  local extras="$1" spec="$ROOT"
  [ -n "$extras" ] && spec="$ROOT[$extras]"
  if [ ! -x "$PY" ]; then
    echo "scripts: creating $VENV" >&2
    "${PYTHON:-python3}" -m venv "$VENV"
    "$PY" -m pip install --quiet --upgrade pip
  fi
  # A stamp keeps re-runs fast: reinstall only when pyproject.toml changed or the extras differ.
  local stamp="$VENV/.tfstrat-installed-$extras"
  if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ] \
      || ! "$PY" -c "import tfstrat" >/dev/null 2>&1; then
    echo "scripts: installing tfstrat${extras:+[$extras]} into $VENV" >&2
    # -qq: errors only (setuptools prints a 10-line "Editable installation" notice otherwise)
    "$PY" -m pip install -qq -e "$spec"
    touch "$stamp"
  fi
}
