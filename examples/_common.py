"""What the examples share: `--strategy`, `--quick`, real data or synthetic, the result line.

Not part of tfstrat: each example is plain Keras plus the strategy this module makes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

STRATEGIES = ("auto", "mirrored", "car", "ps", "hybrid", "localsgd")


def parser(description: str) -> argparse.ArgumentParser:
    """The examples' common flags; each example adds its own."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="auto",
        help="auto: tfstrat.auto() (Hybrid with ps tasks, CollectiveAllReduce with several "
        "workers, else one device); mirrored: MirroredNCCL; car: CollectiveAllReduce; ps: "
        "ParameterServer; hybrid: Hybrid; localsgd: LocalSGD(sync_every=8)",
    )
    p.add_argument("--quick", action="store_true", help="a small run: under 2 minutes on 2 cores")
    p.add_argument(
        "--download",
        action="store_true",
        help="let tensorflow-datasets download the real data (else only data already in its "
        "data_dir is used, and synthetic data otherwise)",
    )
    p.add_argument("--data-dir", default=None, help="tensorflow-datasets' data_dir")
    p.add_argument("--report", default=None, help="the chief writes its result as JSON here")
    return p


def tf_config() -> dict:
    try:
        return json.loads(os.environ.get("TF_CONFIG") or "{}")
    except ValueError:
        return {}


def is_chief() -> bool:
    """The chief task, else worker 0; a process without TF_CONFIG is its own chief."""
    config = tf_config()
    task = config.get("task") or {}
    if not task:
        return True
    if "chief" in config.get("cluster", {}):
        return task.get("type") == "chief"
    return task.get("type") == "worker" and int(task.get("index", 0)) == 0


def make_strategy(name: str):
    """The strategy `--strategy NAME` asks for; call it before any other TensorFlow op."""
    import tfstrat

    has_ps = bool(tf_config().get("cluster", {}).get("ps"))
    if name == "auto":
        return tfstrat.auto()
    if name == "mirrored":
        return tfstrat.MirroredNCCL()
    if name == "car":
        if has_ps:
            sys.exit("--strategy car uses workers only: launch without --ps (or use hybrid)")
        return tfstrat.CollectiveAllReduce()
    if name == "ps":
        if not has_ps:
            sys.exit(
                "--strategy ps needs ps tasks in TF_CONFIG: run it under "
                f"`tfstrat launch --workers 2 --ps 1 -- python {sys.argv[0]} --strategy ps`"
            )
        return tfstrat.ParameterServer()
    if name == "hybrid":
        return tfstrat.Hybrid()
    if name == "localsgd":
        if not hasattr(tfstrat, "LocalSGD"):
            sys.exit(
                "--strategy localsgd: this tfstrat has no tfstrat.LocalSGD yet; pick another "
                f"strategy ({', '.join(s for s in STRATEGIES if s != 'localsgd')})"
            )
        return tfstrat.LocalSGD(sync_every=8)
    raise ValueError(f"Received: --strategy {name!r}. Use one of {', '.join(STRATEGIES)}.")


def throughput():
    """`tfstrat.keras.callbacks.Throughput()`: global examples/s in the logs and History."""
    try:
        from tfstrat.keras.callbacks import Throughput
    except ImportError:  # a tfstrat that does not export it yet
        from tfstrat.keras._throughput import Throughput
    return Throughput()


def tfds_available(name: str, data_dir: str | None, download: bool) -> bool:
    """Whether tensorflow-datasets can give `name` without a download we were not allowed."""
    try:
        import tensorflow_datasets as tfds
    except ImportError:
        print(f"data: tensorflow-datasets is not installed; synthetic data instead of {name}")
        return False
    if download:
        return True
    try:
        builder = tfds.builder(name, data_dir=data_dir)
        ready = builder.is_prepared()
    except Exception as e:  # an unknown name, an unreadable data_dir
        print(f"data: {name} not usable ({type(e).__name__}: {e}); synthetic data instead")
        return False
    if not ready:
        print(
            f"data: {name} is not in tensorflow-datasets' data_dir ({builder.data_dir}); "
            "synthetic data instead (--download fetches it)"
        )
    return ready


def report(args, example: str, strategy, history, metric: str, value: float, **extra) -> dict:
    """Prints the result line and, on the chief with `--report`, writes it as JSON."""
    logs = history.history
    result = {
        "example": example,
        "strategy": type(strategy).__name__,
        "replicas": int(strategy.num_replicas_in_sync),
        "workers": len(tf_config().get("cluster", {}).get("worker", [])) or 1,
        "metric": metric,
        "value": float(value),
        "examples_per_s": _last(logs.get("examples_per_s")),
        "ps_bytes_per_step": _last(logs.get("ps_bytes_per_step")),
        "quick": bool(args.quick),
        **extra,
    }
    line = (
        f"result: {example} {result['strategy']} ({result['replicas']} replica(s)): "
        f"{metric} {value:.4f}, {result['examples_per_s'] or 0:,.0f} examples/s (last epoch)"
    )
    if result["ps_bytes_per_step"] is not None:
        line += f", {result['ps_bytes_per_step']:,.0f} bytes/step to the ps"
    print(line, flush=True)
    if args.report and is_chief():
        with open(args.report, "w") as f:
            json.dump(result, f)
    return result


def _last(values):
    return float(values[-1]) if values else None
