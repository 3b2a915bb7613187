"""LocalSGD against CollectiveAllReduce, on loopback and across a rate-limited link.

Rows (2 workers, `tfstrat bench scaling`'s small CNN on learnable labels, SGD with momentum):
  B-2       CollectiveAllReduce (gradients all-reduced every step)
  L-2-sN    LocalSGD, plain averaging every N steps (N = 1, 4, 16)
  D-2-s16   LocalSGD with DiLoCo's outer Nesterov step, every 16 steps
  *-wide    the same on a link-bound MLP; D-2-s16-lrX-wide: DiLoCo with outer lr X, not 0.7
  C-2-fp16-wide, C-2-bf16-wide, C-2-psgd4-wide: CollectiveAllReduce with compression= fp16,
            bf16, PowerSGD rank 4 (from the first step); C-2-psgd4w-wide: PowerSGD after its
            default 100 exact warm-up steps
Each row: examples/s (median of the timed epochs), bytes this worker sent per step (on its
sockets for LocalSGD; what CollectiveAllReduce hands its ring, by ring arithmetic, for B-2),
accuracy on 8,192 held-out images after the same number of examples, once per seed
(`--seeds`), and the training time until the held-out accuracy (measured every
`--curve-every` steps) first reaches B-2's final accuracy of the same seed less 1 point.

Networks: loopback (`tfstrat launch` on 127.0.0.1), and one task per network namespace with
each host's link limited by `tc qdisc ... tbf rate 1gbit` (tfstrat/bench/_netns.py; both ways
since 2026-11-29, egress only before; the machinery of benchmarks/multihost/run.py, reused). Run as root:
    .venv/bin/python benchmarks/localsgd/run.py --out bench-out/localsgd [--steps 20]
Writes OUT/localsgd.md and OUT/localsgd.json.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _multihost():
    """benchmarks/multihost/run.py as a module (its loopback and namespace runners)."""
    path = os.path.join(HERE, "..", "multihost", "run.py")
    spec = importlib.util.spec_from_file_location("multihost_run", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CNN = {"model": "small", "image": 32, "batch_per_device": 64, "accuracy": True}
WIDE = {"model": "wide", "image": 32, "batch_per_device": 64, "accuracy": True}
ROWS = [  # (row, model, label, worker strategy, workload, ps tasks): multihost's row shape
    ("B-2", "small CNN", "CollectiveAllReduce", "collective", CNN, 0),
    ("L-2-s1", "small CNN", "LocalSGD, sync every 1", "localsgd-1", CNN, 0),
    ("L-2-s4", "small CNN", "LocalSGD, sync every 4", "localsgd-4", CNN, 0),
    ("L-2-s16", "small CNN", "LocalSGD, sync every 16", "localsgd-16", CNN, 0),
    ("D-2-s16", "small CNN", "DiLoCo (outer Nesterov), sync every 16", "diloco-16", CNN, 0),
    # A model whose step is bound by the link: 10.5M weights, 42 MB all-reduced per step.
    ("B-2-wide", "wide MLP", "CollectiveAllReduce", "collective", WIDE, 0),
    ("L-2-s16-wide", "wide MLP", "LocalSGD, sync every 16", "localsgd-16", WIDE, 0),
    ("D-2-s16-wide", "wide MLP", "DiLoCo (outer Nesterov), sync every 16", "diloco-16", WIDE, 0),
    ("D-2-s16-lr0.5-wide", "wide MLP", "DiLoCo, outer lr 0.5", "diloco-16-lr0.5", WIDE, 0),
    ("D-2-s16-lr1.0-wide", "wide MLP", "DiLoCo, outer lr 1.0", "diloco-16-lr1.0", WIDE, 0),
    # Synchronous with compressed gradients (`compression=`): every step, fewer bytes.
    ("C-2-fp16-wide", "wide MLP", "CollectiveAllReduce, fp16", "collective-fp16", WIDE, 0),
    ("C-2-bf16-wide", "wide MLP", "CollectiveAllReduce, bf16", "collective-bf16", WIDE, 0),
    (
        "C-2-psgd4-wide",
        "wide MLP",
        "CollectiveAllReduce, PowerSGD rank 4",
        "collective-powersgd4",
        WIDE,
        0,
    ),  # fmt: skip
    (
        "C-2-psgd4w-wide",
        "wide MLP",
        "CollectiveAllReduce, PowerSGD rank 4 after 100 exact steps",
        "collective-powersgd4w100",
        WIDE,
        0,
    ),  # fmt: skip
]

#: The target of "time to accuracy": B-2's held-out accuracy at the end of its run, less this.
TARGET_SLACK = 0.01


def _by_seed(row: dict) -> dict:
    """{seed: {network: result}}; runs before --seeds kept one seed's results in "results"."""
    return row.get("seeds") or {"0": row["results"]}


