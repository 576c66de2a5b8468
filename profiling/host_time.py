"""Host time of ``chunk_kda`` alone, without a GPU: the CUDA kernels' host code runs on
CPU tensors with every Triton launch stubbed out, fla's layer flags on, on the packed rows
of benchmarks/bench_chunk_kda.py. What it measures: argument checks, the custom ops'
dispatch and autograd, allocations, the varlen index, building each launch's arguments; not
Triton's own launcher (stubbed) nor any GPU time. For short packed sequences the wall time on
the GPU machine is bound by this host path (benchmarks/NOTES.md, seventeenth session).

    python profiling/host_time.py [varlen-mixed-T8192 | varlen-2048x1-64] [--profile tottime|cumulative] [--aten]

For this process only, it registers the CUDA host code as the ops' CPU kernels.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pathlib
import pstats
import sys
import time

# Triton's JIT launchers are the ones stubbed: under its interpreter (as the CPU tests set
# it) the kernels would run instead
os.environ.pop("TRITON_INTERPRET", None)
import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import kda_op  # noqa: E402
import kda_op._contract as contract  # noqa: E402
import kda_op.api as api  # noqa: E402
import kda_op.ops as ops  # noqa: E402
from bench_chunk_kda import LAYER_FLAGS, VARLEN_H, varlen_lengths  # noqa: E402


def _serve_cpu_with_cuda_host_code(launches: list) -> None:
    """The chunked kernels' host code for CPU tensors, each Triton launch a no-op that
    records the kernel's name."""
    def serve(device_type, dtype):
        return dtype != torch.float64

    contract.chunked_kernels_serve = ops.chunked_kernels_serve = api.chunked_kernels_serve = serve
    for op, impl in ((ops.chunk_kda_fwd, ops._chunk_kda_fwd_cuda), (ops.chunk_kda_bwd, ops._chunk_kda_bwd_cuda),
                     (ops.kda_prep_fwd, ops._kda_prep_fwd_cuda), (ops.kda_prep_bwd, ops._kda_prep_bwd_cuda)):
        op.register_kernel("cpu")(impl)

    def launcher(self, grid):
        return lambda *args, **kwargs: launches.append(self.fn.__name__)

    triton.runtime.jit.JITFunction.__getitem__ = launcher


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", nargs="?", default="varlen-mixed-T8192", choices=["varlen-mixed-T8192", "varlen-2048x1-64"])
    parser.add_argument("--profile", choices=["tottime", "cumulative"], help="cProfile 50 steps, sorted so")
    parser.add_argument("--aten", action="store_true", help="torch.profiler's CPU table of 5 steps")
    args = parser.parse_args()
    launches: list = []
    _serve_cpu_with_cuda_host_code(launches)

    lengths = varlen_lengths(args.shape)
    T, H, K = sum(lengths), VARLEN_H, 128
    cu = torch.tensor([0] + lengths).cumsum(0)
    dt = torch.bfloat16
    q, k, v, g = (torch.randn(1, T, H, K, dtype=dt).requires_grad_() for _ in range(4))
    beta = torch.randn(1, T, H, dtype=dt).requires_grad_()
    A_log = torch.rand(H).add(1).log().requires_grad_()
    dt_bias = torch.randn(H * K).requires_grad_()
    leaves = (q, k, v, g, beta, A_log, dt_bias)
    do = torch.randn(1, T, H, K, dtype=dt)
    kw = dict(LAYER_FLAGS, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu, cu_seqlens_cpu=cu,
              output_final_state=False)

    def forward():
        with torch.no_grad():
            return kda_op.chunk_kda(q, k, v, g, beta, **kw)

    def forward_backward():
        for x in leaves:  # as do_bench's grad_to_none: no accumulation into .grad
            x.grad = None
        o, _ = kda_op.chunk_kda(q, k, v, g, beta, **kw)
        o.backward(do)

    for step in (forward, forward_backward):
        for _ in range(5):
            step()
        launches.clear()
        step()
        count = len(launches)
        # the minimum of five means of 20 steps: this machine's other work only adds
        rounds = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(20):
                step()
            rounds.append((time.perf_counter() - start) / 20 * 1e3)
        print(f"{args.shape} {step.__name__}: {min(rounds):.3f} ms of host time (min of 5 x 20), "
              f"{count} Triton launches (stubbed)", flush=True)
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(50):
            forward_backward()
        profiler.disable()
        pstats.Stats(profiler).sort_stats(args.profile).print_stats(45)
    if args.aten:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                forward_backward()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
