"""Profile KDA under torch.profiler: the op or the layer, forward and backward,
eager or compiled, on CPU or CUDA.

Each run writes a trace that the TensorBoard profiler plugin (torch-tb-profiler)
reads, ``<out-dir>/<run>/<worker>.<time>.pt.trace.json``; the same file opens
in Perfetto (ui.perfetto.dev) or chrome://tracing. The op's stages appear as
``kda_op::fwd::*`` / ``kda_op::bwd::*`` ranges (on CUDA: intra, state_scan,
output, or recurrent for up to 16 tokens; intra_recompute, state_scan,
intra_through_w, intra, intra_through_a, gva_reduce; on CPU: the reference's
recurrence, recompute_chunk and bptt_chunk). The script then prints the top
kernels/ops by self time.

    python profiling/profile_kda.py --target op --mode eager
    python profiling/profile_kda.py --target layer --mode compiled --device cuda --seq-len 8192
    tensorboard --logdir profiling/traces
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function, schedule, tensorboard_trace_handler

from kda_op import chunk_kda
from kda_op.nn import KimiDeltaAttention


def make_step(target: str, mode: str, device: str, batch: int, seq_len: int, heads: int, value_heads: int,
              head_dim: int, dtype: torch.dtype):
    """A closure that runs one forward+backward of the op or the layer."""
    gen = torch.Generator(device=device).manual_seed(0)
    if target == "op":
        def randn(*shape):
            return torch.randn(*shape, device=device, generator=gen)

        q = randn(batch, seq_len, heads, head_dim).to(dtype).requires_grad_()
        k = F.normalize(randn(batch, seq_len, heads, head_dim), dim=-1).to(dtype).requires_grad_()
        v = randn(batch, seq_len, value_heads, head_dim).to(dtype).requires_grad_()
        g = F.logsigmoid(randn(batch, seq_len, value_heads, head_dim)).clamp_min(-5.0).requires_grad_()
        beta = torch.sigmoid(randn(batch, seq_len, value_heads)).to(dtype).requires_grad_()

        def forward():
            o, _ = chunk_kda(q, k, v, g, beta)
            return o
    else:
        hidden = heads * head_dim
        layer = KimiDeltaAttention(hidden_size=hidden, head_dim=head_dim, num_heads=heads, num_v_heads=value_heads)
        layer = layer.to(device=device, dtype=dtype)
        x = torch.randn(batch, seq_len, hidden, device=device, generator=gen).to(dtype).requires_grad_()

        def forward():
            y, _ = layer(x)
            return y

    fn = torch.compile(forward, fullgraph=True) if mode == "compiled" else forward

    def step():
        with record_function(f"kda_profile::{target}::forward"):
            out = fn()
        with record_function(f"kda_profile::{target}::backward"):
            out.float().square().mean().backward()

    return step


def run(target: str = "op", mode: str = "eager", device: str = "cpu", out_dir: str = "profiling/traces",
        batch: int = 1, seq_len: int = 256, heads: int = 2, value_heads: int = 4, head_dim: int = 32,
        dtype: torch.dtype = torch.float32, active_steps: int = 2) -> tuple[torch.profiler.profile, Path]:
    """Profile ``active_steps`` forward+backward steps after a warm-up; returns
    the profiler and the trace file it wrote."""
    step = make_step(target, mode, device, batch, seq_len, heads, value_heads, head_dim, dtype)
    run_dir = Path(out_dir) / f"{target}-{mode}-{device}"
    run_dir.mkdir(parents=True, exist_ok=True)
    before = set(run_dir.glob("*.pt.trace.json"))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(
        activities=activities,
        schedule=schedule(wait=0, warmup=1, active=active_steps, repeat=1),
        on_trace_ready=tensorboard_trace_handler(str(run_dir), worker_name=f"{target}_{mode}"),
        record_shapes=True,
    ) as prof:
        for _ in range(1 + active_steps):
            step()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            prof.step()
    written = sorted(set(run_dir.glob("*.pt.trace.json")) - before)
    if not written:
        raise RuntimeError(f"the profiler wrote no trace under {run_dir}")
    return prof, written[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=["op", "layer"], default="op")
    parser.add_argument("--mode", choices=["eager", "compiled"], default="eager")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out-dir", default="profiling/traces")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--value-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--rows", type=int, default=15, help="rows of the top-ops table")
    args = parser.parse_args(argv)

    prof, trace = run(args.target, args.mode, args.device, args.out_dir, args.batch, args.seq_len, args.heads,
                      args.value_heads, args.head_dim, getattr(torch, args.dtype))
    sort_by = "self_cuda_time_total" if args.device.startswith("cuda") else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort_by, row_limit=args.rows))
    print(f"trace: {trace}\n  TensorBoard: tensorboard --logdir {args.out_dir}\n  Perfetto: open the file at ui.perfetto.dev")
    return 0


if __name__ == "__main__":
    sys.exit(main())
