"""Host side of the Triton kernels: allocation, block sizes and launches.

``kda_fwd_triton`` / ``kda_bwd_triton`` take and return what the ops
``kda_op::chunk_kda_fwd`` / ``chunk_kda_bwd`` do. They run on CUDA tensors, and on
CPU tensors under ``TRITON_INTERPRET=1`` (how CPU CI tests the kernels).
No host synchronisation, so they can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Optional

import torch
import triton
from torch import Tensor
from torch.profiler import record_function

from .._contract import CHUNK_SIZE, aqk_dtype, chunk_states_dtype, intermediates_layout, residual_dtype, scan_operand_dtype
from .gam_fwd import kda_gam_fwd_kernel
from .gva_reduce import kda_gva_reduce_kernel
from .intra_bwd import kda_intra_bwd_kernel
from .intra_a_fwd import kda_intra_a_fwd_kernel, kda_intra_a_fwd_steep_kernel
from .intra_bwd_a import kda_intra_bwd_a_kernel
from .intra_bwd_w import kda_intra_bwd_w_kernel
from .intra_wu_fwd import kda_intra_wu_fwd_kernel
from .output_fwd import kda_output_fwd_kernel
from .recurrent_fwd import kda_recurrent_fwd_kernel
from .state_bwd import kda_state_bwd_kernel, kda_state_bwd_prep_kernel
from .state_fwd import kda_state_fwd_kernel

BT = CHUNK_SIZE  # chunk length of the kernels = the chunk length of the saved states
BC = 16  # sub-block length inside a chunk, on its steep path (intra_a_fwd.py)
# A chunk is split at its middle row when exp(+-(gam_i - gam_mid)) stays within
# exp(60) (fp32 overflows past exp(88)); steeper chunks take the sub-block path.
MAX_SPLIT = 60.0
# Warps per program of the intra-chunk kernels. These and the other upper-case
# settings here are module-level so that benchmarks/bench_kernels.py can time
# (and check) other values. Four warps where the H200 measured them faster than
# eight (bench_kernels.py, B1-T8192-H16 bf16, 2026-11-30, ms per call, 8 -> 4):
# intra_a_fwd 0.65 -> 0.41, intra_wu_fwd 1.11 -> 0.72, intra_bwd_w 0.87 -> 0.59,
# intra_bwd 0.27 -> 0.26; intra_bwd_a 0.44 at 4, 0.46 at 8.
INTRA_A_FWD_WARPS = 4
INTRA_WU_FWD_WARPS = 4
# ... and two for bf16 inputs with K <= 128: intra_wu_fwd 0.36 -> 0.23 ms, forward
# 1.12 -> 0.99 ms (same H200 run, B1-T8192-H16; max rel diff of o, final state and
# grads to four warps 3e-5). Not at fp32 or K = 256, where two warps spill
# kilobytes (benchmarks/kernel_resources.py).
INTRA_WU_FWD_WARPS_BF16 = 2
INTRA_BWD_W_WARPS = 4
INTRA_BWD_WARPS = 4
INTRA_BWD_A_WARPS = 4
# How intra_wu_fwd.py gets row i of the diagonal blocks in each of the 15 steps of
# its forward substitution: 0 cut out of the blocks in registers (a cross-warp
# reduction), 1 loaded again from A_kk. On the H200 (bf16, B1-T8192-H16, two
# warps): intra_wu_fwd 0.229 -> 0.190 ms, forward 0.999 -> 0.958 ms, outputs
# bitwise the same (bench_kernels.py, 2026-11-30).
TM_ROW_LOADS = 1
# intra_wu_fwd's V block for U = Tm diag(beta) V (None: the common BV, 64 at K <=
# 128). On the H200 (bf16, bench_kernels.py, 2026-11-30, seventh session)
# intra_wu_fwd 0.625 -> 0.601 ms at B2-T8192-H8-HV32 and 0.182 -> 0.171 at
# B1-T8192-H16 at 32; 16 the same within noise (0.607 / 0.170).
INTRA_WU_BV = 32
# intra_a_fwd (the A's, Qg, Kr): K slices of BKA (bounded shared memory at any
# K); a cap on its registers per thread (None: the compiler's choice, 255 at every
# BKA; 168 lets three CTAs share an SM). On the H200 (bf16, bench_kernels.py,
# 2026-11-30) the kernel in one pass over K at BKA = 16 with the cap of 168 beat
# the former two passes at BKA = 64: intra_a_fwd 0.204 -> 0.197 ms at
# B1-T8192-H16, forward 2.416 -> 2.365 ms at B2-T8192-H8-HV32; the A's changed by
# 4e-4 (relative; the K slices' order of summation). Two passes at BKA = 32 or 16
# were slower (0.238, 0.252 ms), as was the cap of 128 (0.217). The two-pass form
# is gone (commit history). With gam from its own launch (INTRA_GAM_KERNEL) the
# K slices carry less: BKA = 32 took intra_a_fwd 0.424 -> 0.385 ms at B2 and
# 0.126 -> 0.114 at B1, forward 1.723 -> 1.688 and 0.590 -> 0.580 ms (H200,
# bench_kernels.py, 2026-11-30, seventh session).
BKA = 32
INTRA_A_FWD_MAXNREG = 168
# intra_a_fwd's test for a steep chunk: the spread of gam around the middle row
# kept elementwise over the K slices and reduced across warps once (1), instead
# of once per slice (0); the same result (bitwise, tests). On the H200
# (2026-11-30, same process): forward 1.898 -> 1.870 ms at B2-T8192-H8-HV32, 0.636
# -> 0.627 at B1-T8192-H16. Tried the same day and dropped: two programs per chunk
# with one A each (intra_a_fwd 0.714 -> 1.27 ms at B2), two pipeline stages
# (0.714 -> 0.776), eight warps (0.195 -> 0.232 at B1).
INTRA_A_SPREAD_TILE = 1
# gam = cumsum(g) in a launch of its own (gam_fwd.py, K blocks of BKG, GAM_WARPS
# warps) before intra_a_fwd, which then reads gam and its middle and last rows
# (1), instead of forming them per K slice with a cross-warp scan and two
# cross-warp reductions (0), the work that set intra_a_fwd's time (two programs
# per chunk, each with that work, took twice as long). Costs one more read of g.
# On the H200 (bf16, bench_kernels.py, 2026-11-30, seventh session, at BKA =
# 16): intra_a_fwd 0.679 -> 0.424 ms plus gam_fwd 0.132 at B2-T8192-H8-HV32,
# forward 1.846 -> 1.726 ms; B1-T8192-H16 0.623 -> 0.599. BKG = 32 (gam_fwd
# 0.149 ms at B2), 128 (0.133) and four warps (0.131) no better than 64. o
# differs from 0's by up to 5e-4 (relative; the GPU's scans associate
# differently; bitwise the same under the interpreter). Tried the same day and
# dropped: without a kernel of its own, gam formed again in intra_wu_fwd from g
# when nothing is kept (forward 1.846 -> 2.054 ms).
INTRA_GAM_KERNEL = 1
BKG = 64
GAM_WARPS = 2
# K slices of the backward through the states and W (intra_bwd_w.py) and of the
# forward's steep path (intra_a_fwd.py)
BKS = 32
# K slices of the backward through the A's, one program each: BKD_A on the
# common path, BKD on the steep one (whose exact diagonal holds [BC, BC, BKD]).
BKD_A = 32
BKD = 16
# The scans: one program per (V block of BV_SCAN, batch * value head), sequential
# over chunks. SCAN_WARPS spread the [BK, BV_SCAN] fp32 state; they prefetch the
# next chunk (two stages) where BK <= 128, which fits the H200's 227 KB of shared
# memory at fp32 (the backward scan: 156 KB at BK = 128, 270 KB at 256 by compiling).
BV_SCAN = 16  # 32 -> 16 on the H200: forward scan 0.39 -> 0.35 ms, backward scan even (B1-T8192-H16, bf16)
# ... but only where W and Kr are bf16 (bf16 inputs). With fp32 W and Kr (fp32 and
# fp16 inputs) the first forward at BV_SCAN = 16 hit an illegal memory access on
# the H200 (2026-11-30; every fp32 and fp16 CUDA test, while bf16 passed; no
# device time was left to confirm the cause in isolation). At 32 every CUDA test
# had passed earlier that day, and a V block of 16 is the one earlier seen to
# give a wrong dk under fp32 (see _sizes).
BV_SCAN_FP32_OPERANDS = 32
# ... the smallest of those, doubled up to BV_SCAN_MAX, that keeps the scan's
# programs within one wave (one per SM): a scan program is a serial chain, so a
# second wave doubles the scan's time. At B2-T8192-H8-HV32 (64 heads) a V block of
# 16 made 512 programs, four waves on the H200's 132 SMs: forward 3.6 ms where
# fla took 1.76 (2026-11-30). SCAN_SMS: None counts the device's SMs; under the
# interpreter (CPU CI), the H200's 132.
BV_SCAN_MAX = 64
SCAN_SMS = None
SCAN_WARPS = 8
SCAN_STAGES = 2  # where BK <= 128; one stage above
# The forward scan alone (None: as above): its warps, stages (bf16 operands and
# BK <= 128 only; see _sizes) and V block (before the doubling to one wave); and
# how many of its programs one SM runs at once, for the V block's choice (a wave =
# SMs x SCAN_FWD_PER_SM). On the H200 (bf16 dots, 2026-11-30): three stages
# 0.282 -> 0.208 ms at B1-T8192-H16 (fla's scan: 0.199) and 0.472 -> 0.426 at
# B2-T8192-H8-HV32 (fla's: 0.298); forward at B2 with four warps 2.119 ms against
# 2.127 (noise), with four warps and two programs per SM (V block 32) 2.246.
SCAN_FWD_WARPS = None
SCAN_FWD_STAGES = 3
BV_SCAN_FWD = None
SCAN_FWD_PER_SM = 1
# bf16 inputs: the forward scan's (SCAN_) and the output's (OUTPUT_) dots take bf16
# operands, the state and U' rounded to bf16 as they enter them (fp32
# accumulation, fp32 state throughout), as fla's forward does; 0 keeps TF32 dots.
# On the H200 (B1-T8192-H16, 2026-11-30, bench_kernels.py): the output kernel
# 0.199 -> 0.091 ms with o within 3.3e-3 (relative) of the TF32 one, the level of
# its own bf16 rounding (o's relative difference to fla stays 4.0e-3): on. The
# scan 0.357 -> 0.282 ms (0.208 with three stages; B2: 0.664 -> 0.426), the fp32
# final state's relative difference to fla's 2.5e-3 -> 3.1e-3 (B2 2.4e-3 ->
# 2.9e-3) and to the fp64 reference on the same bf16-rounded inputs 0.9e-3 ->
# 2.0e-3 (interpreter with the GPU's round-to-nearest, _dot.py, T = 512, K = V =
# 64; o unchanged at 2.9e-3): below bf16's own rounding (3.9e-3), as in fla, whose
# scan rounds the same operands: on (since 2026-11-30; 0 restores TF32 dots).
SCAN_BF16_DOTS = 1
OUTPUT_BF16_DOTS = 1
# The same for intra_wu_fwd's W = Tm (...) and U = Tm (...) (W is stored in bf16
# anyway): on the H200 (2026-11-30) forward 2.416 -> 2.371 ms at B2 for a 3.3e-3
# change of the grads: off. (bf16 dots in the backward scan, tried the same day,
# hit an illegal memory access on the H200 and were removed.)
WU_BF16_DOTS = 0
# The output kernel's V block (None: the common BV) and warps per program: 8 -> 4
# warps 0.199 -> 0.130 ms (same run; 0.091 -> 0.074 with bf16 dots). A V block of
# 128 (one program per chunk) was slower: 0.206.
BV_OUTPUT = None
OUTPUT_WARPS = 4
# Rows (of K) per program of the GVA reduction of dq and dk (gva_reduce.py)
GVA_ROWS = 32
# Sequences up to this length (decode steps and short prompts through chunk_kda)
# run token by token in one launch, the state on chip (recurrent_fwd.py), instead
# of the six launches of the chunked forward; their one chunk's boundaries are the
# initial and the final state.
RECURRENT_MAX_T = 16
# The recurrent kernel's V block (at most; at least 16) and warps per program:
# 90% of the copy ceiling at B = 256 and 83% at B = 64 (HV = 32, K = V = 128) on
# the H200 with these; benchmarks/bench_decode.py --settings times others. Timed
# and slower (graph replay at B = 64, 2026-11-30): BV 64 (80.9 us vs 75.7), BV 16
# (88.2 vs 75.8), eight warps (81.4), two warps (78.9), BV 16 with two (76.6).
RECURRENT_BV = 32
RECURRENT_WARPS = 4
# A cap on its registers per thread (None: the compiler's 150, i.e. three CTAs of
# four warps per SM). 128 (28 B of spills) lets four share an SM; timed on the H200
# (2026-11-30): B = 64 graph replay 76.2 -> 81.2 us, slower.
RECURRENT_MAXNREG = None
# Cache hints on the recurrent kernel's state traffic (recurrent_fwd.py): timed
# slower (81.2 vs 75.7 us at B = 64, 2026-11-30).
RECURRENT_STREAM_HINTS = 0
# Cache hints on its inputs and output (recurrent_fwd.py): q, k, g evict-last (the
# other V blocks' programs read them again), v and o evict-first, as fla's decode
# kernel sets them (fla 0.6.0, fused_recurrent.py). On the H200 (bench_decode.py,
# CUDA graph replay, 2026-11-30, seventh session): B = 64 76.1 -> 72.7 us (fla
# 74.2-74.4), B = 256 278.4 -> 269.7 us; the same bits. With them, two warps
# (73.4), BV 64 (74.9) and BV 16 (82.7) were slower at B = 64.
RECURRENT_INPUT_HINTS = 1


# Under Triton's interpreter (CPU CI) bf16 dots are emulated (_dot.py).
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: 3xTF32 keeps products at about fp32 accuracy on the tensor
    # cores. bf16/fp16 inputs: plain TF32 (10-bit mantissa) is already finer than
    # the inputs and outputs.
    return "tf32x3" if dtype == torch.float32 else "tf32"


# The steep-path kernels (kda_intra_a_fwd_steep_kernel, kda_intra_bwd_a_kernel with
# STEEP) on fp32 inputs use IEEE fp32 dots. Measured on the H200 (triton 3.6,
# strong-decay inputs of tests/test_cuda.py, every chunk forced steep): 3xTF32
# gave exactly the errors of plain TF32 there (o 3.8e-2 relative to the fp64
# reference, A_kk 1.3), IEEE 3.6e-7; the interpreter 3e-7. Steep chunks are rare,
# so the slower FMA dots cost little. bf16/fp16 inputs keep TF32 (errors 2e-3,
# the level of bf16 outputs).
STEEP_DOT_PREC_FP32 = "ieee"


def _steep_dot_precision(dtype: torch.dtype) -> str:
    return STEEP_DOT_PREC_FP32 if dtype == torch.float32 else _dot_precision(dtype)


def _check_offsets(T: int, HV: int, K: int, V: int) -> None:
    """The kernels index inside one sequence with 32-bit offsets (up to
    T_padded * HV * max(K, V, BT)); across sequences and chunk states with 64-bit
    ones. Refuse, rather than wrap around, past that. Written as a bound on T
    alone, so that under torch.export (the export op) it is a plain range of the
    sequence length."""
    max_t = (2**31 - 1) // (BT * HV * max(K, V, BT)) * BT
    if not T <= max_t:
        raise ValueError(
            f"one sequence is too long for the CUDA kernels: T = {T} > {max_t} at HV={HV}, K={K}, V={V} "
            f"(T * HV * max(K, V, {BT}) must stay below 2^31); split the sequence, carrying the state"
        )


# CUDA grids allow at most 65535 programs along their second and third axes, where
# the kernels put B * HV (and, in the backward's K-sliced kernels, the chunks).
MAX_GRID_YZ = 65535


def _check_grid(B: int, HV: int, T: Optional[int]) -> None:
    """Refuse, with what to do, a launch whose grid the GPU would reject (T: None
    for the recurrent kernel, whose grid does not count chunks). Bounds on B and T
    alone, as in _check_offsets."""
    if not B <= MAX_GRID_YZ // HV:
        raise ValueError(
            f"B * HV = {B} * {HV} exceeds {MAX_GRID_YZ}, the CUDA kernels' limit on "
            f"sequences times value heads per call; split the batch"
        )
    if T is not None and not T <= MAX_GRID_YZ * BT:
        raise ValueError(
            f"T = {T} is more than {MAX_GRID_YZ} chunks of {BT}; split the sequence, carrying the state"
        )


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    # The interpreter (CPU tensors), or fake CUDA tensors traced on a machine
    # without CUDA: the H200's, so that CPU CI takes the H200's choices.
    return 132


def _scan_block_v(B: int, HV: int, V: int, device: torch.device, bv_min: int, per_sm: int = 1) -> int:
    """The scans' V block: from ``bv_min``, doubled while the programs
    (B * HV * V blocks) overflow one wave (``per_sm`` programs on each SM) and a
    bigger block still splits V."""
    wave = (SCAN_SMS or _sm_count(device)) * per_sm
    bv = bv_min
    while bv < min(BV_SCAN_MAX, triton.next_power_of_2(V)) and B * HV * triton.cdiv(V, bv) > wave:
        bv *= 2
    return bv


def _kernel(fn, traced: bool):
    """``fn``, or for host code that torch.export and inductor trace into (the
    export op), ``fn`` wrapped so the launch is captured as a graph node. Outside
    tracing the wrapped kernel launches as it is."""
    if traced:
        from torch.library import wrap_triton

        return wrap_triton(fn)
    return fn


def _sizes(q: Tensor, v: Tensor, scan_batch: Optional[int] = None) -> dict:
    """Sizes and block shapes of one call. ``scan_batch`` stands in for B when the
    scans' V block is chosen (the export op: no branch on a batch size that stays
    symbolic)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    _check_offsets(T, HV, K, V)
    _check_grid(B, HV, T)
    # Blocks of at least 32: a wrong dk was seen on the H200 with K = 32, V = 16
    # (BV = 16) that the interpreter computed right; cause not established.
    BK = max(32, triton.next_power_of_2(K))
    bf16_operands = scan_operand_dtype(q.dtype) == torch.bfloat16  # the *_BF16_DOTS options apply
    scan_b = B if scan_batch is None else scan_batch
    bv_scan_min = BV_SCAN if bf16_operands else BV_SCAN_FP32_OPERANDS
    return dict(
        B=B, T=T, H=H, K=K, HV=HV, V=V,
        NC=triton.cdiv(T, BT),
        BK=BK,
        BV=min(64 if BK <= 128 else 32, max(32, triton.next_power_of_2(V))),
        BV_SCAN=_scan_block_v(scan_b, HV, V, q.device, bv_scan_min),
        BV_SCAN_FWD=_scan_block_v(scan_b, HV, V, q.device, max(BV_SCAN_FWD or 0, bv_scan_min), SCAN_FWD_PER_SM),
        SCAN_STAGES=SCAN_STAGES if BK <= 128 else 1,
        # three stages of fp32 W and Kr (fp32 and fp16 inputs) need 240 KB of shared
        # memory at BK = 128, BV = 32: more than the H200's 227
        SCAN_FWD_STAGES=((SCAN_FWD_STAGES or SCAN_STAGES) if bf16_operands else SCAN_STAGES) if BK <= 128 else 1,
        SCAN_BF16_DOTS=bf16_operands and bool(SCAN_BF16_DOTS),
        OUTPUT_BF16_DOTS=bf16_operands and bool(OUTPUT_BF16_DOTS),
        WU_BF16_DOTS=bf16_operands and bool(WU_BF16_DOTS),
    )


