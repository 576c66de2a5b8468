"""Serving benchmark: a decode step on a state pool, kda_op against fla.

``fused_recurrent_kda(..., initial_state=pool, ssm_state_indices=idx,
inplace_final_state=True)`` against fla 0.6's ``fused_recurrent_kda_fwd`` with the
same pool and indices (what vLLM calls), at T = 1, B = 64 and 256 sequences, HV =
32, H = 16, K = V = 128, bf16 inputs, an fp32 pool of 4 x B slots and B distinct
random slots. Medians of ``triton.testing.do_bench`` over the replay of a captured
step (CUDA graphs: how serving engines run decode), ours/fla, and the state bytes
moved (each slot's fp32 state read once and written once) per second against the
device-to-device copy ceiling measured in the same process. Needs CUDA and fla.

    python benchmarks/bench_pool.py [--impl ours] [--out benchmarks/RESULTS_pool.md]
        [--settings "RECURRENT_BV=64" "RECURRENT_WARPS=8"]

--settings: after the table, ours alone under other values of settings.py's
RECURRENT_* settings (comma-separated NAME=VALUE, one string per run), each checked
against the defaults' step (o and the written slots).
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
import triton
import triton.testing

from bench_decode import copy_ceiling_bytes_per_s, make_inputs, recurrent_settings, same_size_copy_ms

SHAPES = [(64, 32, 16), (256, 32, 16)]  # B, HV, H
K = V = 128


def make_step_inputs(B, HV, H, seed=0):
    """bench_decode's step inputs, a pool of 4 x B random fp32 states, B distinct random slots."""
    q, k, v, g, beta, _ = make_inputs(B, HV, H, seed)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    pool = torch.randn(4 * B, HV, K, V, device="cuda", generator=gen)
    idx = torch.randperm(4 * B, device="cuda", generator=gen)[:B].to(torch.int32)
    return (q, k, v, g, beta), pool, idx


def graph_ms(step) -> float:
    step()  # compile, autotune
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return triton.testing.do_bench(graph.replay, warmup=50, rep=300, return_mode="median")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", choices=["both", "ours"], default="both")
    parser.add_argument("--out", default=None, help="also write the table (markdown) to this file")
    parser.add_argument("--settings", nargs="*", default=[],
                        help="settings.py RECURRENT_* settings to time ours under after the table")
    parser.add_argument("--layout-probe", action="store_true",
                        help="also time ours on a pool of B slots, taken in order and shuffled")
    args = parser.parse_args()
    from kda_op import fused_recurrent_kda

    impls = {"ours": lambda x, pool, idx: fused_recurrent_kda(*x, initial_state=pool, ssm_state_indices=idx,
                                                              inplace_final_state=True)}
    fla_version = "not run"
    if args.impl == "both":
        import fla
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

        impls["fla"] = lambda x, pool, idx: fused_recurrent_kda_fwd(*x, initial_state=pool, inplace_final_state=True,
                                                                    ssm_state_indices=idx)
        fla_version = getattr(fla, "__version__", "?")
    ceiling = copy_ceiling_bytes_per_s()
    rows = []
    with torch.no_grad():
        for B, HV, H in SHAPES:
            x, pool0, idx = make_step_inputs(B, HV, H)
            res, outs = {}, {}
            for label, fn in impls.items():
                pool = pool0.clone()
                o, _ = fn(x, pool, idx)  # one step from pool0: the results to compare
                outs[label] = (o.float(), pool[idx.long()].clone())
                pool.copy_(pool0)
                # the state decays step after step: the same bytes each time
                res[label] = graph_ms(lambda fn=fn, pool=pool: fn(x, pool, idx))
            state_bytes = 2 * B * HV * K * V * 4
            ours = res["ours"]
            fla_ms = res.get("fla", float("nan"))
            copy_ms = same_size_copy_ms(B * HV * K * V)
            diff = float("nan")
            if "fla" in outs:
                diff = ((outs["ours"][1] - outs["fla"][1]).norm() / outs["fla"][1].norm()).item()
            rows.append((f"B{B}-HV{HV}-H{H} pool {4 * B}", ours * 1e3, fla_ms * 1e3, ours / fla_ms,
                         state_bytes / (ours * 1e-3) / ceiling, copy_ms * 1e3, copy_ms / ours, diff))
            print(rows[-1], flush=True)
    lines = ["| shape | ours us (graph) | fla us (graph) | ours/fla | ours: state bytes/s of the copy ceiling "
             "| same-size copy us (graph) | same-size copy's share of ours | rel diff of the written slots |",
             "|" + "---|" * 8]
    lines += [f"| {n} | {a:.1f} | {b:.1f} | {r:.2f} | {c:.0%} | {cu:.1f} | {cs:.0%} | {d:.1e} |"
              for n, a, b, r, c, cu, cs, d in rows]
    meta = (f"{datetime.date.today().isoformat()}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"triton {triton.__version__}, fla {fla_version}, copy ceiling {ceiling / 1e12:.2f} TB/s")
    table = "\n".join(lines)
    print(meta)
    print(table)
    if args.settings:
        time_settings(impls["ours"], args.settings, ceiling)
    if args.layout_probe:
        time_layout_probe(impls["ours"], ceiling)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"{meta}\n\nCommand: `python benchmarks/bench_pool.py --impl {args.impl} --out {args.out}`\n\n"
                    f"{table}\n")
    return 0


def time_layout_probe(ours, ceiling) -> None:
    """Ours on a pool of exactly B slots with slot n for sequence n (the states of
    plain decode, in order, read through the indices) and on the same pool with the
    slots shuffled: what the random placement in a 4 x B pool costs beside the
    indirection itself."""
    with torch.no_grad():
        for B, HV, H in SHAPES:
            x, pool0, _ = make_step_inputs(B, HV, H)
            pool = pool0[:B].clone()
            state_bytes = 2 * B * HV * K * V * 4
            for label, idx in (("B slots in order", torch.arange(B, device="cuda", dtype=torch.int32)),
                               ("B slots shuffled", torch.randperm(B, device="cuda").to(torch.int32))):
                ms = graph_ms(lambda idx=idx: ours(x, pool, idx))
                print(f"B={B} HV={HV} pool {B} [{label}]: CUDA graph {ms * 1e3:.1f} us, "
                      f"{state_bytes / (ms * 1e-3) / ceiling:.0%} of the copy ceiling", flush=True)


def time_settings(ours, settings, ceiling) -> None:
    """Ours under other launch settings: graph-replay medians, the state bytes' share
    of the copy ceiling, and the largest difference to the defaults' step."""
    with torch.no_grad():
        for B, HV, H in SHAPES:
            x, pool0, idx = make_step_inputs(B, HV, H)
            pool = pool0.clone()
            o, _ = ours(x, pool, idx)
            reference = (o.float(), pool[idx.long()].clone())
            state_bytes = 2 * B * HV * K * V * 4
            for setting in settings:
                with recurrent_settings(setting):
                    pool.copy_(pool0)
                    o, _ = ours(x, pool, idx)
                    got = (o.float(), pool[idx.long()])
                    diff = max(((a - b).norm() / b.norm()).item() for a, b in zip(got, reference))
                    ms = graph_ms(lambda: ours(x, pool, idx))
                print(f"B={B} HV={HV} pool {4 * B} [{setting}]: CUDA graph {ms * 1e3:.1f} us, "
                      f"{state_bytes / (ms * 1e-3) / ceiling:.0%} of the copy ceiling, "
                      f"max rel diff to defaults {diff:.1e}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