def table(rows: list[dict], links: dict, args, machine: dict) -> str:
    from tfstrat.bench import _report

    networks = list(links)
    seeds = sorted({k for r in rows for k in _by_seed(r)}, key=int)
    headers = ["row", "strategy"]
    for n in networks:
        headers += [f"{n}: ex/s (min-max)", f"{n}: vs B-2"]
    for n in networks:
        headers += [f"{n}: time to B-2's accuracy - 1 point, median (range)", f"{n}: vs B-2"]
    headers += ["accuracy, mean (min-max)", "vs B-2, points: mean ± s.e. (range), paired by seed"]
    headers += ["bytes sent/step/worker"]

    def base_row(r):  # B-2 of the same model (B-2, B-2-wide)
        wide = r["row"].endswith("-wide")
        return next((b for b in rows if b["row"] == ("B-2-wide" if wide else "B-2")), None)

    def results(r, n):
        return [m[n] for m in _by_seed(r).values() if "examples_per_s" in m.get(n, {})]

    def speed(r, n):  # median over seeds of each seed's median epoch
        done = results(r, n)
        return statistics.median(m["examples_per_s"] for m in done) if done else None

    def accuracies(r):  # {seed: accuracy}; training is deterministic: networks must agree
        out = {}
        for seed, per_net in _by_seed(r).items():
            found = {
                per_net[n]["accuracy"]
                for n in networks
                if per_net.get(n, {}).get("accuracy") is not None
            }
            if len(found) > 1:
                raise SystemExit(f"{r['row']} seed {seed}: accuracy differs between networks "
                                 f"({sorted(found)}): training was not deterministic")  # fmt: skip
            if found:
                out[seed] = found.pop()
        return out

    body = []
    for r in rows:
        cells = [r["row"], r["label"]]
        b = base_row(r)
        for n in networks:
            done = results(r, n)
            if not done:
                errors = [m.get(n, {}).get("error", "?") for m in _by_seed(r).values()]
                cells += [f"failed: {errors[0][:80]}", "-"]
                continue
            x = speed(r, n)
            lo = min(m["examples_per_s_min"] for m in done)
            hi = max(m["examples_per_s_max"] for m in done)
            cells.append(f"{x:,.0f} ({lo:,.0f}-{hi:,.0f})")
            bx = speed(b, n) if b else None
            cells.append(f"{x / bx:.2f}" if bx else "-")
        for n in networks:
            cells += _time_to_target(r, b, n)
        acc = accuracies(r)
        if acc:
            values = list(acc.values())
            cells.append(
                f"{statistics.mean(values):.1%} ({min(values):.1%}-{max(values):.1%})"
                if len(values) > 1
                else f"{values[0]:.1%}"
            )
            base = accuracies(b) if b else {}
            diffs = [100 * (acc[k] - base[k]) for k in acc if k in base]
            if len(diffs) > 1:  # mean +- its standard error, and the range
                se = statistics.stdev(diffs) / len(diffs) ** 0.5
                cells.append(
                    f"{statistics.mean(diffs):+.1f} ± {se:.1f} "
                    f"({min(diffs):+.1f} to {max(diffs):+.1f})"
                )
            else:
                cells.append(f"{diffs[0]:+.1f}" if diffs else "-")
        else:
            cells += ["-", "-"]
        sent = next((m.get("bytes_sent_per_step") for n in networks for m in results(r, n)), None)
        cells.append(f"{sent:,.0f}" if sent else "-")
        body.append(cells)
    link = ", ".join(f"{n}: {v:,.0f} MB/s" for n, v in links.items())
    every = getattr(args, "curve_every", 0)
    curve = (
        f" Time to accuracy: training seconds (from `fit`'s start, tracing included, the "
        f"evaluations left out) until the held-out accuracy, measured every {every} steps on "
        "worker 0, first reaches B-2's final accuracy of the same seed less "
        f"{100 * TARGET_SLACK:.0f} point; vs B-2: B-2's time over the row's, per seed (higher "
        "is faster)."
        if every
        else ""
    )
    held_out = "1,024" if args.held_out is None else f"{args.held_out:,}"
    return _report.markdown(headers, body) + (
        f"\n\nOne TCP stream between two hosts (the link): {link}. {args.workers} workers, "
        f"{args.threads} thread(s) per TensorFlow pool per task; {len(seeds)} seed(s) "
        f"({', '.join(seeds)}: initial weights and training images) per row, rows side by side "
        f"per seed; ex/s: median over seeds of each run's median of {args.repeats} timed "
        f"epochs of {args.steps} steps after a warm-up epoch (every row of a seed sees the same "
        f"examples). Accuracy: on {held_out} held-out images (noise over a colour per image, "
        "labelled by the training labels' fixed random linear map of the colour), the same on "
        "every network (training is deterministic). Machine: "
        f"{machine.get('cpus')} CPUs, TensorFlow {machine.get('tensorflow')}, Keras "
        f"{machine.get('keras')}; every task shares these cores." + curve
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench-out/localsgd")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rate", default="1gbit", help="tc tbf rate of the limited network")
    parser.add_argument(  # the outer-lr sweep's rows only when asked for
        "--rows", default=",".join(r[0] for r in ROWS if "-lr" not in r[0])
    )
    parser.add_argument("--networks", default="loopback,limited")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--link-mb", type=int, default=300, help="MB sent to measure the link")
    parser.add_argument(
        "--seeds", default="0", help="comma-separated seeds: each row runs once per seed"
    )
    parser.add_argument(
        "--curve-every",
        type=int,
        default=16,
        help="held-out accuracy every N steps, for the time to accuracy (0: off; divides --steps)",
    )
    parser.add_argument(
        "--render", metavar="JSON[,JSON]", help="print the table of earlier runs (their seeds)"
    )
    args = parser.parse_args(argv)
    if args.render:  # several runs (of other seeds): one table over all their seeds
        runs = []
        for path in args.render.split(","):
            with open(path) as f:
                runs.append(json.load(f))
        saved = runs[0]
        settings = ("workers", "threads", "steps", "repeats", "held_out", "curve_every")
        for key in settings:
            setattr(args, key, saved.get("args", {}).get(key, getattr(args, key, None)))
        args.curve_every = saved.get("args", {}).get("curve_every") or 0  # none before curves
        rows = [dict(r, seeds=dict(_by_seed(r))) for r in saved["rows"]]
        by_name = {r["row"]: r for r in rows}
        for path, run in zip(args.render.split(",")[1:], runs[1:], strict=True):
            for key in settings:
                if run.get("args", {}).get(key) != saved.get("args", {}).get(key):
                    raise SystemExit(f"{path}: {key} differs from the first run's; not merged")
            for other in run["rows"]:
                if other["row"] not in by_name:  # a row the first run did not have
                    by_name[other["row"]] = dict(other, seeds={})
                    rows.append(by_name[other["row"]])
                row = by_name[other["row"]]
                repeated = set(row["seeds"]) & set(_by_seed(other))
                if repeated:
                    raise SystemExit(f"{path}: seed(s) {sorted(repeated)} of {other['row']} "
                                     "are in an earlier run too; render runs of other seeds")  # fmt: skip
                row["seeds"].update(_by_seed(other))
        links = {}  # every network of every run: a run's seeds may be on another network
        for run in runs:
            links.update(run["links_mb_per_s"])
        print(table(rows, links, args, saved["machine"]))
        return 0

    from tfstrat.bench import _netns as netns
    from tfstrat.bench import _report

    multihost = _multihost()
    wanted_networks = args.networks.split(",")
    if "limited" in wanted_networks:
        try:
            netns.check_available()
        except netns.Unavailable as e:
            print(f"benchmarks/localsgd: {e}", file=sys.stderr)
            return 2
    from tfstrat.bench._worker import HELD_OUT

    args.held_out = HELD_OUT
    machine = _report.machine()
    wanted = args.rows.split(",")
    specs = {r[0]: r for r in ROWS}
    unknown = [name for name in wanted if name not in specs]
    if unknown:
        raise SystemExit(f"Received: --rows with {unknown}. Choose rows from {list(specs)}.")
    rows = [
        {"row": r[0], "label": r[2], "workers": args.workers, "results": {}, "seeds": {}}
        for r in ROWS
        if r[0] in wanted
    ]
    with contextlib.ExitStack() as stack:
        nets, links = {}, {}
        if "loopback" in wanted_networks:
            links["loopback"] = multihost.loopback_link_mb_per_s()
        if "limited" in wanted_networks:
            name = f"veth {args.rate}"
            nets[name] = stack.enter_context(
                netns.Network(args.workers, rate=args.rate, prefix=f"tfs{os.getpid()}l")
            )
            links[name] = multihost.link_mb_per_s(nets[name], args.link_mb)
        print("link MB/s", links, flush=True)
        for seed in args.seeds.split(","):  # all rows of a seed side by side, then the next
            print(f"seed {seed}", flush=True)
            workload = {"seed": int(seed), "curve_every": args.curve_every}
            seeded = {k: (*r[:4], {**r[4], **workload}, r[5]) for k, r in specs.items()}
            for row in rows:
                row["results"] = {}
            multihost.measure(rows, seeded, nets, links, args, _describe)
            for row in rows:
                row["seeds"][seed] = row.pop("results")
    text = table(rows, links, args, machine)
    multihost.write(args.out, "localsgd", text, links, rows, machine, args)
    return 0


