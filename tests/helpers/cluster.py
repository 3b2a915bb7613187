"""Running the worker programs of tests/workers as real clusters, for the test modules."""

from __future__ import annotations

import concurrent.futures
import io
import os
import subprocess
import sys

from paths import WORKERS

from tfstrat import LaunchConfig, TFConfig, launch

# The worker scripts use 60 s timeouts; a run is start-up, a few traces and ~100 steps.
RUN_TIMEOUT = 400


def launch_script(
    *args,
    workers: int = 2,
    ps: int = 0,
    env: dict | None = None,
    timeout: float = RUN_TIMEOUT,
    gpus: list[str] | None = None,
) -> tuple[int, str]:
    """`tfstrat launch` of `python SCRIPT ARGS...` in tests/workers (`gpus`: `--gpus`);
    returns (exit code, output)."""
    out = io.StringIO()
    cwd = os.getcwd()
    os.chdir(WORKERS)
    try:
        code = launch(
            LaunchConfig(
                [sys.executable, *args],
                workers=workers,
                ps=ps,
                timeout=timeout,
                threads_per_task=1,
                env=env,
                gpus=gpus,
            ),
            out,
        )
    finally:
        os.chdir(cwd)
    return code, out.getvalue()


def run_script(*args, timeout: float = RUN_TIMEOUT) -> str:
    """Runs `python SCRIPT ARGS...` in tests/workers in one process; returns its output."""
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=WORKERS,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def in_background(fn, *args, **kwargs) -> concurrent.futures.Future:
    """`fn(*args, **kwargs)` in a thread of its own, for a run the caller's own run does not
    read (one process of small models uses about one core: two share the machine's 2 cores
    better than one after the other). `.result()` waits for it and raises what it raised."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(fn, *args, **kwargs)
    pool.shutdown(wait=False)  # the thread ends with `fn`
    return future


def start_task(config: TFConfig, task: str, index: int, *args) -> subprocess.Popen:
    """One task of `config` as its own process (no launcher), output piped, own session."""
    env = dict(os.environ, **config.for_task(task, index).to_env(), TF_NUM_INTRAOP_THREADS="1")
    env["TFSTRAT_TASK"] = f"{task}:{index}"
    return subprocess.Popen(
        [sys.executable, *args],
        env=env,
        cwd=WORKERS,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def assert_chief_wrote_and_workers_restored(out_dir, scratch) -> None:
    """The checks of callbacks_run.py's outputs: one writer, every worker resumed."""
    import json

    results = [json.loads((out_dir / f"worker_{i}.json").read_text()) for i in range(2)]
    # Run 2 resumed after epoch 2 on both workers (a worker that did not restore would start
    # at epoch 0 and its collectives would not match the other's).
    assert results[0]["epochs"] == results[1]["epochs"] == [[0, 1], [2]]
    assert results[0]["weights0"] == results[1]["weights0"]
    assert sorted(os.listdir(out_dir / "ckpt")) == [
        "e1.weights.h5",
        "e2.weights.h5",
        "e3.weights.h5",
    ]
    assert sorted(os.listdir(out_dir / "backup")) == [
        "latest.weights.h5",
        "training_metadata.json",
    ]
    # One writer: one event file per TensorBoard run directory and fit call.
    for run in ("train",):
        events = os.listdir(out_dir / "tb" / run)
        assert len(events) == 2, events
    # Worker 1's scratch directories are gone.
    assert not os.listdir(scratch), os.listdir(scratch)
