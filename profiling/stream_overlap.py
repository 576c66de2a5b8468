"""How much of a no-grad forward's GPU time runs on more than one stream at once.

Wall time alone cannot say whether kernels launched on two streams overlapped or merely
ran one after the other: this records one forward under torch.profiler and prints, per
stream, the kernels' busy time, then the span from the first kernel's start to the last
one's end, the time at least one kernel ran (busy union) and the time two or more ran at
once. Written for the forward split into batch or time pieces with each piece's scan on a
side stream (the fortieth session's FWD_BATCH_PIECES / FWD_TIME_PIECES, removed after this
showed, 2026-12-07, that the scans overlapped the intra-chunk stage by 0.56 ms at
B8-T8192-H16 and slowed it by as much: benchmarks/NOTES.md).

    python profiling/stream_overlap.py --shape 8 8192 16 16 --variants "" "FUSED_OUTPUT=0"
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

Interval = tuple[float, float]


def overlap_summary(intervals: dict[int, list[Interval]]) -> dict[str, float]:
    """From kernel (start, end) intervals grouped by stream: ``span`` (first start to last
    end), ``busy`` (time at least one kernel runs), ``overlap`` (time kernels of two or more
    streams run at once) and ``busy_<stream>`` per stream (union of its own kernels), all in
    the intervals' unit. Kernels of one stream do not overlap each other in the count."""
    summary: dict[str, float] = {}
    edges = []  # (time, +1/-1) per stream's merged intervals
    for stream, spans in intervals.items():
        merged: list[list[float]] = []
        for start, end in sorted(spans):
            if end < start:
                raise ValueError(f"stream {stream}: interval ({start}, {end}) ends before it starts")
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        summary[f"busy_{stream}"] = sum(e - s for s, e in merged)
        edges += [(s, 1) for s, _ in merged] + [(e, -1) for _, e in merged]
    if not edges:
        return {"span": 0.0, "busy": 0.0, "overlap": 0.0, **summary}
    edges.sort(key=lambda x: (x[0], x[1]))  # at a tie an end before a start
    busy = overlap = 0.0
    running, last = 0, edges[0][0]
    for t, step in edges:
        if running >= 1:
            busy += t - last
        if running >= 2:
            overlap += t - last
        running += step
        last = t
    return {"span": edges[-1][0] - edges[0][0], "busy": busy, "overlap": overlap, **summary}


def _kernel_intervals(prof) -> dict[int, list[Interval]]:
    """The CUDA kernels of a torch.profiler run, (start, end) in microseconds, by stream."""
    out: dict[int, list[Interval]] = {}
    for event in prof.events():
        if getattr(event, "device_type", None) is None or str(event.device_type) != "DeviceType.CUDA":
            continue
        if "memcpy" in event.name.lower() or "memset" in event.name.lower():
            continue
        out.setdefault(event.device_resource_id, []).append((event.time_range.start, event.time_range.end))
    return out


def main(argv: list[str] | None = None) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_chunk_kda import launch_settings, make_inputs

    from kda_op import chunk_kda

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs=4, default=[8, 8192, 16, 16], metavar=("B", "T", "H", "HV"))
    parser.add_argument("--variants", nargs="+", default=[""],
                        help='settings as bench_chunk_kda.py takes them ("" for the defaults)')
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("stream_overlap.py: needs a CUDA device (the side streams run only there)")
    (q, k, v, g, beta, h0), _ = make_inputs(*args.shape)
    print(f"shape B, T, H, HV = {args.shape}; one no-grad forward each, times in ms")
    print("| variant | span | busy | overlap | per stream |")
    print("|---|---|---|---|---|")
    for variant in args.variants:
        with launch_settings(variant)(), torch.no_grad():
            for _ in range(3):  # compile and warm
                chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
                torch.cuda.synchronize()
        s = overlap_summary(_kernel_intervals(prof))
        streams = ", ".join(f"{k[5:]}: {val / 1e3:.3f}" for k, val in s.items() if k.startswith("busy_"))
        print(f"| {variant or 'defaults'} | {s['span'] / 1e3:.3f} | {s['busy'] / 1e3:.3f} | "
              f"{s['overlap'] / 1e3:.3f} | {streams} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