def _intra_fwd(q, k, v, g, beta, scale, s, store_tm: bool, out: Optional[dict] = None, traced: bool = False):
    """Stage 1 of the forward (and of the backward's recompute): gam, the A's, Tm
    (when ``store_tm``), W, U, Qg, Kr and the steep flags, into the tensors of
    ``out`` where given (views of the kept intermediates), else fresh ones."""
    B, T, HV, K, V, NC = s["B"], s["T"], s["HV"], s["K"], s["V"], s["NC"]
    f32 = dict(device=q.device, dtype=torch.float32)
    prec = _dot_precision(q.dtype)
    if out is None:
        operand = dict(device=q.device, dtype=scan_operand_dtype(q.dtype))
        out = dict(
            gam=torch.empty(B, NC * BT, HV, K, **f32),
            akk=torch.empty(B, T, HV, BT, **f32),
            aqk=torch.empty(B, T, HV, BT, device=q.device, dtype=aqk_dtype(q.dtype)),
            # Traced: flat with one spare entry, so that no dimension of it is NC,
            # whose contiguity check would guard NC != 1 (i.e. T > 64).
            steep=(torch.empty(B * NC * HV + 1, device=q.device, dtype=torch.int32) if traced
                   else torch.empty(B, NC, HV, device=q.device, dtype=torch.int32)),
            qg=torch.empty(B, T, HV, K, **operand),
            kr=torch.empty(B, T, HV, K, **operand),
            w=torch.empty(B, T, HV, K, **operand),
            u=torch.empty(B, T, HV, V, device=q.device, dtype=residual_dtype(q.dtype)),
            tm=torch.empty(B, T, HV, BT, **f32) if store_tm else None,
        )
    gam, akk, aqk, steep, qg, kr, w, u = (out[n] for n in ("gam", "akk", "aqk", "steep", "qg", "kr", "w", "u"))
    tm = out["tm"] if store_tm else akk.new_empty(0)  # not written without STORE_TM
    common = dict(H=s["H"], HV=HV, K=K, BT=BT, DOT_PREC=prec, MAX_SPLIT=MAX_SPLIT)
    regs = dict(maxnreg=INTRA_A_FWD_MAXNREG) if INTRA_A_FWD_MAXNREG else {}
    gam_kernel = bool(INTRA_GAM_KERNEL)
    if gam_kernel:
        _kernel(kda_gam_fwd_kernel, traced)[(NC, B * HV, triton.cdiv(K, BKG))](
            g, gam, T, NC, H=s["H"], HV=HV, K=K, BT=BT, BKG=BKG, num_warps=GAM_WARPS,
        )
    _kernel(kda_intra_a_fwd_kernel, traced)[(NC, B * HV)](
        q, k, g, gam, akk, aqk, steep, qg, kr, scale, T, NC, **common, BKA=BKA, SPREAD_TILE=bool(INTRA_A_SPREAD_TILE),
        GAM_IN=gam_kernel, INTERPRET=_INTERPRET, num_warps=INTRA_A_FWD_WARPS, **regs,
    )
    _kernel(kda_intra_a_fwd_steep_kernel, traced)[(NC, B * HV)](
        q, k, gam, akk, aqk, steep, scale, T, NC, **(common | dict(DOT_PREC=_steep_dot_precision(q.dtype))),
        BC=BC, BKS=BKS, INTERPRET=_INTERPRET, num_warps=4,
    )
    _kernel(kda_intra_wu_fwd_kernel, traced)[(NC, B * HV)](
        k, v, beta, gam, akk, w, u, tm, T, NC,
        H=s["H"], HV=HV, K=K, V=V, BT=BT, BC=BC, BK=s["BK"], BV=INTRA_WU_BV or s["BV"],
        STORE_TM=store_tm, DOT_PREC=prec, TM_ROW_LOADS=TM_ROW_LOADS,
        BF16_DOTS=s["WU_BF16_DOTS"], INTERPRET=_INTERPRET,
        num_warps=INTRA_WU_FWD_WARPS_BF16 if q.dtype == torch.bfloat16 and s["BK"] <= 128 else INTRA_WU_FWD_WARPS,
    )
    return dict(gam=gam, akk=akk, aqk=aqk, w=w, u=u, tm=(tm if store_tm else None), steep=steep, qg=qg, kr=kr)


