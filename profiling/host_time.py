"""Host time of ``chunk_kda`` alone, without a GPU: the CUDA kernels' host code runs on
CPU tensors with every Triton launch stubbed out, fla's layer flags on, on the packed rows
of benchmarks/bench_chunk_kda.py. What it measures: argument checks, the custom ops'
dispatch and autograd, allocations, the varlen index, building each launch's arguments; not
Triton's own launcher (stubbed) nor any GPU time. For short packed sequences the wall time on
the GPU machine is bound by this host path (benchmarks/NOTES.md, seventeenth session).

    python profiling/host_time.py [varlen-mixed-T8192 | varlen-2048x1-64] [--profile tottime|cumulative] [--aten]

For this process only, it registers the CUDA host code as the ops' CPU kernels.

On the GPU machine, ``--device cuda`` runs the real thing instead (nothing stubbed; fla beside
it with ``--fla``): per step the time until the call returns (host: argument checks, dispatch,
allocations, Triton's launchers; the GPU queue is drained between steps, so it never waits
on a full queue) and the wall time of back-to-back steps; ``--profile`` then profiles 20 of
our steps there.
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
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu: the CUDA host code with launches stubbed; cuda: the real thing")
    parser.add_argument("--fla", action="store_true", help="with --device cuda: fla's chunk_kda too")
    args = parser.parse_args()
    if args.device == "cuda":
        return _on_cuda(args)
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


def _on_cuda(args) -> int:
    """Host and wall time per step on the GPU, ours (and fla's), forward and
    forward+backward, fla's layer flags, the same inputs for both."""
    import statistics

    from bench_chunk_kda import make_layer_inputs

    lengths = varlen_lengths(args.shape)
    T = sum(lengths)
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0)
    inputs, params, do = make_layer_inputs(1, T, VARLEN_H, VARLEN_H)
    q, k, v, g, beta = inputs
    leaves = list(inputs) + list(params.values())
    kw = dict(LAYER_FLAGS, **params, cu_seqlens=cu, cu_seqlens_cpu=cu.cpu(), output_final_state=False)
    impls = {"ours": kda_op.chunk_kda}
    if args.fla:
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        impls["fla"] = fla_chunk_kda
    steps = {}
    for label, fn in impls.items():
        def forward(fn=fn):
            with torch.no_grad():
                return fn(q, k, v, g, beta, **kw)

        def forward_backward(fn=fn):
            for x in leaves:
                x.grad = None
            o, _ = fn(q, k, v, g, beta, **kw)
            o.backward(do)

        steps[label] = (forward, forward_backward)
        for step in (forward, forward_backward):
            for _ in range(3):  # compiles (and fla's autotuning)
                step()
    torch.cuda.synchronize()
    for label, pair in steps.items():
        for step in pair:
            host = []
            for _ in range(30):
                torch.cuda.synchronize()
                start = time.perf_counter()
                step()
                host.append((time.perf_counter() - start) * 1e3)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(30):
                step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) / 30 * 1e3
            print(f"{args.shape} {label} {step.__name__}: host {statistics.median(host):.3f} ms (median of 30, "
                  f"min {min(host):.3f}), wall {wall:.3f} ms a step back to back", flush=True)
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(20):
            steps["ours"][1]()
        profiler.disable()
        torch.cuda.synchronize()
        pstats.Stats(profiler).sort_stats(args.profile).print_stats(60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
