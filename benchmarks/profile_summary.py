"""Where a traced step's time goes: the longest events of a TensorFlow profile, by name.

    TFSTRAT_BENCH_PROFILE=/tmp/prof tfstrat bench sparse --rows H-2
    python benchmarks/profile_summary.py /tmp/prof/worker-0 [--top 40] [--steps 10]

Reads the `*.xplane.pb` under the directory (what `tf.profiler.experimental.start` writes; the
benchmark worker traces 10 steps after its timed ones when TFSTRAT_BENCH_PROFILE is set) and
prints, per thread kind, the total and per-step milliseconds of each op or event name. Needs
only TensorFlow (its `xplane_pb2`), not TensorBoard.
"""

from __future__ import annotations

import argparse
import collections
import glob
import re


def summarize(directory: str, top: int = 40, steps: int = 10) -> str:
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    paths = sorted(glob.glob(f"{directory}/**/*.xplane.pb", recursive=True))
    if not paths:
        raise SystemExit(f"No *.xplane.pb under {directory!r}: was the run traced?")
    space = xplane_pb2.XSpace()
    with open(paths[-1], "rb") as f:
        space.ParseFromString(f.read())
    lines = [f"{paths[-1]}: ms per step ({steps} steps), count, thread, event"]
    for plane in space.planes:
        names = plane.event_metadata
        total, count = collections.Counter(), collections.Counter()
        for line in plane.lines:
            thread = re.sub(r"[/-]?-?\d+$", "", line.name)  # tf_Compute/123 -> tf_Compute
            for event in line.events:
                key = (thread, names[event.metadata_id].name)
                total[key] += event.duration_ps / 1e9
                count[key] += 1
        if total:
            lines.append(f"== {plane.name}")
            for key, ms in total.most_common(top):
                lines.append(f"{ms / steps:9.2f} {count[key]:6d}  {key[0][:24]:24s} {key[1][:120]}")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    print(summarize(args.directory, args.top, args.steps))