def _time_to_target(row: dict, base: dict | None, network: str) -> list[str]:
    """Two cells: the median training time to `base`'s final accuracy less TARGET_SLACK (per
    seed, on `network`) with its range and the step, and base's time over the row's."""
    times, ratios, missed, seeds = [], [], 0, 0
    for seed, per_net in _by_seed(row).items():
        result = per_net.get(network, {})
        reference = (_by_seed(base).get(seed, {}).get(network, {}) if base else {}) or {}
        if not result.get("curve") or reference.get("accuracy") is None:
            continue
        seeds += 1
        target = reference["accuracy"] - TARGET_SLACK
        reached = _reached(result["curve"], target)
        if reached is None:
            missed += 1
            continue
        times.append(reached)
        base_reached = _reached(reference.get("curve") or [], target)
        if base_reached is not None:
            ratios.append(base_reached[1] / reached[1])
    if not seeds:
        return ["-", "-"]
    if not times:
        steps = max(p[0] for p in _by_seed(row)[next(iter(_by_seed(row)))][network]["curve"])
        return [f"not reached in {steps} steps ({seeds} seed(s))", "-"]
    seconds = [t[1] for t in times]
    shown = f"{statistics.median(seconds):.0f} s"
    if len(times) > 1:
        shown += f" ({min(seconds):.0f}-{max(seconds):.0f})"
    shown += f", step {times[0][0]}" if len(times) == 1 else ""
    if missed:
        shown += f"; not reached on {missed} of {seeds} seeds"
    ratio = "-"
    if ratios:
        ratio = f"{statistics.median(ratios):.2f}"
        ratio += f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
    return [shown, ratio]


def _reached(curve: list, target: float):
    """The first [step, seconds, accuracy] point of `curve` at or above `target`, or None."""
    return next((p for p in curve if p[2] >= target - 1e-9), None)


def _describe(result: dict) -> str:
    speed = result.get("examples_per_s")
    shown = f"{speed:,.0f} ex/s" if speed else result.get("error")
    return f"{shown} accuracy {result.get('accuracy')}"


if __name__ == "__main__":
    sys.exit(main())
