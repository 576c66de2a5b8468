"""Compile the Triton kernels for the H200 (sm_90a) without a GPU and report
what each needs: registers, spills, stack and shared memory.

Costs no device time: Triton compiles for a named target here, and its bundled
ptxas reports the resources. Shared memory above 227 KB (232448 bytes) does not
launch on the H200; spills mean local-memory traffic.

    python benchmarks/kernel_resources.py [--dtype bf16|fp32] [--head-dim 128] [--set BKA=32]
    python benchmarks/kernel_resources.py --sass [--only intra_wu]   # instruction counts
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kda_op.triton_kernels import diag_inv, gam_fwd, intra_a_fwd, intra_a_fwd_rows, intra_fused_fwd, prep, intra_bwd, intra_bwd_a, intra_bwd_a_rows, intra_bwd_w, intra_wu_fwd, output_fwd, recurrent_fwd, state_bwd, state_fwd, state_output_fwd, varlen_index
from kda_op import _contract
from kda_op._compat import cuobjdump_path, fences_wgmma_after_cp_async, ptxas_path
from kda_op._contract import aqk_dtype, chunk_states_dtype, residual_dtype, tm_dtype
from kda_op.triton_kernels import settings as S
from kda_op.triton_kernels._host import (_INDEX_SEQS, _INDEX_SLOTS, _dot_precision, _sizes, _steep_dot_precision,
                                         scan_bwd_warps, bf16_dup, intra_bwd_w_stages)
from kda_op.triton_kernels.settings import BC, BT, MAX_SPLIT

TARGET = GPUTarget("cuda", 90, 32)
PTXAS = ptxas_path(TARGET.arch)


def _compile(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int):
    # Every constexpr with a default that the caller did not set is passed as its
    # default: Triton >= 3.7 types an omitted one as None ('_unflatten_ir' error).
    defaults = {name: p.default for name, p in inspect.signature(fn.fn).parameters.items()
                if p.default is not inspect.Parameter.empty}
    constexprs = {**{n: v for n, v in defaults.items() if n not in signature}, **constexprs}
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if fn.__name__ == "kda_intra_a_fwd_kernel" and S.INTRA_A_FWD_MAXNREG:
        options["maxnreg"] = S.INTRA_A_FWD_MAXNREG
    if fn.__name__ == "kda_recurrent_fwd_kernel" and S.RECURRENT_MAXNREG:
        options["maxnreg"] = S.RECURRENT_MAXNREG
    if fn.__name__ == "kda_intra_fused_fwd_kernel":
        if constexprs.get("TM_ONLY"):  # (bf16 inputs only: fwd._intra_fused_tm_serves)
            if S.INTRA_FUSED_TM_ONLY_MAXNREG:
                options["maxnreg"] = S.INTRA_FUSED_TM_ONLY_MAXNREG
        elif S.INTRA_FUSED_MAXNREG and constexprs.get("DOT_PREC") == "tf32":
            options["maxnreg"] = S.INTRA_FUSED_MAXNREG
    if fn.__name__ == "kda_intra_a_fwd_rows_kernel" and S.INTRA_A_ROWS_MAXNREG:
        options["maxnreg"] = S.INTRA_A_ROWS_MAXNREG
    if fn.__name__ == "kda_intra_wu_fwd_kernel" and S.INTRA_WU_FWD_MAXNREG and num_warps == S.INTRA_WU_FWD_WARPS_BF16:
        options["maxnreg"] = S.INTRA_WU_FWD_MAXNREG
    if (fn.__name__ == "kda_intra_bwd_a_kernel" and S.INTRA_BWD_A_MAXNREG and not constexprs.get("STEEP")
            and not constexprs.get("ONE_LAUNCH")):
        options["maxnreg"] = S.INTRA_BWD_A_MAXNREG
    if fn.__name__ == "kda_intra_bwd_kernel" and S.INTRA_BWD_MAXNREG and constexprs.get("DOT_PREC") != "tf32x3":
        options["maxnreg"] = S.INTRA_BWD_MAXNREG
    if fn.__name__ == "kda_intra_bwd_w_kernel" and S.INTRA_BWD_W_MAXNREG:
        options["maxnreg"] = S.INTRA_BWD_W_MAXNREG
    if fn.__name__ == "kda_intra_bwd_a_rows_kernel" and S.INTRA_BWD_A_ROWS_MAXNREG:
        options["maxnreg"] = S.INTRA_BWD_A_ROWS_MAXNREG
    # in the kernel's parameter order: Triton >= 3.7 reads the signature by position
    merged = {**signature, **{k: "constexpr" for k in constexprs}}
    params = list(inspect.signature(fn.fn).parameters)
    missing = [p for p in params if p not in merged]
    if missing:
        raise ValueError(f"{fn.__name__}: no type or value for {missing}")
    # Every pointer 16-byte aligned, as Triton's launcher specializes CUDA tensors that
    # are (torch's allocations; the kept intermediates' views start on 256 bytes):
    # without the hint the compiler proves no alignment and loads element by element.
    # Integers get no hint (the launcher adds one where a value is a multiple of 16).
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params)
             if str(merged[p]).startswith("*")}
    return triton.compile(ASTSource(fn=fn, signature={p: merged[p] for p in params}, constexprs=constexprs,
                                    attrs=attrs), target=TARGET, options=options)


# SASS opcodes worth counting: tensor-core, FP32, special-function, global, shared
# and local (spill) memory, barriers, shuffles.
SASS_OPS = ("HGMMA", "HMMA", "FFMA", "FMUL", "FADD", "MUFU", "LDG", "STG", "LDS", "LDSM", "STS", "LDL", "STL",
            "BAR", "SHFL")


def sass_summary(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int) -> str:
    """Static SASS instruction counts of a kernel (all, and by SASS_OPS) and the
    length of each loop body (a backward branch): where a program's instructions
    go, before multiplying by trip counts."""
    kernel = _compile(fn, signature, constexprs, num_warps, num_stages)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    sass = subprocess.run([cuobjdump_path(), "-sass", f.name],
                          capture_output=True, text=True).stdout
    os.unlink(f.name)
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]
    ops: dict = {}
    loops = []
    for ln in lines:
        m = re.search(r"\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)", ln)
        if m:
            ops[m.group(1)] = ops.get(m.group(1), 0) + 1
        here = int(re.search(r"/\*([0-9a-f]{4,})\*/", ln).group(1), 16)
        target = re.search(r"BRA\s+(?:\S+\s+)?(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", ln)
        if target and target.group(1) and int(target.group(1), 16) < here:
            loops.append((here - int(target.group(1), 16)) // 16 + 1)
    counts = ", ".join(f"{op} {ops[op]}" for op in SASS_OPS if ops.get(op))
    body = f"; loop bodies {loops}" if loops else ""
    return f"{fn.__name__:28s} warps {num_warps}: {len(lines)} instructions ({counts}){body}"


def unfenced_wgmmas(ttgir: str) -> list[int]:
    """The TTGIR lines of the wgmmas that may read a shared-memory tile cp.async wrote
    with no proxy fence after it: going back from the wgmma, a wait for async copies
    (or a loop's start) comes before any ``fence_async_shared``. The PTX memory model
    asks for the fence (cp.async writes in the generic proxy, wgmma reads in the async
    one), and Triton's pipeliner puts it there in a plain matmul loop; Triton 3.6-3.8
    leave it out in some of ours (_compat.fences_wgmma_after_cp_async)."""
    lines = ttgir.splitlines()
    found = []
    for i, line in enumerate(lines):
        if "ttng.warp_group_dot " not in line:
            continue
        for before in reversed(lines[:i]):
            if "ttng.fence_async_shared" in before:
                break
            if "ttg.async_wait" in before or "scf.for" in before:
                found.append(i + 1)
                break
    return found


def resources(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int) -> tuple[str, int, str]:
    """A line on the kernel's registers, spills and shared memory; the shared memory
    in bytes; and the kernel's TTGIR."""
    start = time.time()
    kernel = _compile(fn, signature, constexprs, num_warps, num_stages)
    seconds = time.time() - start
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    report = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                            capture_output=True, text=True).stderr
    os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", report)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    tiling = "".join(f" {c}={constexprs[c]}" for c in ("TILE", "PICK_TILE") if constexprs.get(c))
    tiling += "".join(f" {c}=0" for c in ("HAS_H0", "FIRST_UP") if constexprs.get(c, True) is False)
    tiling += "".join(f" {c}=0" for c in ("QG_FIRST", "KR_LAST", "W_FIRST") if constexprs.get(c, True) is False)
    tiling += "".join(f" {c}" for c in ("FIRST_FROM_U", "SKIP_UNKEPT_STATE", "STEEP", "ONE_LAUNCH")
                      if constexprs.get(c))
    line = (f"{fn.__name__ + tiling:28s} warps {num_warps} stages {num_stages}: regs {regs.group(1) if regs else '?':>3s}, "
            f"spill st/ld {spill.group(1) if spill else '?'}/{spill.group(2) if spill else '?'} B, "
            f"shared {kernel.metadata.shared} B, compile {seconds:.1f} s")
    return line, kernel.metadata.shared, kernel.asm["ttgir"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--head-dim", type=int, default=128, help="K = V")
    parser.add_argument("--scan-bv", type=int, default=None,
                        help="the scans' V block (default: the host code's at one sequence and head)")
    parser.add_argument("--sass", action="store_true",
                        help="static SASS instruction counts and loop-body lengths instead of resources")
    parser.add_argument("--only", default=None, help="only kernels whose name contains this")
    parser.add_argument("--scale-type", default="fp32", choices=["fp32", "fp64"],
                        help="scale's type in the forward kernels' signatures (inductor passes fp64)")
    parser.add_argument("--max-shared", type=int, default=None,
                        help="exit with status 1 if a kernel needs more shared memory (bytes) than this")
    parser.add_argument("--bf16-residuals", type=int, choices=[0, 1], default=int(_contract.BF16_RESIDUALS),
                        help="U and U' in bf16 for bf16 inputs (kda_op._contract.BF16_RESIDUALS; default: its value)")
    parser.add_argument("--bf16-chunk-states", type=int, choices=[0, 1], default=int(_contract.BF16_CHUNK_STATES),
                        help="the chunk states in bf16 for bf16 inputs (kda_op._contract.BF16_CHUNK_STATES; "
                             "default: its value)")
    parser.add_argument("--gate", type=int, choices=[0, 1, 2], default=0,
                        help="fla's in-kernel gate in the kernels that read g or write dg (0 off, 1 softplus, "
                             "2 lower bound)")
    parser.add_argument("--varlen", action="store_true", help="the variants for packed sequences (cu_seqlens)")
    parser.add_argument("--check-fences", action="store_true",
                        help="fail where a wgmma may read a tile cp.async wrote without a proxy fence "
                             "(unfenced_wgmmas)")
    parser.add_argument("--set", nargs="*", default=[],
                        help="settings.py settings to compile with, NAME=VALUE (e.g. BKA=32)")
    args = parser.parse_args(argv)
    _contract.BF16_RESIDUALS = bool(args.bf16_residuals)
    _contract.BF16_CHUNK_STATES = bool(args.bf16_chunk_states)
    for item in args.set:
        name, value = item.split("=")
        owner = S if hasattr(S, name) else _contract  # settings.py's, or _contract's (e.g. BF16_AQK)
        if not name.isupper() or not hasattr(owner, name):
            raise SystemExit(f"unknown setting {name!r}")
        setattr(owner, name, None if value == "None" else int(value))  # None: e.g. INTRA_WU_BV

    import torch

    K = V = args.head_dim
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    q = torch.empty(1, 1, 1, K, device="meta", dtype=dtype)
    s = _sizes(q, torch.empty(1, 1, 1, V, device="meta", dtype=dtype))
    if args.scan_bv:
        s["BV_SCAN"] = s["BV_SCAN_FWD"] = args.scan_bv
    x = f"*{args.dtype}"
    f32 = "*fp32"
    op = x if args.dtype == "bf16" else f32  # the scans' operand dtype (_contract.scan_operand_dtype)
    names = {torch.bfloat16: "*bf16", torch.float32: "*fp32"}
    res = names[residual_dtype(dtype)]
    cs = names[chunk_states_dtype(dtype, "cuda")]
    aq = names[aqk_dtype(dtype)]
    dsc = "*bf16" if S.BF16_DSTATES and args.dtype == "bf16" else f32  # dS_C, as bwd.py allocates it
    # dU', as bwd.py allocates it (settings.BF16_DUP: where the fused scan's dots are bf16)
    scan_bwd_bf16 = bool(s["SCAN_BWD_BF16_DOTS"]) and aq == "*bf16" and dsc == "*bf16"
    tmt = names[tm_dtype(dtype)]  # the stored Tm (_contract.BF16_TM)
    dupt = "*bf16" if bf16_dup(args.varlen) and S.SCAN_BWD_FUSED and scan_bwd_bf16 else f32
    prec, steep_prec = _dot_precision(dtype), _steep_dot_precision(dtype)  # as the host code passes them
    ints = dict(T="i32", NC="i32", H="i32", HV="i32")
    # the backward's dq, dk: the op's own at G = 1 (settings.DIRECT_DQ_DK; K = V, H = HV here), else fp32 again
    dq_dk_out = (dict(dq_out=x, dk_out=x, out_scale="fp32") if S.DIRECT_DQ_DK
                 else dict(dq_out=f32, dk_out=f32, out_scale="fp32"))
    scale_type = args.scale_type
    common = dict(K=K, V=V, BT=BT)
    # fla's in-kernel gate (--gate): g is then the raw gate in the inputs' dtype (fla's layer passes bf16)
    gate = dict(GATE=args.gate, HAS_A=args.gate > 0, HAS_BIAS=args.gate > 0)
    # the gate's forms (1, 2 at lower_bound <= 0) make every log decay <= 0: the spreads from rows of gam
    row_spreads = bool(S.GAM_ROW_SPREADS) and args.gate > 0
    gate_sig = dict(A_log=f32, dt_bias=f32, lower_bound="fp32")
    graw = x if args.gate else f32
    # packed sequences (--varlen): the kernels' IS_VARLEN variants and their index arguments
    varlen = dict(IS_VARLEN=bool(args.varlen))
    vl_chunk = dict(cu_seqlens="*i64", chunk_index="*i32")
    vl_seq = dict(cu_seqlens="*i64", seq_offsets="*i64")
    runs = [
        (gam_fwd.kda_gam_fwd_kernel, dict(**vl_chunk, g=graw, gam=f32, spreads=f32, **gate_sig, **ints),
         dict(**varlen, K=K, BT=BT, BKG=S.BKG, **gate, BC=BC, SPREADS=not row_spreads),
         S.GAM_WARPS, 3),
        (intra_a_fwd.kda_intra_a_fwd_kernel,
         dict(**vl_chunk, q=x, k=x, g=f32, gam=f32, spreads=f32, akk=f32, aqk=aq, steep="*i32", qg=op, kr=op,
              scale=scale_type, **ints),
         dict(**varlen, K=K, BT=BT, BKA=S.BKA, DOT_PREC=prec, MAX_SPLIT=MAX_SPLIT, SPREAD_TILE=int(S.INTRA_A_SPREAD_TILE),
              GAM_IN=bool(S.INTRA_GAM_KERNEL), NKB=triton.cdiv(K, S.BKG),
              BLOCK_REFS=bool(S.INTRA_A_BLOCK_REFS), BC=BC, ROW_SPREADS=row_spreads, FAST_EXP=bool(S.FAST_EXP),
              BKR=min(128, triton.next_power_of_2(K)), MODE_LOOPS=bool(S.INTRA_A_MODE_LOOPS)),
         S.INTRA_A_FWD_WARPS, S.INTRA_A_FWD_STAGES),
        (intra_a_fwd_rows.kda_intra_a_fwd_rows_kernel,
         dict(**vl_chunk, q=x, k=x, gam=f32, akk=f32, aqk=aq, steep="*i32", qg=op, kr=op, scale=scale_type, **ints),
         dict(**varlen, K=K, BT=BT, BC=BC, BKA=S.INTRA_A_ROWS_BK, DOT_PREC=prec, MAX_SPLIT=MAX_SPLIT,
              FAST_EXP=bool(S.FAST_EXP)),
         S.INTRA_A_ROWS_WARPS, S.INTRA_A_ROWS_STAGES),
        (intra_a_fwd.kda_intra_a_fwd_steep_kernel,
         dict(**vl_chunk, q=x, k=x, gam=f32, akk=f32, aqk=aq, steep="*i32", scale=scale_type, **ints, n_flags="i32"),
         dict(**varlen, K=K, BT=BT, BC=BC, BKS=S.BKS, DOT_PREC=steep_prec, MAX_SPLIT=MAX_SPLIT,
              ROW_PROGRAMS=bool(S.STEEP_FWD_ROW_PROGRAMS), BLOCK_REFS=bool(S.STEEP_BLOCK_REFS)), 4, 3),
        # the diagonal blocks' inverses in a launch of their own (settings.INTRA_DIAG_INV_KERNEL)
        (diag_inv.kda_diag_inv_kernel, dict(**vl_chunk, akk=f32, beta=x, dinv=f32, **ints),
         dict(**varlen, BT=BT, BC=BC, NBLK=S.DIAG_INV_BLOCKS), S.DIAG_INV_WARPS, 3),
        # as the forward that keeps its intermediates (and the backward's recompute)
        # launches it, then as one that keeps nothing
        *[(intra_wu_fwd.kda_intra_wu_fwd_kernel,
           dict(**vl_chunk, k=x, v=x, beta=x, gam=f32, akk=f32, dinv=f32, w=op, u=res, tm=f32, **ints),
           dict(common, **varlen, BC=BC, BK=S.INTRA_WU_BK or s["BK"], BV=S.INTRA_WU_BV or s["BV"], STORE_TM=keep, DOT_PREC=prec, TM_ROW_LOADS=S.TM_ROW_LOADS, FAST_EXP=bool(S.FAST_EXP),
                DINV_IN=bool(S.INTRA_DIAG_INV_KERNEL),
                BF16_DOTS=S.WU_BF16_DOTS and args.dtype == "bf16"),
           S.INTRA_WU_FWD_WARPS_BF16 if args.dtype == "bf16" and s["BK"] <= 128 else S.INTRA_WU_FWD_WARPS, 3)
          for keep in (True, False)],
        # the intra-chunk stage in one launch (settings.INTRA_FUSED_FWD; its TM_ONLY form,
        # INTRA_FUSED_TM_ONLY, on bf16 inputs), and intra_wu_fwd's launch for the steep chunks
        # that it leaves (ONLY_STEEP)
        *[(intra_fused_fwd.kda_intra_fused_fwd_kernel,
         dict(**vl_chunk, q=x, k=x, v=x, g=graw, beta=x, gam=f32, aqk=aq, steep="*i32", qg=op, kr=op, w=op, u=res,
              akk=f32, tm="*bf16" if tm_only else f32, **gate_sig, scale=scale_type, **ints),
         dict(common, **varlen, **gate, NONPOSITIVE=row_spreads,
              BLOCK_REFS=bool(S.INTRA_A_BLOCK_REFS) and (S.INTRA_FUSED_BLOCK_REFS == 2
                                                         or (S.INTRA_FUSED_BLOCK_REFS == 1 and args.gate > 0)),
              BC=BC, BKA=S.INTRA_FUSED_BKA, BK=S.INTRA_FUSED_BK, BV=S.INTRA_FUSED_BV,
              DOT_PREC=prec, MAX_SPLIT=MAX_SPLIT, FAST_EXP=bool(S.FAST_EXP),
              DIAG_INV_METHOD=S.INTRA_FUSED_DIAG_INV if args.dtype != "fp32" else 0,
              BF16_DOTS=S.WU_BF16_DOTS and args.dtype == "bf16", STORE_TM=keep, TM_ONLY=tm_only),
         S.INTRA_FUSED_TM_ONLY_WARPS if tm_only else S.INTRA_FUSED_WARPS,
         S.INTRA_FUSED_TM_ONLY_STAGES if tm_only else S.INTRA_FUSED_STAGES)
          for keep, tm_only in ((False, False), (True, False)) + (((False, True),) if args.dtype == "bf16" else ())],
        (intra_wu_fwd.kda_intra_wu_fwd_kernel,
         dict(**vl_chunk, k=x, v=x, beta=x, gam=f32, akk=f32, dinv=f32, w=op, u=res, tm=f32, steep="*i32", **ints),
         dict(common, **varlen, BC=BC, BK=S.INTRA_WU_BK or s["BK"], BV=S.INTRA_WU_BV or s["BV"], STORE_TM=False,
              DOT_PREC=prec, TM_ROW_LOADS=S.TM_ROW_LOADS, FAST_EXP=bool(S.FAST_EXP), DINV_IN=False, ONLY_STEEP=True,
              BF16_DOTS=S.WU_BF16_DOTS and args.dtype == "bf16"), 4, 3),
        (state_fwd.kda_state_fwd_kernel,
         dict(**vl_seq, kr=op, w=op, u=res, gam=f32, h0=f32, up=res, chunk_states=cs, ht=f32, **ints, slots="*i64"),
         dict(common, **varlen, BK=s["BK"], BV=s["BV_SCAN_FWD"], HAS_H0=True, DOT_PREC=prec,
              BF16_DOTS=S.SCAN_BF16_DOTS and args.dtype == "bf16", GLAST_AHEAD=bool(S.SCAN_GLAST_AHEAD)),
         S.SCAN_FWD_WARPS or S.SCAN_WARPS, s["SCAN_FWD_STAGES"]),
        (output_fwd.kda_output_fwd_kernel,
         dict(**vl_chunk, qg=op, aqk=aq, up=res, u=res, chunk_states=cs, o=x, **ints, slots="*i64"),
         dict(common, **varlen, BK=s["BK"], BV=S.BV_OUTPUT or s["BV"], DOT_PREC=prec,
              BF16_DOTS=S.OUTPUT_BF16_DOTS and args.dtype == "bf16"), S.OUTPUT_WARPS, 3),
        (state_bwd.kda_state_bwd_prep_kernel,
         dict(**vl_chunk, qg=op, w=op, u=res, aqk=aq, chunk_states=cs, do=x, up=res, dup=f32, dchunk_states=dsc, ds_offsets="*i64",
              **ints),
         dict(common, **varlen, BK=s["BK"], BV=s["BV"], HAS_UP=True, DOT_PREC=prec), 8, 3),
        (state_bwd.kda_state_bwd_kernel,
         dict(**vl_seq, kr=op, w=op, gam=f32, dht=f32, dup=f32, dchunk_states=dsc, dh0=f32, ds_offsets="*i64",
              **ints),
         dict(common, **varlen, BK=s["BK"], BV=s["BV_SCAN"], HAS_DHT=True, DOT_PREC=prec), S.SCAN_WARPS,
         s["SCAN_STAGES"]),
        # the fused backward scan (settings.SCAN_BWD_FUSED), its V block as --scan-bv says
        (state_bwd.kda_state_bwd_fused_kernel,
         dict(**vl_seq, qg=op, kr=op, w=op, aqk=aq, gam=f32, do=x, dht=f32, dup=dupt, dchunk_states=dsc, dh0=f32,
              ds_offsets="*i64", **ints),
         dict(common, **varlen, BK=s["BK"], BV=args.scan_bv or s["BV_SCAN_BWD"], HAS_DHT=True, DOT_PREC=prec,
              BF16_DOTS=scan_bwd_bf16,
              GLAST_AHEAD=bool(S.SCAN_BWD_GLAST_AHEAD),
              AQK_ROW_MASK=bool(S.SCAN_AQK_ROW_MASK) and fences_wgmma_after_cp_async()),
         scan_bwd_warps(args.scan_bv or s["BV_SCAN_BWD"], s["BK"]), s["SCAN_BWD_STAGES"]),
        (intra_bwd_w.kda_intra_bwd_w_kernel,
         dict(**vl_chunk, q=x, k=x, beta=x, gam=f32, tm=tmt, up=res, dup=dupt, chunk_states=cs, dchunk_states=dsc, do=x,
              dq=f32, dk=f32, dgam=f32, dgam_last=f32, dtm_part=f32, dbeta_part=f32, ds_offsets="*i64", scale="fp32",
              **ints),
         dict(common, **varlen, BKS=S.BKS_W, BV=S.INTRA_BWD_W_BV or s["BV"], DOT_PREC=prec, FAST_EXP=bool(S.FAST_EXP),
              BF16_DQG=bool(S.INTRA_BWD_W_BF16_DQG) and args.dtype == "bf16" and cs == "*bf16",
              BF16_DKR=bool(S.INTRA_BWD_W_BF16_DKR) and res == "*bf16" and dsc == "*bf16",
              BF16_DW=dupt == "*bf16" and cs == "*bf16",
              STATES_IN_REGISTERS=intra_bwd_w_stages(dtype) > 1 and not fences_wgmma_after_cp_async(),
              EARLY_QKG=bool(S.INTRA_BWD_W_EARLY_QKG) and args.dtype != "fp32"),
         S.INTRA_BWD_W_WARPS, intra_bwd_w_stages(dtype)),
        (intra_bwd.kda_intra_bwd_kernel,
         dict(**vl_chunk, v=x, beta=x, akk=f32, tm=tmt, up=res, dup=dupt, do=x, dtm_part=f32, dbeta_part=f32,
              dv=x, dbeta=x, dakk=f32, daqk=f32, **ints),
         dict(**varlen, V=V, BT=BT, BV=s["BV"], NS=triton.cdiv(K, S.BKS_W), DOT_PREC=prec,
              BF16_DAQK=(bool(S.INTRA_BWD_BF16_DAQK) and args.dtype == "bf16" and res == "*bf16"
                         and fences_wgmma_after_cp_async()),
              UP_IN_REGISTERS=not fences_wgmma_after_cp_async(), BF16_TDU=tmt == dupt == "*bf16"),
         S.INTRA_BWD_WARPS, S.INTRA_BWD_STAGES),
        (intra_bwd_a.kda_intra_bwd_a_kernel,
         dict(**vl_chunk, q=x, k=x, gam=f32, dakk=f32, daqk=f32, dgam_last=f32, steep="*i32", dq=f32, dk=f32, dgam=f32,
              dg=graw, **dq_dk_out, g=graw, **gate_sig, ddt_part=f32, dla_part=f32, scale="fp32", **ints,
              n_flags="i32"),
         dict(**varlen, K=K, BT=BT, BC=BC, BKD=S.BKD_A, STEEP=False, DOT_PREC=prec, MAX_SPLIT=MAX_SPLIT, **gate,
              DIRECT_OUT=bool(S.DIRECT_DQ_DK),
              STEEP_DOT_PREC=steep_prec, FAST_EXP=bool(S.FAST_EXP)), S.INTRA_BWD_A_WARPS, 3),
        (intra_bwd_a.kda_intra_bwd_a_kernel,
         dict(**vl_chunk, q=x, k=x, gam=f32, dakk=f32, daqk=f32, dgam_last=f32, steep="*i32", dq=f32, dk=f32, dgam=f32,
              dg=graw, **dq_dk_out, g=graw, **gate_sig, ddt_part=f32, dla_part=f32, scale="fp32", **ints,
              n_flags="i32"),
         dict(**varlen, K=K, BT=BT, BC=BC, BKD=S.BKD, STEEP=True, DOT_PREC=prec, MAX_SPLIT=MAX_SPLIT, **gate,
              DIRECT_OUT=bool(S.DIRECT_DQ_DK),
              BLOCK_REFS=bool(S.STEEP_BLOCK_REFS), STEEP_DOT_PREC=steep_prec,
              ROW_BLOCK_DOTS=bool(S.INTRA_BWD_A_ROW_BLOCK_DOTS)), 4, 3),
        # the backward through the A's by row blocks, then dg (settings.INTRA_BWD_A_ROW_PROGRAMS)
        (intra_bwd_a_rows.kda_intra_bwd_a_rows_kernel,
         dict(**vl_chunk, q=x, k=x, gam=f32, dakk=f32, daqk=f32, dq=f32, dk=f32, dgam=f32, **dq_dk_out, scale="fp32",
              **ints),
         dict(**varlen, K=K, BT=BT, BC=BC, BKD=S.INTRA_BWD_A_ROWS_BKD or S.BKD_A, DOT_PREC=prec,
              DIRECT_OUT=bool(S.DIRECT_DQ_DK), SUB_BLOCKS=bool(S.INTRA_BWD_A_ROWS_SUB_BLOCKS),
              FAST_EXP=bool(S.FAST_EXP) and bool(S.INTRA_BWD_A_ROWS_FAST_EXP)),
         S.INTRA_BWD_A_ROWS_WARPS, 3),
        (intra_bwd_a_rows.kda_dg_of_chunk_kernel,
         dict(**vl_chunk, dgam=f32, dgam_last=f32, dg=graw, g=graw, **gate_sig, ddt_part=f32, dla_part=f32, **ints),
         dict(**varlen, K=K, BT=BT, BKD=S.DG_OF_CHUNK_BK, **gate), S.DG_OF_CHUNK_WARPS, 3),
        (recurrent_fwd.kda_recurrent_fwd_kernel,
         dict(cu_seqlens="*i64", q=x, k=x, v=x, g=graw, beta=x, h0=f32, o=x, ht=f32, **gate_sig, scale="fp32", T="i32", H="i32",
              HV="i32", slots="*i64", accepted="*i64", slots_stride="i32"),
         dict(**varlen, K=K, V=V, BK=s["BK"], BV=S.RECURRENT_BV, HAS_H0=True, STREAM_HINTS=bool(S.RECURRENT_STREAM_HINTS),
              INPUT_HINTS=bool(S.RECURRENT_INPUT_HINTS), **gate),
         S.RECURRENT_WARPS, 3),
        (prep.kda_prep_fwd_kernel,
         dict(q=x, k=x, beta=x, q_out=x, k_out=x, beta_out=x, q_rstd=f32, k_rstd=f32, R="i32", eps="fp32",
              beta_scale="fp32"),
         dict(K=K, G=4, BK=s["BK"], BR=S.PREP_ROWS, BB=4 * S.PREP_ROWS, L2NORM=True, SIGMOID=True), S.PREP_WARPS, 3),
        (prep.kda_prep_bwd_kernel,
         dict(q_out=x, k_out=x, q_rstd=f32, k_rstd=f32, beta=x, dq_out=x, dk_out=x, dbeta_out=x, dq=x, dk=x,
              dbeta=x, R="i32", beta_scale="fp32"),
         dict(K=K, G=4, BK=s["BK"], BR=S.PREP_ROWS, BB=4 * S.PREP_ROWS, L2NORM=True, SIGMOID=True), S.PREP_WARPS, 3),
    ]
    if args.varlen:
        # the packed sequences' chunk index (_host._varlen_index), cu_seqlens int64 or int32
        for cu in ("*i64", "*i32"):
            runs.append((varlen_index.kda_varlen_index_kernel,
                         dict(cu_seqlens=cu, chunk_index="*i32", seq_offsets="*i64", first_unused="*i64",
                              dstate_offsets="*i64", N="i32", NCB="i32"),
                         dict(BT=BT, BS=_INDEX_SLOTS, BN=_INDEX_SEQS, HAS_H0=True), 4, 3))
    if args.varlen or S.INTRA_BWD_A_ONE_LAUNCH:
        # the backward through the A's in one launch (settings.INTRA_BWD_A_ONE_LAUNCH;
        # compiled with --varlen while it is off: its compile is the longest)
        steep_run = [r for r in runs if r[0] is intra_bwd_a.kda_intra_bwd_a_kernel and r[2]["STEEP"]][0]
        runs.append((steep_run[0], steep_run[1], dict(steep_run[2], STEEP=False, ONE_LAUNCH=True),
                     S.INTRA_BWD_A_WARPS, steep_run[4]))
    if S.FUSED_OUTPUT and args.dtype == "bf16" and s["BK"] <= 128:
        # the forward scan that writes the output (settings.FUSED_OUTPUT; bf16 operands, K <=
        # 128 only), at its V block's floor (FUSED_OUTPUT_MIN_BV) unless --scan-bv says: as a
        # forward that keeps its intermediates launches it, then as one that keeps nothing (no
        # grad, the pool's prefill)
        bv_fused = args.scan_bv or max(s["BV_SCAN_FWD"], S.FUSED_OUTPUT_MIN_BV)
        for kept in (True, False):
            runs.append((state_output_fwd.kda_state_output_fwd_kernel,
                         dict(**vl_seq, kr=op, w=op, u=res, gam=f32, qg=op, aqk=aq, h0=f32, up=res, chunk_states=cs,
                              ht=f32, o=x, **ints, slots="*i64"),
                         dict(common, **varlen, BK=s["BK"], BV=bv_fused, HAS_H0=kept, DOT_PREC=prec, STORE_HT=True,
                              STORE_STATES=kept, STORE_UP=kept, BF16_DOTS=bool(s["SCAN_BF16_DOTS"]),
                              OUTPUT_BF16_DOTS=bool(s["OUTPUT_BF16_DOTS"]),
                              GLAST_AHEAD=bool(S.FUSED_OUTPUT_GLAST_AHEAD)),
                         S.FUSED_OUTPUT_WARPS or S.SCAN_FWD_WARPS or S.SCAN_WARPS, S.FUSED_OUTPUT_STAGES))
        # ... and both again where its programs are one wave or fewer, as FUSED_OUTPUT_ONE_WAVE
        # launches them (settings.py; on since 2026-12-06)
        runs += [(fn, sig, const, S.FUSED_OUTPUT_ONE_WAVE_WARPS, S.FUSED_OUTPUT_ONE_WAVE_STAGES)
                 for fn, sig, const, _, _ in runs[-2:]]
    if args.gate == 2 and args.dtype == "bf16":
        # fla's bounded gate in a forward that keeps nothing (bf16): the row programs handing Kb
        # to intra_wu_fwd (settings.INTRA_A_ROWS_KBG), then also forming gam from the raw gate
        # (INTRA_A_ROWS_GAM_ON_CHIP); both off until timed, compiled here either way
        rows_run = [r for r in runs if r[0] is intra_a_fwd_rows.kda_intra_a_fwd_rows_kernel][0]
        runs.append((rows_run[0], dict(rows_run[1], beta=x, kbg=op), dict(rows_run[2], KBG=True), *rows_run[3:]))
        runs.append((rows_run[0], dict(rows_run[1], beta=x, kbg=op, g=graw, **gate_sig),
                     dict(rows_run[2], KBG=True, **gate, GAM_ON_CHIP=True), *rows_run[3:]))
    if S.INTRA_A_GAM_ON_CHIP and not args.gate and args.dtype == "bf16":
        # gam formed in intra_a_fwd and Kb handed to intra_wu_fwd (settings.INTRA_A_GAM_ON_CHIP,
        # bf16 inputs): as a forward that keeps nothing launches them
        a_run = [r for r in runs if r[0] is intra_a_fwd.kda_intra_a_fwd_kernel][0]
        runs.append((a_run[0], dict(a_run[1], beta=x, kbg=op),
                     dict(a_run[2], GAM_IN=False, STORE_GAM=False, KBG=True),
                     *a_run[3:]))
        wu_run = [r for r in runs if r[0] is intra_wu_fwd.kda_intra_wu_fwd_kernel and not r[2]["STORE_TM"]][0]
        runs.append((wu_run[0], dict(wu_run[1], kbg=op), dict(wu_run[2], KBG_IN=True), *wu_run[3:]))
        if S.FUSED_OUTPUT and s["BK"] <= 128:
            # the scan that writes the output forming U' from Tm (settings.FUSED_OUTPUT_SOLVE_U,
            # compiled whether on or off): intra_wu_fwd forming Tm alone (bf16), the scan in a
            # forward that keeps nothing, at both launches
            runs.append((wu_run[0], dict(wu_run[1], kbg=op, tm="*bf16"), dict(wu_run[2], KBG_IN=True, TM_ONLY=True),
                         *wu_run[3:]))
            fused = [r for r in runs if r[0] is state_output_fwd.kda_state_output_fwd_kernel and not r[2]["HAS_H0"]]
            runs += [(fn, dict(sig, beta=x, tm="*bf16"), dict(const, SOLVE_U=True, HAS_H0=h0), warps, stages)
                     for fn, sig, const, warps, stages in fused for h0 in (False, True)]
    if S.STEEP_WORK_LIST:
        # the steep launches as work lists (settings.STEEP_WORK_LIST)
        for fn in (intra_a_fwd.kda_intra_a_fwd_steep_kernel, intra_bwd_a.kda_intra_bwd_a_kernel):
            run = [r for r in runs if r[0] is fn and r[2].get("STEEP", True)][0]
            runs.append((run[0], run[1], dict(run[2], WORK_LIST=True, WL_BLOCK=S.WORK_LIST_BLOCK), run[3], run[4]))
    if args.varlen:
        # short packed sequences' [SHORT_TILE, SHORT_TILE] tiles: in a launch of their own
        # (settings.SHORT_TILE_LAUNCHES 2), or picked per program in the one launch (1)
        tile = S.SHORT_TILE or 32
        # (the forms that read gam: gam on chip and Kb handed on take no short-sequence tiles,
        # fwd._gam_on_chip_serves)
        intra = [r for r in runs if r[0] in (intra_a_fwd.kda_intra_a_fwd_kernel, intra_wu_fwd.kda_intra_wu_fwd_kernel)
                 and r[2].get("GAM_IN", True) and not r[2].get("KBG_IN")]
        runs += [(fn, sig, dict(const, **tiling), warps, stages) for fn, sig, const, warps, stages in intra
                 for tiling in (dict(TILE=tile), dict(PICK_TILE=tile))]
        # packed sequences without initial states, as training launches the scan and the
        # output (compact chunk states, no final state), and as a forward that keeps
        # nothing (settings.SKIP_UNREAD: the first chunks' U' read from U; Qg and W
        # of first chunks, Kr of last ones left out)
        scan = [r for r in runs if r[0] is state_fwd.kda_state_fwd_kernel][0]
        output = [r for r in runs if r[0] is output_fwd.kda_output_fwd_kernel][0]
        for first_up, skip in ((True, False), (True, True), (False, True)):
            runs.append((scan[0], scan[1], dict(scan[2], HAS_H0=False, COMPACT_STATES=True, STORE_HT=False,
                                                FIRST_UP=first_up, SKIP_UNKEPT_STATE=skip), *scan[3:]))
            if skip:
                runs.append((output[0], output[1], dict(output[2], HAS_H0=False, FIRST_FROM_U=not first_up),
                             *output[3:]))
        for fn, sig, const, warps, stages in intra:
            skips = dict(QG_FIRST=False, KR_LAST=False) if fn is intra_a_fwd.kda_intra_a_fwd_kernel else dict(W_FIRST=False)
            if fn is intra_a_fwd.kda_intra_a_fwd_kernel or not const["STORE_TM"]:  # (the forward that keeps nothing)
                runs.append((fn, sig, dict(const, PICK_TILE=tile, **skips), warps, stages))
    print(f"{args.dtype} inputs, K = V = {K}, sm_90a" + (f", {' '.join(args.set)}" if args.set else ""))
    over, unfenced = [], []
    for fn, sig, const, warps, stages in runs:
        if args.only is None or args.only in fn.__name__:
            if args.sass:
                print(sass_summary(fn, sig, const, warps, stages), flush=True)
                continue
            line, shared, ttgir = resources(fn, sig, const, warps, stages)
            print(line, flush=True)
            if args.max_shared is not None and shared > args.max_shared:
                over.append(f"{fn.__name__}: {shared} B")
            if args.check_fences:
                lines = unfenced_wgmmas(ttgir)
                if lines:
                    unfenced.append(f"{fn.__name__} (TTGIR lines {lines})")
    if over:
        print(f"over {args.max_shared} B of shared memory: {over}", flush=True)
    if unfenced:
        print(f"wgmmas reading cp.async tiles without a proxy fence: {unfenced}", flush=True)
    return 1 if over or unfenced else 0


if __name__ == "__main__":
    sys.exit(main())
