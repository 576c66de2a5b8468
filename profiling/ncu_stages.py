"""A steady run of the layer-style forward (and optionally its backward) for Nsight
Compute to attach to: where the time goes inside a kernel, not only how much.

``benchmarks/bench_chunk_kda.py --kernels`` says how long each kernel takes; ncu says why
(stall reasons, achieved occupancy, bytes against the copy ceiling). This script only runs
steps: fla's layer flags on (benchmarks/bench_chunk_kda.LAYER_FLAGS), bf16, K = V = 128,
under the settings given (``--set NAME=VALUE,...``, names from settings.py). A first step
compiles; ncu should skip it. For example, on the GPU machine (Firecracker runtimes give ncu
the counters; leave the clocks alone):

    ncu --clock-control none -k regex:"kda_intra_a_fwd_rows|kda_intra_wu_fwd" --launch-skip 2 \\
        --launch-count 2 --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python3 profiling/ncu_stages.py --shape B2-T8192-H8-HV32 --steps 2
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_chunk_kda import LAYER_FLAGS, launch_settings, make_inputs, make_layer_inputs  # noqa: E402

from kda_op import chunk_kda  # noqa: E402


def parse_shape(name: str) -> tuple[int, int, int, int]:
    """``"B2-T8192-H8-HV32"`` -> (B, T, H, HV); HV defaults to H."""
    m = re.fullmatch(r"B(\d+)-T(\d+)-H(\d+)(?:-HV(\d+))?", name)
    if m is None:
        raise SystemExit(f"--shape: expected B<n>-T<n>-H<n>[-HV<n>], got {name!r}")
    B, T, H, HV = (int(x) if x else None for x in m.groups())
    return B, T, H, HV or H


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="B2-T8192-H8-HV32")
    parser.add_argument("--steps", type=int, default=2, help="steps after the first (compiling) one")
    parser.add_argument("--backward", action="store_true", help="forward+backward steps (default: forward only)")
    parser.add_argument("--set", default="", help='settings for the run, e.g. "INTRA_A_ROWS_WARPS=2"')
    parser.add_argument("--standard", action="store_true",
                        help="the standard inputs of bench_chunk_kda.py (g given, an initial state) instead of "
                             "layer-style ones")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ncu_stages.py runs the CUDA kernels: no GPU here")
    B, T, H, HV = parse_shape(args.shape)
    if args.standard:
        (q, k, v, g, beta, h0), do = make_inputs(B, T, H, HV)
        kwargs = dict(initial_state=h0, output_final_state=True)
    else:
        (q, k, v, g, beta), params, do = make_layer_inputs(B, T, H, HV)
        kwargs = dict(LAYER_FLAGS, **params, output_final_state=False)
    with launch_settings(args.set)():
        for _ in range(1 + args.steps):
            if args.backward:
                o, _ = chunk_kda(q, k, v, g, beta, **kwargs)
                o.backward(do)
            else:
                with torch.no_grad():
                    chunk_kda(q, k, v, g, beta, **kwargs)
        torch.cuda.synchronize()
    print(f"ncu_stages: {args.shape}{' standard' if args.standard else ' layer-style'}, {1 + args.steps} {'steps' if args.backward else 'forwards'}"
          f"{', ' + args.set if args.set else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
