"""Context-parallel benchmark: one long sequence over the ranks of torchrun, against
the same sequence on one device.

    torchrun --nproc-per-node 2 benchmarks/bench_cp.py [--seq-lens 131072 262144] [--out benchmarks/RESULTS_cp.md]

bf16, H = 16, K = V = 128 (DESIGN.md's standard heads), B = 1. Per length: the
forward+backward of ``kda_op.distributed.chunk_kda_cp`` on each rank's slice (the
median over ranks of ``triton.testing.do_bench`` medians, the ranks synchronised
by a barrier before each timing), the same step of ``chunk_kda`` on the whole
sequence on rank 0's device where it fits, each one's peak memory
(``torch.cuda.max_memory_allocated`` above the inputs), and the all-gather of the
maps alone (the communication's share of the step). Outputs checked against the
single-device call where that ran (bf16 rounding). NCCL on CUDA, one GPU a rank;
``--device cpu`` runs the same steps on gloo with wall-clock timing (a smoke test).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

H = HV = 16
K = V = 128


def inputs(T: int, device, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    q = randn(1, T, H, K).to(dt)
    k = F.normalize(randn(1, T, H, K), dim=-1).to(dt)
    v = randn(1, T, HV, V).to(dt)
    g = F.logsigmoid(randn(1, T, HV, K)).clamp_min(-5.0)
    beta = torch.sigmoid(randn(1, T, HV)).to(dt)
    do = randn(1, T, HV, V).to(dt)
    return [x.requires_grad_() for x in (q, k, v, g, beta)], do


def timed(fn, device) -> float:
    """Median ms of ``fn``: do_bench on CUDA, a wall clock on CPU."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def peak_bytes(fn, device) -> float:
    """bench_chunk_kda's peak of one call on CUDA; nan elsewhere."""
    from bench_chunk_kda import peak_step_bytes

    return peak_step_bytes(fn) if device.type == "cuda" else float("nan")


def main(argv=None) -> int:
    from kda_op.distributed import init_from_torchrun

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[131072, 262144])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = init_from_torchrun(args.device)
    cuda = device.type == "cuda"
    rank, world = dist.get_rank(), dist.get_world_size()
    from kda_op import chunk_kda
    from kda_op.distributed import _all_gather, chunk_kda_cp

    rows = []
    for T in args.seq_lens:
        (q, k, v, g, beta), do = inputs(T, device)
        a, b = rank * T // world, (rank + 1) * T // world
        mine = [x[:, a:b].detach().clone().requires_grad_() for x in (q, k, v, g, beta)]

        def cp_step():
            o, _ = chunk_kda_cp(*mine)
            o.backward(do[:, a:b])

        def synced(fn):
            def run():
                dist.barrier()
                fn()
            return run

        cp_step()
        ms_cp = statistics.median(_gather_floats([timed(synced(cp_step), device)], world))
        peak_cp = max(_gather_floats([peak_bytes(cp_step, device)], world))
        maps = torch.randn(1, HV, K, K + V, device=device)
        ms_comm = statistics.median(_gather_floats([timed(synced(lambda: _all_gather(maps, dist.group.WORLD)), device)], world))
        ms_one = peak_one = float("nan")
        err = float("nan")
        if rank == 0:
            def one_step():
                o, _ = chunk_kda(q, k, v, g, beta)
                o.backward(do)

            try:
                one_step()
                ms_one = timed(one_step, device)
                peak_one = peak_bytes(one_step, device)
                with torch.no_grad():
                    o_ref, _ = chunk_kda(q, k, v, g, beta)
            except torch.OutOfMemoryError:
                o_ref = None
        else:
            o_ref = None
        with torch.no_grad():
            o_mine, _ = chunk_kda_cp(*(x.detach() for x in mine))
        gathered = [torch.empty_like(o_mine) for _ in range(world)] if rank == 0 else None
        dist.gather(o_mine.contiguous(), gathered, dst=0) if world > 1 else None
        if rank == 0 and o_ref is not None:
            o_cp = torch.cat(gathered, dim=1) if world > 1 else o_mine
            err = ((o_cp.float() - o_ref.float()).norm() / o_ref.float().norm()).item()
        rows.append((T, ms_cp, peak_cp, ms_comm, ms_one, peak_one, err))
        if rank == 0:
            print(rows[-1], flush=True)
    if rank == 0:
        gib = 2**30
        lines = ["| T | ranks | fwd+bwd CP ms | peak per rank GiB | all-gather ms (share) | one device ms | "
                 "one device GiB | rel diff o |", "|" + "---|" * 8]
        for T, ms_cp, peak_cp, ms_comm, ms_one, peak_one, err in rows:
            lines.append(f"| {T} | {world} | {ms_cp:.2f} | {peak_cp / gib:.2f} | {ms_comm:.3f} ({ms_comm / ms_cp:.1%}) "
                         f"| {ms_one:.2f} | {peak_one / gib:.2f} | {err:.1e} |")
        name = torch.cuda.get_device_name() if cuda else "CPU (gloo)"
        meta = f"{datetime.date.today().isoformat()}, {world} x {name}, torch {torch.__version__}"
        table = "\n".join(lines)
        print(meta)
        print(table)
        if args.out:
            with open(args.out, "w") as f:
                f.write(f"{meta}\n\nCommand: `torchrun --nproc-per-node {world} benchmarks/bench_cp.py --seq-lens "
                        f"{' '.join(map(str, args.seq_lens))}`\n\n{table}\n")
    dist.destroy_process_group()
    return 0


def _gather_floats(values: list, world: int) -> list:
    """Every rank's ``values[0]``, on every rank."""
    out = [None] * world
    dist.all_gather_object(out, values[0])
    return out


if __name__ == "__main__":
    sys.exit(main())
