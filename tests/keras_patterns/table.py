"""Runs patterns x strategies and prints the table (what `scripts/patterns` runs).

Usage: python table.py [--patterns a,b | --patterns ecosystem] [--strategies mirrored,...] [--out DIR]

`--patterns ecosystem` runs `ecosystem.py`'s patterns (keras-hub, keras-rs, XLA, ...) against
one device with dense gradients (`none-dense`), under every strategy: the larger matrix that
CI does not run (tests/test_ecosystem.py runs its core).

Each strategy runs every pattern in one process (or one cluster through `tfstrat launch`); a
run that dies (a crash, a hang past its timeout) is started again with the patterns it had
not reached, and the pattern it was in gets a FAIL cell with the run's exit code.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from compare import compare  # noqa: E402
from run import CLUSTERS, STRATEGIES  # noqa: E402

# Pattern x strategy pairs that do not fit, with the reason shown in the cell.
NOT_APPLICABLE = {
    ("gan", "ps"): "n/a: ParameterServer syncs model.optimizer only",
}
# ParameterServer logs and evaluates per worker (README): weights are compared, logs not.
WEIGHTS_ONLY = ("ps",)
PER_PATTERN_SECONDS = 60  # a generous bound for one pattern's traces and steps under load


def run_strategy(kind: str, patterns: list[str], out: str, log=None, env=None) -> None:
    """Runs `patterns` under `kind`, relaunching after a run that dies, until each has a
    result or an error file; `env`: extra environment of every process."""
    todo = [p for p in patterns if (kind, p) not in NOT_APPLICABLE]
    attempt = 0
    while todo:
        code, text = _run_once(kind, todo, out, env or {})
        attempt += 1
        if log is not None:
            log.write(text)
        done = [p for p in todo if _has_result(out, p, kind)]
        left = [p for p in todo if p not in done]
        if code == 0 or not left or attempt > len(patterns):
            for p in left:
                _write_error(out, p, kind, f"no result (exit code {code}): {_last_line(text)}")
            return
        _write_error(out, left[0], kind, f"the run died (exit code {code}): {_last_line(text)}")
        todo = left[1:]


def _run_once(kind: str, patterns: list[str], out: str, extra: dict) -> tuple[int, str]:
    args = [os.path.join(HERE, "run.py"), ",".join(patterns), kind, out]
    timeout = 120 + PER_PATTERN_SECONDS * len(patterns)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
    env.update(extra)
    if kind not in CLUSTERS:
        try:
            proc = subprocess.run(
                [sys.executable, *args],
                capture_output=True,
                text=True,
                timeout=timeout,
                env=env,
                cwd=HERE,
            )
        except subprocess.TimeoutExpired as e:
            return 124, f"{e.stdout or ''}{e.stderr or ''}\ntimed out after {timeout} s"
        return proc.returncode, proc.stdout + proc.stderr
    from tfstrat import LaunchConfig, launch

    workers, ps = CLUSTERS[kind]
    text = io.StringIO()
    code = launch(
        LaunchConfig(
            [sys.executable, *args],
            workers=workers,
            ps=ps,
            timeout=timeout,
            threads_per_task=1,
            env={"TF_CPP_MIN_LOG_LEVEL": env["TF_CPP_MIN_LOG_LEVEL"], **extra},
        ),
        text,
    )
    return code, text.getvalue()


def _has_result(out: str, pattern: str, kind: str) -> bool:
    where = os.path.join(out, pattern)
    return os.path.isdir(where) and any(
        f.startswith(f"{kind}.") and f.endswith((".npz", ".error")) for f in os.listdir(where)
    )


def _write_error(out: str, pattern: str, kind: str, message: str) -> None:
    os.makedirs(os.path.join(out, pattern), exist_ok=True)
    with open(os.path.join(out, pattern, f"{kind}.run.error"), "w") as f:
        f.write(message)


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if "Error" in line or "error" in line]
    return (lines or text.splitlines() or [""])[-1][-200:]


def cell(out: str, pattern: str, kind: str, reference: str = "none") -> str:
    if (pattern, kind) in NOT_APPLICABLE:
        return NOT_APPLICABLE[(pattern, kind)]
    weights_only = kind in WEIGHTS_ONLY
    return compare(out, pattern, kind, weights_only=weights_only, reference=reference)["cell"]


def table(out: str, patterns: list[str], kinds: list[str]) -> str:
    reference = kinds[0] if kinds and kinds[0].startswith("none") else "none"
    columns = [k for k in kinds if not k.startswith("none")]
    rows = ["| pattern | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for p in patterns:
        rows.append(f"| {p} | " + " | ".join(cell(out, p, k, reference) for k in columns) + " |")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    from patterns import PATTERNS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patterns", default=",".join(PATTERNS))
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--out", default=None, help="results and logs (default: a temp dir)")
    args = parser.parse_args(argv)
    patterns, kinds = args.patterns.split(","), args.strategies.split(",")
    if patterns == ["ecosystem"]:  # the larger ecosystem matrix, against `none-dense`
        from ecosystem import PATTERNS as ECOSYSTEM

        patterns, reference = list(ECOSYSTEM), "none-dense"
    else:
        reference = "none"
    kinds = [k for k in kinds if k not in ("none", "none-dense")]
    kinds.insert(0, reference)
    out = args.out or tempfile.mkdtemp(prefix="tfstrat-patterns-")
    os.makedirs(out, exist_ok=True)
    for kind in kinds:
        print(f"running {len(patterns)} pattern(s) under {kind} ...", flush=True)
        with open(os.path.join(out, f"{kind}.log"), "a") as log:
            run_strategy(kind, patterns, out, log)
    print(f"\nresults and logs: {out}\n")
    print(table(out, patterns, kinds))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
