"""Time each of our kernels (torch.profiler, CUDA time per forward+backward step)
under several launch settings of the intra-chunk kernels, on the first standard
shape (B1-T8192-H16, bf16, K = V = 128). Needs a CUDA GPU; no fla.

    python benchmarks/bench_kernels.py [--warps 8,8,8,4 4,4,8,4]
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch
import triton.testing

from bench_chunk_kda import SHAPES, make_inputs


def kernel_times(step, reps: int = 5) -> dict:
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    out = collections.defaultdict(float)
    for e in prof.key_averages():
        if e.device_time_total > 0:
            out[e.key] += e.device_time_total / reps / 1e3  # ms per step
    return dict(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warps", nargs="+", default=["8,8,8,4", "4,4,8,4", "8,8,4,8"],
                        help="warps of intra_a_fwd,intra_wu_fwd,intra_bwd,intra_bwd_a per setting")
    args = parser.parse_args()

    from kda_op import chunk_kda
    from kda_op.triton_kernels import launch

    name, B, T, H, HV = SHAPES[0]
    inputs, do = make_inputs(B, T, H, HV)
    q, k, v, g, beta, h0 = inputs

    def fwd():
        with torch.no_grad():
            return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)

    def fwd_bwd():
        o, _ = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        o.backward(do)

    for setting in args.warps:
        launch.INTRA_A_FWD_WARPS, launch.INTRA_WU_FWD_WARPS, launch.INTRA_BWD_WARPS, launch.INTRA_BWD_A_WARPS = (
            int(x) for x in setting.split(","))
        fwd_bwd()  # compiles
        f = triton.testing.do_bench(fwd, warmup=50, rep=300, return_mode="median")
        fb = triton.testing.do_bench(fwd_bwd, warmup=50, rep=300, grad_to_none=inputs, return_mode="median")
        print(f"{name} warps a_fwd,wu_fwd,bwd,bwd_a = {setting}: forward {f:.3f} ms, forward+backward {fb:.3f} ms", flush=True)
        for key, ms in sorted(kernel_times(fwd_bwd).items(), key=lambda kv: -kv[1])[:8]:
            print(f"    {ms:8.3f} ms  {key[:90]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