# The layout these kernels keep: that of the CUDA device, also when the Triton
# interpreter runs them on CPU tensors (tests).
_SERVES = "cuda"


def _layout(q: Tensor, v: Tensor) -> tuple[list, int]:
    """``kda_op._contract.intermediates_layout`` for these inputs."""
    B, T, _, K = q.shape
    return intermediates_layout(B, T, v.shape[2], K, v.shape[3], q.dtype, _SERVES)


def _intermediates_views(buffer: Tensor, layout: list) -> dict:
    """The named tensors inside the flat uint8 buffer of kept intermediates."""
    views = {}
    for name, shape, dtype, offset in layout:
        nbytes = math.prod(shape) * dtype.itemsize
        views[name] = buffer[offset:offset + nbytes].view(dtype).view(shape)
    return views


def _zero_alignment_gaps(buffer: Tensor, layout: list, total: int) -> None:
    """Zero the bytes between (and after) the pieces of the kept-intermediates
    buffer, which no kernel writes: the buffer is an op output, so every byte must
    follow from the inputs (opcheck compares eager and traced runs bitwise). At
    most one small fill per piece, none where sizes are multiples of 256 bytes."""
    starts = [offset for *_, offset in layout[1:]] + [total]
    for (_, shape, dtype, offset), next_start in zip(layout, starts):
        end = offset + math.prod(shape) * dtype.itemsize
        if end < next_start:
            buffer[end:next_start].zero_()


