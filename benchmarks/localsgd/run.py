"""LocalSGD against CollectiveAllReduce, on loopback and across a rate-limited link.

Rows (2 workers, `tfstrat bench scaling`'s small CNN on learnable labels, SGD with momentum):
  B-2       CollectiveAllReduce (gradients all-reduced every step)
  L-2-sN    LocalSGD, plain averaging every N steps (N = 1, 4, 16)
  D-2-s16   LocalSGD with DiLoCo's outer Nesterov step, every 16 steps
Each row: examples/s (median of the timed epochs), bytes this worker sent per step (on its
sockets for LocalSGD; what CollectiveAllReduce hands its ring, by ring arithmetic, for B-2),
and accuracy on 1,024 held-out images after the same number of examples.

Networks: loopback (`tfstrat launch` on 127.0.0.1), and one task per network namespace with
each host's egress limited by `tc qdisc ... tbf rate 1gbit` (tests/netns.py; the machinery of
benchmarks/multihost/run.py, reused). Run as root:
    .venv/bin/python benchmarks/localsgd/run.py --out bench-out/localsgd [--steps 20]
Writes OUT/localsgd.md and OUT/localsgd.json.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))


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
]


def table(rows: list[dict], links: dict, args, machine: dict) -> str:
    from tfstrat.bench import _report

    networks = list(links)
    headers = ["row", "strategy"]
    for n in networks:
        headers += [f"{n}: ex/s (min-max)", f"{n}: vs B-2", f"{n}: accuracy"]
    headers += ["bytes sent/step/worker"]
    base = {  # vs B-2 of the same model (B-2, B-2-wide)
        ("wide" if b["row"].endswith("-wide") else "", n): b["results"][n].get("examples_per_s")
        for b in rows
        if b["row"].startswith("B-2")
        for n in networks
        if n in b["results"]
    }
    body = []
    for r in rows:
        cells = [r["row"], r["label"]]
        kind = "wide" if r["row"].endswith("-wide") else ""
        for n in networks:
            m = r["results"].get(n, {})
            if "examples_per_s" not in m:
                cells += [f"failed: {m.get('error', '?')[:80]}", "-", "-"]
                continue
            x = m["examples_per_s"]
            cells.append(f"{x:,.0f} ({m['examples_per_s_min']:,.0f}-{m['examples_per_s_max']:,.0f})")
            cells.append(f"{x / base[kind, n]:.2f}" if base.get((kind, n)) else "-")
            acc = m.get("accuracy")
            cells.append(f"{acc:.1%}" if acc is not None else "-")
        sent = next(
            (m.get("bytes_sent_per_step") for m in r["results"].values() if "examples_per_s" in m),
            None,
        )
        cells.append(f"{sent:,.0f}" if sent else "-")
        body.append(cells)
    link = ", ".join(f"{n}: {v:,.0f} MB/s" for n, v in links.items())
    return _report.markdown(headers, body) + (
        f"\n\nOne TCP stream between two hosts (the link): {link}. {args.workers} workers, "
        f"{args.threads} thread(s) per TensorFlow pool per task; median of {args.repeats} timed "
        f"epochs of {args.steps} steps after a warm-up epoch (every row sees the same "
        "examples). Accuracy: on 1,024 held-out images (noise over a colour per image, labelled "
        "by the training labels' fixed random linear map of the colour). Machine: "
        f"{machine.get('cpus')} CPUs, TensorFlow {machine.get('tensorflow')}, Keras "
        f"{machine.get('keras')}; every task shares these cores."
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench-out/localsgd")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rate", default="1gbit", help="tc tbf rate of the limited network")
    parser.add_argument("--rows", default=",".join(r[0] for r in ROWS))
    parser.add_argument("--networks", default="loopback,limited")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--link-mb", type=int, default=300, help="MB sent to measure the link")
    parser.add_argument("--render", metavar="JSON", help="print the table of an earlier run")
    args = parser.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            saved = json.load(f)
        for key in ("workers", "threads", "steps", "repeats"):
            setattr(args, key, saved.get("args", {}).get(key, getattr(args, key)))
        print(table(saved["rows"], saved["links_mb_per_s"], args, saved["machine"]))
        return 0

    import netns

    from tfstrat.bench import _report

    multihost = _multihost()
    wanted_networks = args.networks.split(",")
    if "limited" in wanted_networks:
        try:
            netns.check_available()
        except netns.Unavailable as e:
            print(f"benchmarks/localsgd: {e}", file=sys.stderr)
            return 2
    machine = _report.machine()
    wanted = args.rows.split(",")
    specs = {r[0]: r for r in ROWS}
    rows = [
        {"row": r[0], "label": r[2], "workers": args.workers, "results": {}}
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
        multihost.measure(rows, specs, nets, links, args, _describe)
    text = table(rows, links, args, machine)
    multihost.write(args.out, "localsgd", text, links, rows, machine, args)
    return 0


def _describe(result: dict) -> str:
    speed = result.get("examples_per_s")
    shown = f"{speed:,.0f} ex/s" if speed else result.get("error")
    return f"{shown} accuracy {result.get('accuracy')}"

if __name__ == "__main__":
    sys.exit(main())
