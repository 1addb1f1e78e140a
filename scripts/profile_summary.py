"""Where a jax.profiler trace's time went, as text: per device (and the host's XLA lines), the
executables (`XLA Modules`) and kernels (`XLA Ops`, or a GPU stream's line) by total time, with
their count and mean. Reads what `bench_throughput.py --profile DIR` (or any jax.profiler.trace)
wrote, with jax's own ProfileData: no TensorBoard needed, so it runs on the GPU machine itself.

  python scripts/profile_summary.py DIR [--top 25] [--output-json FILE]

A decode step's device time is its `forward` executable's mean in `XLA Modules` (where the trace
has that line). Each device line also lists its longest idle gaps (a compile in the middle of a
run shows as one of seconds) and how much of its span they cover.
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
    gaps: dict = {}
    for file in files:
        data = ProfileData.from_file(file)
        for plane in data.planes:
            device = "/device:" in plane.name
            for line in plane.lines:
                if not device and "XLA" not in line.name:
                    continue
                key = (plane.name, line.name)
                events = sorted(((e.start_ns, e.duration_ns, e.name) for e in line.events))
                for _, duration, name in events:
                    entry = totals[key][name]
                    entry[0] += 1
                    entry[1] += duration
                if events:
                    spans[key] = (max(t + d for t, d, _ in events) - events[0][0]) / 1e6
                    if device:
                        gaps[key] = idle_gaps(events, events[0][0])
    out: dict = {}
    for (plane, line), names in totals.items():
        rows = sorted(((n, c, t / 1e6, t / c / 1e3) for n, (c, t) in names.items()), key=lambda r: -r[2])
        busy = sum(r[2] for r in rows)
        out.setdefault(plane, {})[line] = {"span_ms": spans.get((plane, line), 0.0), "busy_ms": busy,
                                           "top": rows[:top], "gaps": gaps.get((plane, line), [])}
    return out


def idle_gaps(events, origin_ns: int, keep: int = 5) -> list[tuple[float, float]]:
    """The `keep` longest stretches with no event running, as (start ms from origin, length ms)."""
    found, end = [], None
    for start, duration, _ in events:
        if end is not None and start > end:
            found.append(((end - origin_ns) / 1e6, (start - end) / 1e6))
        end = max(end or 0, start + duration)
    return sorted(found, key=lambda g: -g[1])[:keep]


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
            if info["gaps"]:
                idle = sum(length for _, length in info["gaps"])
                lines.append(f"longest idle gaps (start ms, length ms): "
                             + ", ".join(f"{at:.1f}+{length:.1f}" for at, length in info["gaps"])
                             + f": {idle:.1f} ms, {idle / max(info['span_ms'], 1e-9):.0%} of the span")
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
