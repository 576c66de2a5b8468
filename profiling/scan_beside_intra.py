"""Whether the forward's scan and its intra-chunk stage can share the GPU: each timed alone,
then both at once on two streams (the scan of one batch beside the intra-chunk stage of
another, as a forward that overlapped them would run), `triton.testing.do_bench` medians.

    python profiling/scan_beside_intra.py [--shape B2-T8192-H8-HV32] [--fused-intra]

If "both" takes about the longer of the two, the scan (one program an SM at B2, bound by
the latency of its chunk step) leaves the SMs room for the intra-chunk stage, and a forward
that pipelined the two would gain up to the shorter one; if it takes about their sum, it
would not. H100, 2026-12-07 (benchmarks/NOTES.md): at B2-T8192-H8-HV32 the scan 0.500 ms and
the intra-chunk stage 0.695, both at once 1.058-1.070 (their sum 1.195); at B8-T8192-H16
0.845 and 1.360, both 2.176-2.210 (no gain).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_chunk_kda import make_inputs  # noqa: E402
from kda_op.triton_kernels import fwd  # noqa: E402
from ncu_stages import parse_shape  # noqa: E402  (the benchmark's shape names)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="B2-T8192-H8-HV32")
    parser.add_argument("--fused-intra", action="store_true",
                        help="the intra-chunk stage as one launch (settings.INTRA_FUSED_TM_ONLY)")
    args = parser.parse_args(argv)
    if args.fused_intra:
        from kda_op.triton_kernels import settings

        settings.INTRA_FUSED_TM_ONLY = 1
    B, T, H, HV = parse_shape(args.shape)
    (q, k, v, g, beta, h0), _ = make_inputs(B, T, H, HV)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    s = fwd._sizes(q, v, cu_seqlens=None, has_initial_state=True)
    scale = q.shape[-1] ** -0.5

    def intra():
        return fwd._intra_fwd(q, k, v, g, beta, scale, s, store_tm=False, solve_u=True)

    x = intra()
    o = torch.empty_like(v)
    ht = torch.empty(B, HV, q.shape[-1], v.shape[-1], device=q.device, dtype=torch.float32)

    def scan():
        fwd._scan_and_output(x, h0, None, o, ht, None, s, q)

    side_b = torch.cuda.Stream()

    def both(scan_first: bool, side_a: torch.cuda.Stream):
        here = torch.cuda.current_stream()
        side_a.wait_stream(here)
        side_b.wait_stream(here)
        for run, stream in ((scan, side_a), (intra, side_b)) if scan_first else ((intra, side_b), (scan, side_a)):
            with torch.cuda.stream(stream):
                run()
        here.wait_stream(side_a)
        here.wait_stream(side_b)

    with torch.no_grad():
        t_scan = do_bench(scan)
        t_intra = do_bench(intra)
        plain, high = torch.cuda.Stream(), torch.cuda.Stream(priority=-1)
        t_both_scan_first = do_bench(lambda: both(True, plain))
        t_both_intra_first = do_bench(lambda: both(False, plain))
        t_both_high = do_bench(lambda: both(False, high))
    label = args.shape + (" (fused intra)" if args.fused_intra else "")
    print(f"{label} on {torch.cuda.get_device_name()}: scan {t_scan:.3f} ms, intra-chunk stage "
          f"{t_intra:.3f} ms, sum {t_scan + t_intra:.3f}, longer {max(t_scan, t_intra):.3f}; both on two "
          f"streams: scan launched first {t_both_scan_first:.3f} ms, intra first {t_both_intra_first:.3f} ms, "
          f"intra first with the scan's stream at high priority {t_both_high:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
