"""Running the worker scripts of this folder as real clusters, for the test modules."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from tfstrat import LaunchConfig, TFConfig, launch

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
# The worker scripts use 60 s timeouts; a run is start-up, a few traces and ~100 steps.
RUN_TIMEOUT = 400


def launch_script(*args, workers: int = 2, ps: int = 0, env: dict | None = None) -> tuple[int, str]:
    """`tfstrat launch` of `python SCRIPT ARGS...` in this folder; returns (exit code, output)."""
    out = io.StringIO()
    cwd = os.getcwd()
    os.chdir(SCRIPTS)
    try:
        code = launch(
            LaunchConfig(
                [sys.executable, *args],
                workers=workers,
                ps=ps,
                timeout=RUN_TIMEOUT,
                threads_per_task=1,
                env=env,
            ),
            out,
        )
    finally:
        os.chdir(cwd)
    return code, out.getvalue()


def run_script(*args, timeout: float = RUN_TIMEOUT) -> str:
    """Runs `python SCRIPT ARGS...` in this folder in one process; returns its output."""
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=SCRIPTS,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def start_task(config: TFConfig, task: str, index: int, *args) -> subprocess.Popen:
    """One task of `config` as its own process (no launcher), output piped, own session."""
    env = dict(os.environ, **config.for_task(task, index).to_env(), TF_NUM_INTRAOP_THREADS="1")
    env["TFSTRAT_TASK"] = f"{task}:{index}"
    return subprocess.Popen(
        [sys.executable, *args],
        env=env,
        cwd=SCRIPTS,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
