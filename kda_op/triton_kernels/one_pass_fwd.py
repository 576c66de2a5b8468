"""A prototype forward in one launch (branch one-pass-fwd): every stage of the chunked
form (DESIGN.md section 2) per chunk, on chip, walking the chunks of a sequence in order.

One program per (V block, batch * value head). Per chunk it reads q, k, v, g and beta
only, and writes o (and, where asked, the state entering the chunk); the state S
[BK, BV] (fp32) stays in registers from chunk to chunk. Nothing else travels through
global memory: gam, the A's, Tm, W, U, Qg and Kr of fwd.py's six launches are formed
and used here. Each V block of a head forms the chunk's A's and Tm again (they do not
depend on V): the price of needing no exchange between programs.

Per chunk (rows i, j; gam = cumsum(g) inside the chunk, Gam its last valid row):
  A_kk = (k_i . k_j exp(gam_i - gam_j))_{j<i},  A_qk = (q_i scale . k_j exp(...))_{j<=i}
  Tm   = (I + diag(beta) A_kk)^-1
  U'   = Tm (beta v - Kb S)           Kb = beta k exp(gam)   (= U - W S with W = Tm Kb)
  O    = A_qk U' + Qg S               Qg = q scale exp(gam)
  S   <- exp(Gam) S + Kr^T U'         Kr = k exp(Gam - gam)
U' is formed as Tm (beta v - Kb S) rather than Tm (beta v) - (Tm Kb) S: the same sums
in another order, one [BT, BT] x [BT, BV] dot instead of a [BT, BT] x [BT, BK] one
(W) and no [BT, BK] W tile.

Registers (sm_90a, benchmarks/one_pass_resources.py): per chunk, the A's are formed
over K slices of BKA in the split form, each slice's gam giving its share of the
chunk's spread (the path); Kb, Qg, Kr and Gam only where the scan takes them, from g,
k, q loaded once more (cache hits, not DRAM). The [64, N] dots whose results reach
another dot go through _dot_apart, which keeps Triton from giving them all 8 warps
along M (a replicated tile: twice the registers). See benchmarks/ONE_PASS_STATUS.md.

The A's take one of three paths per chunk (a scalar branch on the chunk's gates):
  0 split: every row of gam within MAX_SPLIT of the middle row m: A = (X exp(gam - gam_m))
    (K exp(gam_m - gam))^T, two dots; entries above the diagonal may overflow and are
    dropped with tl.where (never multiplied).
  1 block references: gates <= 0 and every 16-row block's gam within MAX_SPLIT of the
    block's middle row: that row is the reference of its block's rows, for the columns
    up to the block's end (exp(gam_m - gam_j) <= 1 before the block for a decaying gate).
  2 columns: exact, any gate: column j of both A's as sum_d X_id k_jd exp(gam_id - gam_jd)
    with i < j masked to -inf before the exp. Slow (one column at a time): a fallback.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._contract import chunk_states_dtype, scan_operand_dtype, varlen_chunk_slots, varlen_state_slots
from ._dot import _round_to_bf16_as_fp32, as_stored, dot
from ._host import (_INTERPRET, _SERVES, _cdiv, _check_grid, _check_offsets, _dot_precision, _fast_exp, _pow2,
                    _sizes)
from ._indexing import scan_ends, sequence_coords, state_tile
from ._math import exp
from .settings import BC, BT, MAX_SPLIT


@triton.jit
def _operand(x, BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """``x`` as a dot operand kept live across the scan: bf16 where the dots take bf16
    operands (half the registers; the dot rounds it so anyway), else unchanged. Under
    the interpreter, whose bf16 dots and casts are not the GPU's (_dot.py), it stays
    fp32 holding the rounded values."""
    if BF16:
        if INTERPRET:
            return _round_to_bf16_as_fp32(x)
        else:
            return x.to(tl.bfloat16)
    else:
        return x


@triton.jit
def _dot_apart(a, b, n, TAG: tl.constexpr, BF16: tl.constexpr, PREC: tl.constexpr, INTERPRET: tl.constexpr):
    """``dot(a, b)`` (fp32 sums) inside a branch on ``n > -TAG`` (``n`` >= 0 at run
    time, so always taken; zeros otherwise; each call's own TAG, as the compiler
    merges neighbouring branches on one condition). Why: Triton gives a Hopper dot whose result reaches another dot
    (a "chained" dot, AccelerateMatmul's warpsPerTileV3) all its warps along M; for
    a [64, N] result at 8 warps that is 8 x 16 rows on 64, each warpgroup holding
    and computing the whole tile (twice the registers). Its forward slice stops at
    the branch's yield, so the dot gets the 4 x 2 split."""
    c = tl.zeros((a.shape[0], b.shape[1]), dtype=tl.float32)
    if n > -TAG:
        c = dot(a, b, BF16, PREC, INTERPRET)
    return c


@triton.jit
def _row(x, o_r, r):
    """Row ``r`` of the register tile ``x`` (rows ``o_r``), as a vector over its columns."""
    return tl.sum(tl.where((o_r == r)[:, None], x, 0.0), 0)


@triton.jit
def _slice(g, k, q, row_g, row_qk, m_tk, scale):
    """One K slice of the chunk (pointers at the chunk's first row and the slice's first
    column; offsets and mask [BT, BKA]): gam = cumsum(g) (rows past T repeat the last
    valid row), k and q * scale, fp32."""
    b_gam = tl.cumsum(tl.load(g + row_g, mask=m_tk, other=0.0).to(tl.float32), axis=0)
    b_k = tl.load(k + row_qk, mask=m_tk, other=0.0).to(tl.float32)
    b_q = tl.load(q + row_qk, mask=m_tk, other=0.0).to(tl.float32) * scale
    return b_gam, b_k, b_q


@triton.jit
def _a_split(b_q, b_k, b_gam, o_r, b_akk, b_aqk, spread, A_BF16: tl.constexpr, A_PREC: tl.constexpr,
             BT: tl.constexpr, FAST_EXP: tl.constexpr, INTERPRET: tl.constexpr):
    """Path 0, one K slice: A += (X exp(gam - gam_m)) (K exp(gam_m - gam))^T, m the
    chunk's middle row (unmasked: entries above the diagonal may overflow); and the
    running ``spread`` max |gam - gam_m| that decides whether the path holds.
    ``A_BF16``: bf16 operands (fp32 sums), else fp32 at ``A_PREC``."""
    b_dm = b_gam - _row(b_gam, o_r, BT // 2)[None, :]
    spread = tl.maximum(spread, tl.max(tl.max(tl.abs(b_dm), 1), 0))
    b_kn = tl.trans(b_k * exp(-b_dm, FAST_EXP))
    b_ep = exp(b_dm, FAST_EXP)
    b_akk += dot(b_k * b_ep, b_kn, A_BF16, A_PREC, INTERPRET)
    b_aqk += dot(b_q * b_ep, b_kn, A_BF16, A_PREC, INTERPRET)
    return b_akk, b_aqk, spread


@triton.jit
def _block_mid(b_gam, BT: tl.constexpr, BC: tl.constexpr, BKA: tl.constexpr):
    """Each BC-row block's middle row of ``b_gam`` [BT, BKA], as [BT // BC, BKA]."""
    NB: tl.constexpr = BT // BC
    o_c = tl.arange(0, BC)
    return tl.sum(tl.where((o_c == BC // 2)[None, :, None], tl.reshape(b_gam, (NB, BC, BKA)), 0.0), 1)


@triton.jit
def _a_block_refs(b_q, b_k, b_gam, o_r, n, b_akk, b_aqk, A_PREC: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                  BKA: tl.constexpr, FAST_EXP: tl.constexpr):
    """Path 1, one K slice: both A's (unmasked) with each BC-row block's middle row as
    the reference of its rows, for the columns up to the block's end (zero after it)."""
    NB: tl.constexpr = BT // BC
    b_gref = tl.reshape(tl.broadcast_to(_block_mid(b_gam, BT, BC, BKA)[:, None, :], (NB, BC, BKA)), (BT, BKA))
    b_er = exp(b_gam - b_gref, FAST_EXP)
    b_kl = b_k * b_er
    b_ql = b_q * b_er
    for i_b in tl.static_range(NB):
        b_gm = _row(b_gam, o_r, i_b * BC + BC // 2)
        upto = (o_r < (i_b + 1) * BC)[:, None]
        b_kc = tl.trans(b_k * exp(tl.where(upto, b_gm[None, :] - b_gam, float("-inf")), FAST_EXP))
        rows = (o_r // BC == i_b)[:, None]
        b_akk += _dot_apart(tl.where(rows, b_kl, 0.0), b_kc, n, 10 + 2 * i_b, False, A_PREC, False)
        b_aqk += _dot_apart(tl.where(rows, b_ql, 0.0), b_kc, n, 11 + 2 * i_b, False, A_PREC, False)
    return b_akk, b_aqk


@triton.jit
def _a_columns(b_q, b_k, b_gam, o_r, n_rows, b_akk, b_aqk, FAST_EXP: tl.constexpr):
    """Path 2, one K slice: both A's exactly, column by column (the chunk's ``n_rows``
    valid ones): A[i, j] += sum_d X_id k_jd exp(gam_id - gam_jd) for i >= j, no
    reference row, so no factor leaves fp32 range unless the entry itself does."""
    for j in range(0, n_rows):
        b_kj = _row(b_k, o_r, j)
        b_gj = _row(b_gam, o_r, j)
        b_kje = b_kj[None, :] * exp(tl.where((o_r >= j)[:, None], b_gam - b_gj[None, :], float("-inf")), FAST_EXP)
        col = (o_r == j)[None, :]
        b_akk = tl.where(col, b_akk + tl.sum(b_k * b_kje, 1)[:, None], b_akk)
        b_aqk = tl.where(col, b_aqk + tl.sum(b_q * b_kje, 1)[:, None], b_aqk)
    return b_akk, b_aqk


@triton.jit
def _unit_lower_inverse(b_m, n, A_PREC: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """(I + M)^-1 for M [BT, BT] strictly lower triangular (BT = 4 BC).

    With D the BC x BC diagonal blocks of M and N the rest, I + M = (I + D)(I + P),
    P = (I + D)^-1 N strictly block lower, so P^4 = 0 and
    (I + M)^-1 = (I - P)(I + P^2)(I + D)^-1. The four (I + D) blocks are inverted
    together, row by row (BC - 1 steps on [4, BC, BC] tiles): row i of the inverse
    X is e_i - sum_{j<i} D_ij X_j."""
    NB: tl.constexpr = BT // BC
    tl.static_assert(NB == 4, "(I + P)^-1 = (I - P)(I + P^2) takes four sub-blocks")
    o_r = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    o_b = tl.arange(0, NB)
    diag_block = o_b[:, None, None, None] == o_b[None, None, :, None]  # [NB, 1, NB, 1]
    b_d = tl.sum(tl.where(diag_block, tl.reshape(b_m, (NB, BC, NB, BC)), 0.0), 2)  # [NB, BC, BC]
    eye_c = (o_c[:, None] == o_c[None, :]).to(tl.float32)
    b_x = tl.broadcast_to(eye_c[None, :, :], (NB, BC, BC))
    for i in range(1, BC):
        at_i = o_c == i
        b_di = tl.sum(tl.where(at_i[None, :, None], b_d, 0.0), 1)  # row i of each block's D, [NB, BC]
        b_xi = at_i.to(tl.float32)[None, :] - tl.sum(b_di[:, :, None] * b_x, 1)
        b_x = tl.where(at_i[None, :, None], b_xi[:, None, :], b_x)
    b_dinv = tl.reshape(tl.where(diag_block, b_x[:, :, None, :], 0.0), (BT, BT))
    b_n = tl.where(o_r[:, None] // BC > o_r[None, :] // BC, b_m, 0.0)
    b_eye = (o_r[:, None] == o_r[None, :]).to(tl.float32)
    b_p = _dot_apart(b_dinv, b_n, n, 1, False, A_PREC, False)
    b_p2 = _dot_apart(b_p, b_p, n, 2, False, A_PREC, False)
    return _dot_apart(_dot_apart(b_eye - b_p, b_eye + b_p2, n, 3, False, A_PREC, False), b_dinv, n, 4, False, A_PREC,
                      False)


@triton.jit
def kda_one_pass_fwd_kernel(
    q, k, v, g, beta, h0,
    o, ht, chunk_states, paths,
    cu_seqlens, seq_offsets,
    scale, T, NC, NCS,
    H, HV,  # runtime: one compiled kernel serves every head count
    K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BKA: tl.constexpr,
    MAX_SPLIT: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, STORE_STATES: tl.constexpr, STORE_PATHS: tl.constexpr,
    DOT_PREC: tl.constexpr, BF16_DOTS: tl.constexpr = False, A_BF16: tl.constexpr = False,
    INTERPRET: tl.constexpr = False, FAST_EXP: tl.constexpr = False, DIAG: tl.constexpr = 0,
):
    # DIAG: resource diagnostics only (benchmarks/one_pass_resources.py --set DIAG=n),
    # wrong results when set: 1 no fallback paths, 2 no inverse, 4 no Kb S / Tm R dots.
    # q, k [B, T, H, K]; v, o [B, T, HV, V]; g [B, T, HV, K] fp32; beta [B, T, HV];
    # h0, ht [B, HV, K, V] fp32; chunk_states [B, NC + 1, HV, K, V] (STORE_STATES: the
    # state entering each chunk, then the final one); paths [B, NC, HV] int32
    # (STORE_PATHS, for tests: the path each chunk's A's took, see the module docstring).
    # IS_VARLEN: N sequences packed along T (B = 1; cu_seqlens [N + 1]; seq_offsets
    # [N, 2], _host._varlen_index's): program (V block, n * HV + hv); h0, ht [N, HV, K, V];
    # chunk_states [1, NCS, HV, K, V] in _contract.varlen_state_slots' layout with
    # initial-state slots (sequence n's NC_n + 1 boundaries from seq_offsets[n, 1]; the
    # slots past the last sequence's are written zero); paths [1, NC, HV] by global chunk.
    # The A's and Tm: fp32 operands at DOT_PREC (they feed the inverse). The scan and
    # output dots (Kb S, Tm R, A_qk U', Qg S, Kr^T U'): bf16 operands where BF16_DOTS.
    scale = tl.cast(scale, tl.float32)
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    # the sequence, its first row, length and chunk count, its first chunk's global
    # index and the slot of the state entering it (_indexing.sequence_coords)
    i_b, i_hv, i_h, bos, T_n, NC_n, g_0, s_0 = sequence_coords(i_bh, T, NC, H, HV, cu_seqlens, seq_offsets, BT,
                                                               IS_VARLEN)
    # Each pointer moves to this sequence and head once, in 64-bit, and to each chunk
    # in 64-bit in the loop; offsets inside a chunk are 32-bit at any T.
    q += (bos * H + i_h) * K
    k += (bos * H + i_h) * K
    v += (bos * HV + i_hv) * V
    o += (bos * HV + i_hv) * V
    g += (bos * HV + i_hv) * K
    beta += bos * HV + i_hv
    cs_stride = tl.cast(HV, tl.int64) * K * V  # from one chunk boundary to the next
    chunk_states += s_0 * cs_stride + i_hv * K * V
    paths += tl.cast(g_0, tl.int64) * HV + i_hv

    o_r = tl.arange(0, BT)
    o_k, m_k, o_v, m_v, m_kv, state_off = state_tile(i_v, K, V, BK, BV)
    o_a = tl.arange(0, BKA)  # a K slice's columns, from its first
    lower = o_r[:, None] > o_r[None, :]
    causal = o_r[:, None] >= o_r[None, :]

    # S from h0's tile (or zeros), ht at this sequence's final state (no pool: ht stands in for the slots)
    b_s, ht, ends_off, m_ends, _ = scan_ends(h0, ht, ht, i_b, i_hv, HV, o_k, o_v, m_kv, K, V, BK, BV, HAS_H0,
                                             False, False)

    for i_c in range(0, NC_n):
        if STORE_STATES:
            tl.store(chunk_states + i_c * cs_stride + state_off,
                     as_stored(b_s, chunk_states, INTERPRET).to(chunk_states.dtype.element_ty), mask=m_kv)
        r0 = tl.cast(i_c * BT, tl.int64)  # the chunk's first row
        p_g = g + r0 * (HV * K)
        p_k = k + r0 * (H * K)
        p_q = q + r0 * (H * K)
        n_rows = tl.minimum(T_n - i_c * BT, BT).to(tl.int32)  # its valid rows
        m_t = o_r < n_rows
        # Offsets inside the chunk from its rows clamped to the last valid one (their
        # loads are masked anyway): they depend on the chunk, so the compiler forms
        # them where taken instead of holding five [BT, *] offset tiles across the loop
        # (registers).
        o_rc = tl.minimum(o_r, n_rows - 1)
        row_qk = o_rc[:, None] * (H * K) + o_k[None, :]
        row_g = o_rc[:, None] * (HV * K) + o_k[None, :]
        row_qka = o_rc[:, None] * (H * K) + o_a[None, :]
        row_ga = o_rc[:, None] * (HV * K) + o_a[None, :]
        row_v = o_rc[:, None] * (HV * V) + o_v[None, :]
        b_beta = tl.load(beta + r0 * HV + o_r * HV, mask=m_t, other=0.0).to(tl.float32)

        # The A's over K slices of BKA (g, k, q of each slice loaded where taken; the
        # whole tiles and the slices' exp factors are never live together), first in
        # the split form (path 0), which also finds the chunk's spread from its middle
        # row: one cumsum of each slice. Where the spread is too wide for the split,
        # they are formed again by a fallback path (what path 0 left, maybe inf or
        # NaN, is dropped). Rows past T load g = 0, so they repeat the last valid row
        # and add nothing to the spreads.
        m_tk = m_t[:, None] & m_k[None, :]
        b_akk = tl.zeros([BT, BT], dtype=tl.float32)
        b_aqk = tl.zeros([BT, BT], dtype=tl.float32)
        spread = tl.full([], 0.0, tl.float32)
        for i_s in range(0, BK // BKA):
            m_ts = m_t[:, None] & ((i_s * BKA + o_a) < K)[None, :]
            b_gs, b_ks, b_qs = _slice(p_g + i_s * BKA, p_k + i_s * BKA, p_q + i_s * BKA, row_ga, row_qka, m_ts,
                                      scale)
            b_akk, b_aqk, spread = _a_split(b_qs, b_ks, b_gs, o_r, b_akk, b_aqk, spread, A_BF16, DOT_PREC, BT,
                                            FAST_EXP, INTERPRET)
        path = tl.full([], 0, tl.int32)
        if (spread > MAX_SPLIT) & (DIAG & 1 == 0):
            b_akk = tl.zeros([BT, BT], dtype=tl.float32)
            b_aqk = tl.zeros([BT, BT], dtype=tl.float32)
            # block references need every 16-row block within MAX_SPLIT of its middle
            # row, and a decaying gate (g <= 0 on the valid rows; rows past T load 0),
            # which keeps the factors before each block <= 1
            block_spread = tl.full([], 0.0, tl.float32)
            g_max = tl.full([], 0.0, tl.float32)
            for i_s in range(0, BK // BKA):
                m_ts = m_t[:, None] & ((i_s * BKA + o_a) < K)[None, :]
                b_gsl = tl.load(p_g + i_s * BKA + row_ga, mask=m_ts, other=0.0).to(tl.float32)
                g_max = tl.maximum(g_max, tl.max(tl.reshape(b_gsl, (BT * BKA,)), 0))
                b_gsl = tl.cumsum(b_gsl, axis=0)
                b_dev = tl.abs(tl.reshape(b_gsl, (BT // BC, BC, BKA)) - _block_mid(b_gsl, BT, BC, BKA)[:, None, :])
                block_spread = tl.maximum(block_spread, tl.max(tl.reshape(b_dev, (BT * BKA,)), 0))
            if (block_spread <= MAX_SPLIT) & (g_max <= 0.0):
                path = tl.full([], 1, tl.int32)
                for i_s in range(0, BK // BKA):
                    m_ts = m_t[:, None] & ((i_s * BKA + o_a) < K)[None, :]
                    b_gs, b_ks, b_qs = _slice(p_g + i_s * BKA, p_k + i_s * BKA, p_q + i_s * BKA, row_ga, row_qka,
                                              m_ts, scale)
                    b_akk, b_aqk = _a_block_refs(b_qs, b_ks, b_gs, o_r, n_rows, b_akk, b_aqk, DOT_PREC, BT, BC, BKA,
                                                 FAST_EXP)
            else:
                path = tl.full([], 2, tl.int32)
                for i_s in range(0, BK // BKA):
                    m_ts = m_t[:, None] & ((i_s * BKA + o_a) < K)[None, :]
                    b_gs, b_ks, b_qs = _slice(p_g + i_s * BKA, p_k + i_s * BKA, p_q + i_s * BKA, row_ga, row_qka,
                                              m_ts, scale)
                    b_akk, b_aqk = _a_columns(b_qs, b_ks, b_gs, o_r, n_rows, b_akk, b_aqk, FAST_EXP)
        if STORE_PATHS:
            tl.store(paths + i_c * HV, path)
        # entries above the diagonal may be inf or NaN (path 0): selected away, never multiplied
        b_aqk = _operand(tl.where(causal, b_aqk, 0.0), BF16_DOTS, INTERPRET)
        if DIAG & 2:
            b_tm = b_beta[:, None] * tl.where(lower, b_akk, 0.0)
        else:
            b_tm = _unit_lower_inverse(b_beta[:, None] * tl.where(lower, b_akk, 0.0), n_rows, DOT_PREC, BT, BC)

        m_tv = m_t[:, None] & m_v[None, :]
        # each tile loaded where it is taken (q, k read again: cache hits)
        b_gam = tl.cumsum(tl.load(p_g + row_g, mask=m_tk, other=0.0).to(tl.float32), axis=0)
        b_glast = _row(b_gam, o_r, BT - 1)  # Gam (rows past T repeat the last valid one)
        b_eg = exp(b_gam, FAST_EXP)
        b_kb = _operand(b_beta[:, None] * tl.load(p_k + row_qk, mask=m_tk, other=0.0).to(tl.float32) * b_eg,
                        BF16_DOTS, INTERPRET)
        b_qg = _operand(tl.load(p_q + row_qk, mask=m_tk, other=0.0).to(tl.float32) * scale * b_eg, BF16_DOTS,
                        INTERPRET)
        b_o = _dot_apart(b_qg, b_s, n_rows, 5, BF16_DOTS, DOT_PREC, INTERPRET)
        b_bv = b_beta[:, None] * tl.load(v + r0 * (HV * V) + row_v, mask=m_tv, other=0.0).to(tl.float32)
        if DIAG & 4:
            b_up = b_bv + b_tm
        else:
            b_up = _dot_apart(b_tm, b_bv - _dot_apart(b_kb, b_s, n_rows, 6, BF16_DOTS, DOT_PREC, INTERPRET), n_rows, 7,
                              BF16_DOTS, DOT_PREC, INTERPRET)
        b_o += dot(b_aqk, b_up, BF16_DOTS, DOT_PREC, INTERPRET)
        tl.store(o + r0 * (HV * V) + row_v, as_stored(b_o, o, INTERPRET).to(o.dtype.element_ty), mask=m_tv)
        b_kr = _operand(tl.load(p_k + row_qk, mask=m_tk, other=0.0).to(tl.float32) * exp(b_glast[None, :] - b_gam,
                                                                                          FAST_EXP),
                        BF16_DOTS, INTERPRET)
        b_s = b_s * exp(b_glast, FAST_EXP)[:, None] + dot(tl.trans(b_kr), b_up, BF16_DOTS, DOT_PREC, INTERPRET)

    if STORE_STATES:
        tl.store(chunk_states + NC_n * cs_stride + state_off,
                 as_stored(b_s, chunk_states, INTERPRET).to(chunk_states.dtype.element_ty), mask=m_kv)
        if IS_VARLEN:
            # the last sequence's programs write zeros in the slots past its final
            # state (at most N of them: varlen_state_slots is an upper bound)
            if i_b == tl.num_programs(1) // HV - 1:
                b_zero = tl.zeros([BK, BV], dtype=chunk_states.dtype.element_ty)
                for i_u in range(s_0 + NC_n + 1, tl.cast(NCS, tl.int64)):
                    tl.store(chunk_states + (i_u - s_0) * cs_stride + state_off, b_zero, mask=m_kv)
    if STORE_HT:
        tl.store(ht + ends_off, b_s, mask=m_ends)


def kda_one_pass_fwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    scale: Optional[float] = None, initial_state: Optional[Tensor] = None,
    output_final_state: bool = True, chunk_states: Union[None, bool, Tensor] = None,
    *, cu_seqlens: Optional[Tensor] = None, block_v: int = 32, block_k_a: int = 32, num_warps: int = 8,
    num_stages: int = 1, a_bf16: bool = False, seq_offsets: Optional[Tensor] = None,
    paths: Optional[Tensor] = None,
) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """The chunked KDA forward in one launch (kda_one_pass_fwd_kernel): ``(o,
    final_state, chunk_states)``.

    q, k [B, T, H, K]; v [B, T, HV, V] (HV = G * H; value head hv reads key head
    hv // G); g [B, T, HV, K] log decay (read as fp32); beta [B, T, HV]; ``scale``
    (default K ** -0.5); ``initial_state`` [B, HV, K, V] or None (zeros). o is
    [B, T, HV, V] in v's dtype; final_state fp32 [B, HV, K, V], None unless
    ``output_final_state``.

    ``cu_seqlens`` (int32 or int64 [N + 1], B = 1): N packed sequences, fla's
    convention; initial_state and final_state are then [N, HV, K, V] and the chunk
    states [1, NCS, HV, K, V], NCS = T // 64 + 2 N (``_contract.varlen_state_slots``
    WITH initial-state slots, whether or not initial states are given: sequence n's
    NC_n + 1 boundaries from ``seq_offsets[n, 1]`` = its first chunk's global index
    + n; the slots past the last sequence's are written zero). The index comes from
    ``_host._sizes`` (one launch, no host sync) unless ``seq_offsets`` (int64 [N, 2],
    ``_host._varlen_index(cu_seqlens, T, True)[1]``) is given. ``paths`` is then
    [1, T // 64 + N, HV] by global chunk index. ``chunk_states``: None or False, not stored (None
    returned); True, a fresh [B, NC + 1, HV, K, V] tensor (NC = ceil(T / 64)) of
    ``_contract.chunk_states_dtype`` (bf16 for bf16 inputs, as the CUDA forward keeps
    them) holding the state entering each chunk, then the final one; a tensor of that
    shape and dtype (contiguous), written in place and returned.

    Tuning: ``block_v`` (16, 32, 64 or 128) the V block of a program; ``block_k_a``
    (16, 32, 64 or 128) the K slices over which the A's are formed (at most the K
    block); ``num_warps``, ``num_stages``. ``paths``: for tests, an int32 [B, NC, HV] tensor that receives the
    path each chunk's A's took (0 split, 1 block references, 2 columns).
    K <= 128. CUDA tensors,
    or CPU tensors under TRITON_INTERPRET=1."""
    for name, x, dims in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 4), ("beta", beta, 3)):
        if x.dim() != dims:
            raise ValueError(f"{name}: expected {dims} dimensions, got shape {tuple(x.shape)}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if k.shape != q.shape:
        raise ValueError(f"k: expected shape {tuple(q.shape)} (q's), got {tuple(k.shape)}")
    if v.shape[:2] != (B, T) or HV % max(H, 1) != 0 or (H == 0 and HV != 0):
        raise ValueError(f"v: expected [B={B}, T={T}, HV, V] with HV a multiple of H={H}, got {tuple(v.shape)}")
    if g.shape != (B, T, HV, K):
        raise ValueError(f"g: expected shape {(B, T, HV, K)}, got {tuple(g.shape)}")
    if beta.shape != (B, T, HV):
        raise ValueError(f"beta: expected shape {(B, T, HV)}, got {tuple(beta.shape)}")
    if not 0 < K <= 128:
        raise ValueError(f"q: K = {K}; the one-pass forward takes 1 <= K <= 128 (one K tile)")
    if V < 1:
        raise ValueError(f"v: V = {V}; expected V >= 1")
    if block_v not in (16, 32, 64, 128):
        raise ValueError(f"block_v: expected 16, 32, 64 or 128, got {block_v!r}")
    if block_k_a not in (16, 32, 64, 128):
        raise ValueError(f"block_k_a: expected 16, 32, 64 or 128, got {block_k_a!r}")
    if a_bf16 and q.dtype != torch.bfloat16:
        raise ValueError(f"a_bf16: bf16 operands for the A's are for bf16 inputs, got {q.dtype}")
    if cu_seqlens is None:
        if seq_offsets is not None:
            raise ValueError("seq_offsets: only with cu_seqlens")
        _check_offsets(T, HV, K, V)
        _check_grid(B, HV, T)
        N, NC = B, _cdiv(T, BT)
        NCS = NC + 1
        cs_shape, paths_shape = (B, NCS, HV, K, V), (B, NC, HV)
    else:
        if B != 1:
            raise ValueError(f"cu_seqlens: packed sequences take B = 1, got B = {B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError("cu_seqlens: expected an int32 or int64 tensor [N + 1], N >= 1")
        cu_seqlens = cu_seqlens.contiguous()
        N = cu_seqlens.shape[0] - 1
        if seq_offsets is None:
            # _sizes checks the offsets and grid and builds the index (one launch, no host sync)
            sizes = _sizes(q, v, cu_seqlens=cu_seqlens, has_initial_state=True)
            NC, NCS, seq_offsets = sizes["NC"], sizes["NCS"], sizes["VL_SEQ"][1]
        else:
            _check_offsets(T, HV, K, V)
            _check_grid(N, HV, T + N * BT)
            if tuple(seq_offsets.shape) != (N, 2) or seq_offsets.dtype != torch.int64:
                raise ValueError(f"seq_offsets: expected int64 [{N}, 2] (_host._varlen_index's, with initial-state "
                                 f"slots), got {seq_offsets.dtype} {tuple(seq_offsets.shape)}")
            NC, NCS = varlen_chunk_slots(T, N), varlen_state_slots(T, N, True)
        cs_shape, paths_shape = (1, NCS, HV, K, V), (1, NC, HV)
    if initial_state is not None and initial_state.shape != (N, HV, K, V):
        raise ValueError(f"initial_state: expected shape {(N, HV, K, V)}, got {tuple(initial_state.shape)}")

    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    scale = K ** -0.5 if scale is None else float(scale)
    f32 = dict(device=q.device, dtype=torch.float32)
    h0 = None if initial_state is None else initial_state.contiguous().float()
    o = torch.empty(B, T, HV, V, device=q.device, dtype=v.dtype)
    ht = torch.empty(N, HV, K, V, **f32) if output_final_state else None
    cs_dtype = chunk_states_dtype(q.dtype, _SERVES)
    if isinstance(chunk_states, Tensor):
        if tuple(chunk_states.shape) != cs_shape or chunk_states.dtype != cs_dtype or not chunk_states.is_contiguous():
            raise ValueError(f"chunk_states: expected a contiguous {cs_dtype} tensor of shape {cs_shape}, got "
                             f"{chunk_states.dtype} {tuple(chunk_states.shape)}")
        cs = chunk_states
    elif chunk_states is True:
        cs = torch.empty(cs_shape, device=q.device, dtype=cs_dtype)
    elif chunk_states is None or chunk_states is False:
        cs = None
    else:
        raise ValueError(f"chunk_states: expected None, a bool or a tensor, got {type(chunk_states).__name__}")
    if paths is not None and (tuple(paths.shape) != paths_shape or paths.dtype != torch.int32):
        raise ValueError(f"paths: expected an int32 tensor of shape {paths_shape}")
    if N * HV == 0:
        return o, ht, cs
    bf16_operands = scan_operand_dtype(q.dtype) == torch.bfloat16
    BK = max(16, _pow2(K))
    kda_one_pass_fwd_kernel[(_cdiv(V, block_v), N * HV)](
        q, k, v, g, beta, o if h0 is None else h0,
        o, o if ht is None else ht, o if cs is None else cs, o if paths is None else paths,
        q if cu_seqlens is None else cu_seqlens, q if seq_offsets is None else seq_offsets,
        scale, T, NC, NCS, H, HV, IS_VARLEN=cu_seqlens is not None,
        K=K, V=V, BT=BT, BC=BC, BK=BK, BV=block_v, BKA=min(block_k_a, BK), MAX_SPLIT=MAX_SPLIT,
        HAS_H0=h0 is not None, STORE_HT=ht is not None, STORE_STATES=cs is not None, STORE_PATHS=paths is not None,
        DOT_PREC=_dot_precision(q.dtype), BF16_DOTS=bf16_operands, A_BF16=bool(a_bf16), INTERPRET=_INTERPRET, FAST_EXP=_fast_exp(),
        num_warps=num_warps, num_stages=num_stages,
    )
    return o, ht, cs
