"""Registers, spills and shared memory of the one-pass forward
(kda_op/triton_kernels/one_pass_fwd.py) compiled for the H200 (sm_90a) without a GPU,
through benchmarks/kernel_resources.py's compiler call. Run with the GPU machine's
Triton (3.6):

    PYTHONPATH=/tmp/t36:$PWD python benchmarks/one_pass_resources.py [--dtype bf16] [--bv 32 64] [--warps 4 8] [--sass]

Without /tmp/t36 on PYTHONPATH it compiles with the local Triton (3.9 here) instead.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton  # noqa: E402

from kernel_resources import resources, sass_summary  # noqa: E402
from kda_op import _contract  # noqa: E402
from kda_op.triton_kernels import settings as S  # noqa: E402
from kda_op.triton_kernels.one_pass_fwd import kda_one_pass_fwd_kernel  # noqa: E402
from kda_op.triton_kernels.settings import BC, BT, MAX_SPLIT  # noqa: E402

SHARED_LIMIT = 232448  # the H200's per-block maximum (227 KB)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--head-dim", type=int, default=128, help="K = V")
    parser.add_argument("--bv", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--stages", type=int, nargs="+", default=[1])
    parser.add_argument("--bka", type=int, default=32, help="the K slice of the A's")
    parser.add_argument("--no-states", action="store_true", help="compile without the chunk-state stores")
    parser.add_argument("--varlen", action="store_true", help="packed sequences (cu_seqlens)")
    parser.add_argument("--sass", action="store_true",
                        help="also static SASS instruction counts (kernel_resources.sass_summary)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="override a constexpr of the kernel (integers or True/False), e.g. A_BF16=False")
    args = parser.parse_args(argv)
    import torch

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    x = "*bf16" if args.dtype == "bf16" else "*fp32"
    cs = "*bf16" if _contract.chunk_states_dtype(dtype, "cuda") == torch.bfloat16 else "*fp32"
    K = V = args.head_dim
    signature = dict(q=x, k=x, v=x, g="*fp32", beta=x, h0="*fp32", o=x, ht="*fp32", chunk_states=cs, paths="*i32",
                     cu_seqlens="*i32", seq_offsets="*i64", scale="fp32", T="i32", NC="i32", NCS="i32", H="i32", HV="i32")
    over = []
    for bv in args.bv:
        for warps in args.warps:
            for stages in args.stages:
                constexprs = dict(K=K, V=V, BT=BT, BC=BC, BK=max(16, triton.next_power_of_2(K)), BV=bv, BKA=min(args.bka, max(16, triton.next_power_of_2(K))),
                                  MAX_SPLIT=MAX_SPLIT, IS_VARLEN=args.varlen, HAS_H0=True, STORE_HT=True, STORE_STATES=not args.no_states,
                                  STORE_PATHS=False, DOT_PREC="tf32" if args.dtype == "bf16" else "tf32x3",
                                  BF16_DOTS=args.dtype == "bf16", A_BF16=False, INTERPRET=False, FAST_EXP=bool(S.FAST_EXP))
                for item in args.set:
                    name, value = item.split("=", 1)
                    constexprs[name] = {"True": True, "False": False}.get(value, value)
                    if isinstance(constexprs[name], str) and constexprs[name].lstrip("-").isdigit():
                        constexprs[name] = int(constexprs[name])
                line, shared, _ = resources(kda_one_pass_fwd_kernel, signature, constexprs, warps, stages)
                print(f"BV {bv:3d} {line}", flush=True)
                if args.sass:
                    print(f"BV {bv:3d} {sass_summary(kda_one_pass_fwd_kernel, signature, constexprs, warps, stages)}",
                          flush=True)
                if shared > SHARED_LIMIT:
                    over.append((bv, warps, stages, shared))
    if over:
        print(f"over {SHARED_LIMIT} B of shared memory: {over}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
