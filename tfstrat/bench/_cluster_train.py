"""`tfstrat bench cluster`'s training rows: Keras `fit` on the emulated hosts, tfstrat against
stock TensorFlow (tf-keras) on the same hosts and link, one row after the other.

- **dense**: a 1.84M-weight MLP (7.4 MB of gradients a step), one worker per host (or K, with
  `per_host`: CollectiveAllReduce's two levels, and again in one plain ring): CollectiveAllReduce
  against stock `MultiWorkerMirroredStrategy`.
- **sparse**: a 200,000 x 64 table (Zipf ids) beside a dense part of 0.57M weights (two
  convolutions and two dense layers), W workers and P ps tasks, each on its own host: Hybrid
  (the table on the ps, the dense part all-reduced), tfstrat's ParameterServer (sync: every
  weight on the ps) and stock `ParameterServerStrategy` (async, tf-keras; its coordinator, the
  chief, on one more host).

Every task runs `tfstrat.bench._worker` (as the other benchmarks' rows do) with one thread in
each of TensorFlow's pools and the BFC CPU allocator (tfstrat's default, given to the stock
rows too: like for like). Besides the worker's own examples/s, each row reads the bytes every
host's interface moved in the timed epochs, and so the busiest host's bytes per example: at
the link's rate, the time the link alone needs per example.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from tfstrat.bench import _netns

PORT = 2222
KINDS = ("dense", "sparse")
DENSE = {"model": "mlp", "image": 32, "batch_per_device": 64}
SPARSE = {"workload": "sparse", "vocab": 200_000, "dim": 64, "seq": 20, "classes": 1000,
          "batch_per_device": 64}  # fmt: skip
#: the dense row's gradient bytes a step (float32): the all-reduce's size
DENSE_BYTES = 4 * (32 * 32 * 3 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10)


@dataclasses.dataclass(frozen=True)
class Row:
    id: str
    workload: str  # "dense" or "sparse"
    label: str
    strategy: str  # a `tfstrat.bench._worker` strategy
    workers: int
    ps: int = 0
    per_host: int = 1  # workers per host (host by host, as `tfstrat launch --nodes` places them)
    flat: bool = False  # `TFSTRAT_RING_FLAT=1`: one plain ring

    @property
    def chief(self) -> bool:
        return self.strategy == "tfkeras-ps"

    @property
    def hosts(self) -> int:
        return self.workers // self.per_host + self.ps + int(self.chief)


def rows(
    hosts: tuple[int, ...], ps: tuple[int, ...], kinds: tuple[str, ...], per_host: int = 1
) -> list[Row]:
    """The dense rows at every host count; the sparse rows at every host count of 4 or more (the
    smallest alone if none is), with each of `ps` ps tasks, while they fit in 16 hosts. With
    `per_host` 2+: the dense rows only, that many workers a host, CollectiveAllReduce also in
    one plain ring."""
    out = []
    if per_host > 1:
        for n in hosts if "dense" in kinds else ():
            w, at = n * per_host, f"{n}x{per_host}"
            out.append(Row(f"D-CAR-{at}", "dense", "tfstrat CollectiveAllReduce (two levels)",
                           "collective", w, per_host=per_host))  # fmt: skip
            out.append(Row(f"D-CARflat-{at}", "dense", "tfstrat CollectiveAllReduce, one plain "
                           "ring", "collective", w, per_host=per_host, flat=True))  # fmt: skip
            out.append(Row(f"D-MWMS-{at}", "dense", "stock MultiWorkerMirrored, tf-keras",
                           "tfkeras-mwms", w, per_host=per_host))  # fmt: skip
        return out
    if "dense" in kinds:
        for n in hosts:
            out.append(Row(f"D-CAR-{n}", "dense", "tfstrat CollectiveAllReduce", "collective", n))
            out.append(Row(f"D-MWMS-{n}", "dense", "stock MultiWorkerMirrored, tf-keras",
                           "tfkeras-mwms", n))  # fmt: skip
    if "sparse" in kinds:
        workers = [n for n in hosts if n >= 4] or [min(hosts)]
        for w in workers:
            for p in ps:
                for rid, label, strategy in (
                    ("S-H", "tfstrat Hybrid", "hybrid"),
                    ("S-PS", "tfstrat ParameterServer (sync)", "ps-sync"),
                    ("S-SPS", "stock ParameterServerStrategy (async), tf-keras", "tfkeras-ps"),
                ):
                    row = Row(f"{rid}-{w}w{p}ps", "sparse", label, strategy, w, p)
                    if row.hosts <= 16:
                        out.append(row)
    return out


def run_row(net: _netns.Network, row: Row, *, steps: int, repeats: int, timeout: float,
            package_root: str) -> dict:  # fmt: skip
    """Workers on hosts 0..W/K-1 (K = `row.per_host` each, ports 2 apart), the ps tasks after
    them, a stock coordinator (chief) last; each started as on its own machine. Returns the
    row's result (worker 0's, or the chief's)."""
    p, k = row.ps, row.per_host
    w = row.workers // k  # the workers' hosts
    cluster = {"worker": [f"{net.ipv4(i // k)}:{PORT + 2 * (i % k)}" for i in range(row.workers)]}
    if p:
        cluster["ps"] = [f"{net.ipv4(w + j)}:{PORT}" for j in range(p)]
    if row.chief:
        cluster["chief"] = [f"{net.ipv4(w + p)}:{PORT}"]
    legacy = row.strategy.startswith("tfkeras")

    def env(task: str, index: int) -> dict:
        path = os.pathsep.join(x for x in (package_root, os.environ.get("PYTHONPATH")) if x)
        return {
            "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task, "index": index}}),
            "TFSTRAT_TASK": f"{task}:{index}",
            "TF_NUM_INTRAOP_THREADS": "1",
            "TF_NUM_INTEROP_THREADS": "1",
            "OMP_NUM_THREADS": "1",
            "TF_CPU_ALLOCATOR_USE_BFC": "true",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": path,
            "TF_CPP_MIN_LOG_LEVEL": "2",
            # hosts share no memory (their addresses differ: the ring shares it only within)
            **({"TFSTRAT_RING_FLAT": "1"} if row.flat else {}),
            "TFSTRAT_BENCH_MARKS": "1",  # TIMED-BEGIN / TIMED-END: the counters read then
            **({"TF_USE_LEGACY_KERAS": "1"} if legacy else {}),
        }

    workload = DENSE if row.workload == "dense" else SPARSE
    config = {**workload, "strategy": row.strategy, "devices": 1, "steps": steps,
              "repeats": repeats, "threads": 1}  # fmt: skip
    worker = [sys.executable, "-m", "tfstrat.bench._worker", json.dumps(config)]
    servers = [net.start(w + j, [sys.executable, "-m", "tfstrat", "server"], env("ps", j),
                         name=f"ps:{j}") for j in range(p)]  # fmt: skip
    tasks = [net.start(i // k, worker, env("worker", i), name=f"worker:{i}")
             for i in range(row.workers)]  # fmt: skip
    if row.chief:  # stock PS: the workers serve until the coordinator is done
        servers += tasks
        tasks = [net.start(w + p, worker, env("chief", 0), name="chief:0")]
    marks = _Marks(net, tasks[0])
    try:
        net.wait(tasks, timeout, background=servers)
    except _netns.TaskError as e:
        lines = [line for line in str(e).splitlines() if "Error" in line]
        return {"error": (lines[-1] if lines else str(e).splitlines()[0])[-300:]}
    finally:
        marks.stop()
    result = _result_of(tasks[0])
    if not result:
        return {"error": f"{tasks[0].name} printed no RESULT"}
    # Start-up: from the last task's strategy made to the first step done (the tasks that
    # train print a RESULT: every worker, or a stock PS's chief).
    created = [_result_of(t).get("created_at") for t in tasks]
    if all(created) and result.get("first_step_at"):
        result["startup_s"] = result["first_step_at"] - max(created)
    if marks.moved is None:
        return {"error": f"{tasks[0].name} printed no TIMED-BEGIN/TIMED-END marks"}
    examples = steps * repeats * result["global_batch"]  # in the timed epochs
    busiest = max(max(h["tx"], h["rx"]) for h in marks.moved[: row.hosts])
    result.update(interface_bytes=marks.moved[: row.hosts],
                  busiest_bytes_per_example=busiest / examples)  # fmt: skip
    return result


def _result_of(task: _netns.Task) -> dict:
    try:
        return _netns.result(task)
    except _netns.TaskError:  # printed none
        return {}


class _Marks:
    """Every host's interface counters when the task prints TIMED-BEGIN and TIMED-END (its
    timed epochs), read by a thread that follows the task's output (within 20 ms)."""

    def __init__(self, net: _netns.Network, task: _netns.Task):
        import threading

        self.net, self.task, self.moved = net, task, None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        before = None
        while not self._done.wait(0.02):
            text = self.task.output(limit=1 << 22)
            if before is None and "TIMED-BEGIN" in text:
                before = self.net.counters()
            if before is not None and "TIMED-END" in text:
                self.moved = _netns.counters_delta(before, self.net.counters())
                return

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)


def link_share(result: dict, rate_bytes: float | None) -> float | None:
    """The share of the measured time per example that the busiest host's bytes alone need
    at the link's rate (1.0: the link is the limit)."""
    if not rate_bytes or "examples_per_s" not in result:
        return None
    return result["busiest_bytes_per_example"] / rate_bytes * result["examples_per_s"]