def kda_fwd_triton(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    scale: Optional[float], initial_state: Optional[Tensor],
    keep_intermediates: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Chunked forward: ``(o, final_state, chunk_states, intermediates)`` as
    ``chunk_kda_fwd``. ``intermediates`` is the flat uint8 buffer of
    ``kda_op._contract.intermediates_layout`` when ``keep_intermediates``, else
    empty; with it the backward skips recomputing the intra-chunk stage."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    s = _sizes(q, v)
    B, T, HV, K, V, NC = s["B"], s["T"], s["HV"], s["K"], s["V"], s["NC"]
    scale = K**-0.5 if scale is None else float(scale)
    f32 = dict(device=q.device, dtype=torch.float32)
    h0 = None if initial_state is None else initial_state.contiguous()

    layout, nbytes = _layout(q, v) if keep_intermediates else ([], 0)
    intermediates = torch.empty(nbytes, device=q.device, dtype=torch.uint8)
    if keep_intermediates:
        _zero_alignment_gaps(intermediates, layout, nbytes)
    chunk_states = torch.empty(B, NC + 1, HV, K, V, device=q.device, dtype=chunk_states_dtype(q.dtype, _SERVES))
    # Short sequences: one token-by-token launch, unless the backward wants the
    # chunked intermediates.
    if 0 < T <= RECURRENT_MAX_T and not keep_intermediates:
        with record_function("kda_op::fwd::recurrent"):
            o, ht = kda_recurrent_fwd_triton(q, k, v, g, beta, scale, h0)
        if h0 is None:
            chunk_states[:, 0].zero_()
        else:
            chunk_states[:, 0].copy_(h0)
        chunk_states[:, 1].copy_(ht)
        return o, ht, chunk_states, intermediates
    ht = torch.empty(B, HV, K, V, **f32)
    o = torch.empty(B, T, HV, V, device=q.device, dtype=v.dtype)
    if B * HV == 0:
        return o, ht, chunk_states, intermediates
    prec = _dot_precision(q.dtype)
    if NC > 0:
        with record_function("kda_op::fwd::intra"):
            kept = _intermediates_views(intermediates, layout) if keep_intermediates else None
            x = _intra_fwd(q, k, v, g, beta, scale, s, store_tm=keep_intermediates, out=kept)
    else:  # T == 0: the scan only copies the initial state through
        x = {name: torch.empty(0, **f32) for name in ("gam", "aqk", "w", "u", "qg", "kr")}
    up = kept["up"] if keep_intermediates and NC > 0 else torch.empty(B, T, HV, V, device=q.device,
                                                                        dtype=residual_dtype(q.dtype))
    with record_function("kda_op::fwd::state_scan"):
        _state_scan_fwd(x, h0, up, chunk_states, ht, s, prec, traced=False)
    if NC > 0:
        with record_function("kda_op::fwd::output"):
            _output_fwd(x, up, chunk_states, o, s, prec, traced=False)
    return o, ht, chunk_states, intermediates


def _state_scan_fwd(x: dict, h0: Optional[Tensor], up: Tensor, chunk_states: Tensor, ht: Tensor,
                    s: dict, prec: str, traced: bool) -> None:
    """Stage 2: the scan over chunks (state_fwd.py) into up, chunk_states and ht."""
    B, T, HV, K, V, NC = s["B"], s["T"], s["HV"], s["K"], s["V"], s["NC"]
    _kernel(kda_state_fwd_kernel, traced)[(triton.cdiv(V, s["BV_SCAN_FWD"]), B * HV)](
        x["kr"], x["w"], x["u"], x["gam"], h0 if h0 is not None else ht, up, chunk_states, ht, T, NC,
        H=s["H"], HV=HV, K=K, V=V, BT=BT, BK=s["BK"], BV=s["BV_SCAN_FWD"],
        HAS_H0=h0 is not None, DOT_PREC=prec, BF16_DOTS=s["SCAN_BF16_DOTS"], INTERPRET=_INTERPRET,
        num_warps=SCAN_FWD_WARPS or SCAN_WARPS, num_stages=s["SCAN_FWD_STAGES"],
    )


def _output_fwd(x: dict, up: Tensor, chunk_states: Tensor, o: Tensor, s: dict, prec: str, traced: bool) -> None:
    """Stage 3: the output (output_fwd.py) into o."""
    B, T, HV, K, V, NC = s["B"], s["T"], s["HV"], s["K"], s["V"], s["NC"]
    bv_out = BV_OUTPUT or s["BV"]
    _kernel(kda_output_fwd_kernel, traced)[(triton.cdiv(V, bv_out), NC, B * HV)](
        x["qg"], x["aqk"], up, chunk_states, o, T, NC,
        H=s["H"], HV=HV, K=K, V=V, BT=BT, BK=s["BK"], BV=bv_out,
        DOT_PREC=prec, BF16_DOTS=s["OUTPUT_BF16_DOTS"], INTERPRET=_INTERPRET, num_warps=OUTPUT_WARPS,
    )


def kda_fwd_triton_export(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    scale: Optional[float], initial_state: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor]:
    """The chunked forward as host code that torch.export and inductor can trace
    (the body of ``kda_op::chunk_kda_fwd_export``): ``(o, final_state,
    chunk_states)``. Every launch goes through ``wrap_triton`` and nothing branches
    on a size that may stay symbolic: always the chunked kernels (no recurrent
    routing of short sequences), the scans' V block chosen for one sequence, no
    profiler ranges, nothing kept for the backward. Needs T >= 1 and B * HV >= 1.
    The same kernels with the same settings as ``kda_fwd_triton`` (up to the scans'
    V block), so the same numbers."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    s = _sizes(q, v, scan_batch=1)
    B, T, HV, K, V, NC = s["B"], s["T"], s["HV"], s["K"], s["V"], s["NC"]
    scale = K**-0.5 if scale is None else float(scale)
    f32 = dict(device=q.device, dtype=torch.float32)
    h0 = None if initial_state is None else initial_state.contiguous()
    prec = _dot_precision(q.dtype)

    chunk_states = torch.empty(B, NC + 1, HV, K, V, device=q.device, dtype=chunk_states_dtype(q.dtype, _SERVES))
    ht = torch.empty(B, HV, K, V, **f32)
    o = torch.empty(B, T, HV, V, device=q.device, dtype=v.dtype)
    x = _intra_fwd(q, k, v, g, beta, scale, s, store_tm=False, traced=True)
    up = torch.empty(B, T, HV, V, device=q.device, dtype=residual_dtype(q.dtype))
    _state_scan_fwd(x, h0, up, chunk_states, ht, s, prec, traced=True)
    _output_fwd(x, up, chunk_states, o, s, prec, traced=True)
    return o, ht, chunk_states


def kda_bwd_triton(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    scale: Optional[float], initial_state: Optional[Tensor],
    chunk_states: Tensor, do: Tensor, dht: Optional[Tensor],
    intermediates: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Chunked backward: ``(dq, dk, dv, dg, dbeta, dh0)`` as ``chunk_kda_bwd``.

    Takes the intra-chunk quantities from ``intermediates`` (the forward's, when
    it kept them) or recomputes them, then runs the reverse scan and the
    intra-chunk backward. Per-token memory is O(T * (K + V + C));
    states are kept only per chunk.
    """
    q, k, v, g, beta, do = (x.contiguous() for x in (q, k, v, g, beta, do))
    chunk_states = chunk_states.contiguous()
    s = _sizes(q, v)
    B, T, H, HV, K, V, NC = s["B"], s["T"], s["H"], s["HV"], s["K"], s["V"], s["NC"]
    G = HV // H
    scale = K**-0.5 if scale is None else float(scale)
    f32 = dict(device=q.device, dtype=torch.float32)
    dh0_dtype = torch.float32 if initial_state is None else initial_state.dtype

    if B * HV == 0 or NC == 0:
        dh0 = (torch.zeros(B, HV, K, V, **f32) if dht is None else dht.to(torch.float32).clone())
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(g),
                torch.zeros_like(beta), dh0.to(dh0_dtype))

    prec = _dot_precision(q.dtype)
    if intermediates is not None and intermediates.numel() > 0:
        x = _intermediates_views(intermediates, _layout(q, v)[0])
    else:
        with record_function("kda_op::bwd::intra_recompute"):
            x = _intra_fwd(q, k, v, g, beta, scale, s, store_tm=True)
    gam, akk, aqk, tm, steep = x["gam"], x["akk"], x["aqk"], x["tm"], x["steep"]

    # U' = U - W S0: the forward's own when it kept its intermediates, else made
    # by the prep kernel below
    up = x["up"] if "up" in x else torch.empty(B, T, HV, V, device=q.device, dtype=residual_dtype(q.dtype))
    dup = torch.empty(B, T, HV, V, **f32)
    dchunk_states = torch.empty(B, NC, HV, K, V, **f32)
    dh0 = torch.empty(B, HV, K, V, **f32)
    dht_arg = dht.contiguous() if dht is not None else dh0
    with record_function("kda_op::bwd::state_scan"):
        kda_state_bwd_prep_kernel[(triton.cdiv(V, s["BV"]), NC, B * HV)](
            x["qg"], x["w"], x["u"], aqk, chunk_states, do,
            up, dup, dchunk_states,
            T, NC,
            H=H, HV=HV, K=K, V=V, BT=BT, BK=s["BK"], BV=s["BV"],
            HAS_UP="up" in x, DOT_PREC=prec, INTERPRET=_INTERPRET, num_warps=8,
        )
        kda_state_bwd_kernel[(triton.cdiv(V, s["BV_SCAN"]), B * HV)](
            x["kr"], x["w"], gam, dht_arg,
            dup, dchunk_states, dh0,
            T, NC,
            H=H, HV=HV, K=K, V=V, BT=BT, BK=s["BK"], BV=s["BV_SCAN"],
            HAS_DHT=dht is not None, DOT_PREC=prec,
            num_warps=SCAN_WARPS, num_stages=s["SCAN_STAGES"],
        )

    dq_e = torch.empty(B, T, HV, K, **f32)
    dk_e = torch.empty(B, T, HV, K, **f32)
    dgam = torch.empty(B, T, HV, K, **f32)
    dgam_last = torch.empty(B, NC, HV, K, **f32)
    dakk = torch.empty(B, T, HV, BT, **f32)
    daqk = torch.empty(B, T, HV, BT, **f32)
    dv = torch.empty_like(v)
    dg = torch.empty_like(g)
    dbeta = torch.empty_like(beta)
    NS = triton.cdiv(K, BKS)
    dtm_part = torch.empty(B, NC, HV, NS, BT, BT, **f32)
    dbeta_part = torch.empty(B, NC, HV, NS, BT, **f32)
    with record_function("kda_op::bwd::intra_through_w"):
        kda_intra_bwd_w_kernel[(NS, NC, B * HV)](
            q, k, beta, gam, tm, up, dup, chunk_states, dchunk_states, do,
            dq_e, dk_e, dgam, dgam_last, dtm_part, dbeta_part,
            scale, T, NC,
            H=H, HV=HV, K=K, V=V, BT=BT, BKS=BKS, BV=s["BV"],
            # one stage: its V loop is short, and prefetching it cost spills at 4 warps
            DOT_PREC=prec, num_warps=INTRA_BWD_W_WARPS, num_stages=1,
        )
    with record_function("kda_op::bwd::intra"):
        kda_intra_bwd_kernel[(NC, B * HV)](
            v, beta, akk, tm, up, dup, do, dtm_part, dbeta_part,
            dv, dbeta, dakk, daqk,
            T, NC,
            H=H, HV=HV, V=V, BT=BT, BV=s["BV"], NS=NS,
            DOT_PREC=prec, num_warps=INTRA_BWD_WARPS,
        )
    with record_function("kda_op::bwd::intra_through_a"):
        common = dict(H=H, HV=HV, K=K, BT=BT, BC=BC, DOT_PREC=prec, MAX_SPLIT=MAX_SPLIT)
        args = (q, k, gam, dakk, daqk, dgam_last, steep, dq_e, dk_e, dgam, dg, scale, T, NC)
        kda_intra_bwd_a_kernel[(triton.cdiv(K, BKD_A), NC, B * HV)](
            *args, **common, BKD=BKD_A, STEEP=False, num_warps=INTRA_BWD_A_WARPS,
        )
        kda_intra_bwd_a_kernel[(triton.cdiv(K, BKD), NC, B * HV)](
            *args, **(common | dict(DOT_PREC=_steep_dot_precision(q.dtype))), BKD=BKD, STEEP=True, num_warps=4,
        )
    with record_function("kda_op::bwd::gva_reduce"):
        # GVA: sum the G value heads of each key head, scale dq, cast: one pass.
        dq = torch.empty_like(q)
        dk = torch.empty_like(k)
        R = B * T * H
        kda_gva_reduce_kernel[(triton.cdiv(R, GVA_ROWS),)](
            dq_e, dk_e, dq, dk, scale, R, G=G, K=K, BR=GVA_ROWS, BK=triton.next_power_of_2(K), num_warps=4,
        )
    return dq, dk, dv, dg, dbeta, dh0.to(dh0_dtype)


