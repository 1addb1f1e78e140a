"""Where a jax.profiler trace's time went, as text: per device (and the host's XLA lines), the
executables (`XLA Modules`) and kernels (`XLA Ops`, or a GPU stream's line) by total time, with
their count and mean. Reads what `bench_throughput.py --profile DIR` (or any jax.profiler.trace)
wrote, with jax's own ProfileData: no TensorBoard needed, so it runs on the GPU machine itself.

  python scripts/profile_summary.py DIR [--top 25] [--output-json FILE]

A decode step's device time is its `forward` executable's mean in `XLA Modules`.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys


def trace_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return sorted(glob.glob(os.path.join(path, "**", "*.xplane.pb"), recursive=True))


def summarize(path: str, top: int = 25) -> dict:
    """{plane: {line: [(name, count, total_ms, mean_us), ...]}} over every trace file under path,
    keeping the device planes and, of the host plane, its XLA lines only."""
    from jax.profiler import ProfileData
    files = trace_files(path)
    if not files:
        raise SystemExit(f"no *.xplane.pb under {path}")
    totals: dict = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0]))
    spans: dict = {}
    for file in files:
        data = ProfileData.from_file(file)
        for plane in data.planes:
            device = "/device:" in plane.name
            for line in plane.lines:
                if not device and "XLA" not in line.name:
                    continue
                key = (plane.name, line.name)
                first, last = None, None
                for event in line.events:
                    entry = totals[key][event.name]
                    entry[0] += 1
                    entry[1] += event.duration_ns
                    first = event.start_ns if first is None else min(first, event.start_ns)
                    last = max(last or 0, event.start_ns + event.duration_ns)
                if first is not None:
                    spans[key] = (last - first) / 1e6
    out: dict = {}
    for (plane, line), names in totals.items():
        rows = sorted(((n, c, t / 1e6, t / c / 1e3) for n, (c, t) in names.items()), key=lambda r: -r[2])
        busy = sum(r[2] for r in rows)
        out.setdefault(plane, {})[line] = {"span_ms": spans.get((plane, line), 0.0), "busy_ms": busy,
                                           "top": rows[:top]}
    return out


def render(summary: dict) -> str:
    lines = []
    for plane, by_line in summary.items():
        for line, info in by_line.items():
            if not info["top"]:
                continue
            lines.append(f"## {plane} / {line}: busy {info['busy_ms']:.1f} ms over a span of {info['span_ms']:.1f} ms")
            lines.append("| name | count | total ms | mean µs |")
            lines.append("|---|---|---|---|")
            lines += [f"| {n[:110]} | {c} | {t:.2f} | {m:.1f} |" for n, c, t, m in info["top"]]
            lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path", help="a trace directory (searched for *.xplane.pb) or one file")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--output-json")
    args = p.parse_args(argv)
    summary = summarize(args.path, args.top)
    print(render(summary), flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