def kda_recurrent_fwd_triton(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    scale: Optional[float], initial_state: Optional[Tensor],
    final_state_out: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """Token-by-token forward for decoding: ``(o, final_state)`` as
    ``fused_recurrent_kda_fwd``. ``final_state_out`` (internal, not reachable from
    the ops): a contiguous fp32 ``[B, HV, K, V]`` tensor to write the final state
    into, which may be ``initial_state`` itself (each program reads its state tile
    whole before it writes it back); the benchmark times the in-place update
    with it."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    _check_offsets(T, HV, K, V)
    _check_grid(B, HV, None)
    scale = K**-0.5 if scale is None else float(scale)
    h0 = None if initial_state is None else initial_state.contiguous()
    o = torch.empty(B, T, HV, V, device=q.device, dtype=v.dtype)
    if final_state_out is None:
        ht = torch.empty(B, HV, K, V, device=q.device, dtype=torch.float32)
    else:
        if (final_state_out.shape != (B, HV, K, V) or final_state_out.dtype != torch.float32
                or not final_state_out.is_contiguous()):
            raise ValueError(f"final_state_out: expected a contiguous fp32 tensor of shape {(B, HV, K, V)}, "
                             f"got {final_state_out.dtype} {tuple(final_state_out.shape)}")
        ht = final_state_out
    if B * HV == 0:
        return o, ht
    BK = max(16, triton.next_power_of_2(K))
    # Small V blocks: more programs in flight to hide the state's memory traffic.
    BV = min(RECURRENT_BV, max(16, triton.next_power_of_2(V)))
    kda_recurrent_fwd_kernel[(triton.cdiv(V, BV), B * HV)](
        q, k, v, g, beta, h0 if h0 is not None else ht, o, ht, scale, T, H, HV,
        K=K, V=V, BK=BK, BV=BV, HAS_H0=h0 is not None, STREAM_HINTS=bool(RECURRENT_STREAM_HINTS),
        INPUT_HINTS=bool(RECURRENT_INPUT_HINTS),
        num_warps=RECURRENT_WARPS, **({} if RECURRENT_MAXNREG is None else dict(maxnreg=RECURRENT_MAXNREG)),
    )
    return o, ht
