"""Stage 1a (forward) by row blocks (settings.INTRA_A_ROW_PROGRAMS): the A's, Qg, Kr
and the steep flags, for inputs whose every chunk can take block references.

fla's bounded gate (``lower_bound * sigmoid(...)`` with ``lower_bound <= 0``, every
log decay in [lower_bound, 0], BC / 2 * |lower_bound| below MAX_SPLIT) keeps gam
within MAX_SPLIT of every BC-row block's middle row (_host._gate_bounds_every_block).
intra_a_fwd.py forms such chunks in one program per chunk with four [BT, BKA] x
[BKA, BT] dots a K slice, the other blocks' rows zeroed (its block-reference path);
here each row block has a program of its own, as fla's intra kernels do, and its
dots cover its own rows only: one program per (row block b, chunk, batch * value
head), m the middle row of block b, for the rows i of block b and the columns j up
to the block's end

  A_kk[i, j] = sum_k K_ik exp(gam_ik - gam_mk) * K_jk exp(gam_mk - gam_jk)   (j < i)
  A_qk[i, j] alike with Q * scale for K_i                                    (j <= i)

exp(gam_i - gam_m) and, inside the block, exp(gam_m - gam_j) stay within exp(MAX_SPLIT);
before the block exp(gam_m - gam_j) <= 1 (gam falls). Entries above the diagonal may
overflow and are dropped. The tile's width is the block's end rounded up to a power of
two (16, 32, 64, 64). Block b's rows of Qg = Q * scale * exp(gam) and Kr = K * exp(Gam -
gam) (Gam: the chunk's last gam) are written in the same pass over K, and block 0's
program writes the chunk's steep flag as intra_a_fwd.py would (0 where the split at the
middle row serves the backward, else 1: block references; never 2, the steep launch's).
gam comes from gam_fwd.py.

KBG (a forward that keeps nothing, bf16 inputs; settings.INTRA_A_ROWS_KBG): block b's rows
of Kb = diag(beta) K exp(gam) are stored too, into ``kbg``, for intra_wu_fwd.py's W (its
KBG_IN), which then reads neither K nor gam: as intra_a_fwd.py's KBG with gam on chip.

GAM_ON_CHIP (with KBG; settings.INTRA_A_ROWS_GAM_ON_CHIP): gam is not read from gam_fwd.py
but formed here from the raw gate ``g`` (fla's in-kernel gate, _gate.py; GATE > 0): each
program forms its chunk's whole gam, a K slice at a time, as gam_fwd.py does (the gate on
the raw tile, rows past the end 0, a cumsum down the BT rows), and takes its rows, its
window's and the middle and last rows from that one tile, so that all agree. Block 0's
program also stores each chunk's last row of gam (the scans' decay; past the end the rows
repeat it, as _indexing.gam_row reads) and the steep flag. No other row of gam is written.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._dot import as_stored
from ._gate import gate_fwd, gate_params
from ._math import exp
from ._indexing import chunk_coords, chunk_in_sequence, gam_row


@triton.jit
def kda_intra_a_fwd_rows_kernel(
    q, k, gam, akk, aqk, steep, qg, kr,
    cu_seqlens, chunk_index,  # varlen (IS_VARLEN): _indexing.py
    scale, T, NC,
    H, HV,  # runtime: one compiled kernel serves every head count
    K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BKA: tl.constexpr,
    DOT_PREC: tl.constexpr, MAX_SPLIT: tl.constexpr, INTERPRET: tl.constexpr = False,
    IS_VARLEN: tl.constexpr = False, QG_FIRST: tl.constexpr = True, KR_LAST: tl.constexpr = True,
    FAST_EXP: tl.constexpr = False, beta=None, kbg=None, KBG: tl.constexpr = False,
    g=None, A_log=None, dt_bias=None, lower_bound=0.0, GATE: tl.constexpr = 0, HAS_A: tl.constexpr = False,
    HAS_BIAS: tl.constexpr = False, GAM_ON_CHIP: tl.constexpr = False,
):
    # QG_FIRST / KR_LAST: as in intra_a_fwd.py (no Qg in a sequence's first chunk, no Kr
    # in its last, where nothing reads them). FAST_EXP: _math.exp without subnormals.
    # scale in fp32 whatever the caller's scalar type (inductor passes fp64)
    scale = tl.cast(scale, tl.float32)
    tl.static_assert(BT == 4 * BC, "four row blocks a chunk")
    # the row block varies fastest, so that a chunk's programs run side by side and
    # share their loads of K and gam through L2
    i_blk = tl.program_id(0)
    i_c = tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    i_b, i_hv, i_h, bos, T, g_c, s_c = chunk_coords(i_c, i_bh, T, NC, H, HV, cu_seqlens, chunk_index, BT, IS_VARLEN)
    if i_blk * BC >= T:
        # a block past the chunk's rows (short or last chunks); an unused slot's flag,
        # kept for the backward, is 0
        if IS_VARLEN:
            if (T <= 0) & (i_blk == 0):
                tl.store(steep + g_c * HV + i_hv, 0)
        return
    # Each pointer moves to this chunk and head once, in 64-bit (bos: the chunk's
    # first row); offsets inside the chunk are 32-bit at any T.
    q += (bos * H + i_h) * K
    k += (bos * H + i_h) * K
    gam += (bos * HV + i_hv) * K
    akk += (bos * HV + i_hv) * BT
    aqk += (bos * HV + i_hv) * BT
    qg += (bos * HV + i_hv) * K
    kr += (bos * HV + i_hv) * K
    if KBG:
        beta += bos * HV + i_hv
        kbg += (bos * HV + i_hv) * K
    tl.static_assert(not GAM_ON_CHIP or (KBG and GATE > 0), "gam on chip: Kb handed on, from the raw gate")
    if GAM_ON_CHIP:
        g += (bos * HV + i_hv) * K
    p_flag = steep + g_c * HV + i_hv
    store_qg = (chunk_in_sequence(i_c, chunk_index, IS_VARLEN) > 0) | QG_FIRST
    store_kr = (T > BT) | KR_LAST
    if i_blk == 0:
        if not GAM_ON_CHIP:  # (with GAM_ON_CHIP _rows forms the flag, FLAG)
            # the chunk's flag: gam falls down each column, so its spread from the middle
            # row is largest at the first or last row (intra_a_fwd.py's ROW_SPREADS)
            spread = tl.full([], 0.0, tl.float32)
            for i_s in range(tl.cdiv(K, BKA)):
                o_k = i_s * BKA + tl.arange(0, BKA)
                m_k = o_k < K
                b_first = tl.load(gam + o_k, mask=m_k, other=0.0)
                b_mid = tl.load(gam + gam_row(BT // 2, T) * (HV * K) + o_k, mask=m_k, other=0.0)
                b_last = tl.load(gam + gam_row(BT - 1, T) * (HV * K) + o_k, mask=m_k, other=0.0)
                spread = tl.maximum(spread, tl.max(tl.maximum(b_first - b_mid, b_mid - b_last), 0))
            tl.store(p_flag, tl.where(spread <= MAX_SPLIT, 0, 1).to(tl.int32))
        _rows(q, k, gam, akk, aqk, qg, kr, store_qg, store_kr, scale, T, i_blk, H, HV, K, BT, BC, BKA, BC,
              DOT_PREC, INTERPRET, FAST_EXP, beta, kbg, KBG, g, A_log, dt_bias, lower_bound, i_hv, p_flag, GATE,
              HAS_A, HAS_BIAS, GAM_ON_CHIP, GAM_ON_CHIP, MAX_SPLIT)
    elif i_blk == 1:
        _rows(q, k, gam, akk, aqk, qg, kr, store_qg, store_kr, scale, T, i_blk, H, HV, K, BT, BC, BKA, 2 * BC,
              DOT_PREC, INTERPRET, FAST_EXP, beta, kbg, KBG, g, A_log, dt_bias, lower_bound, i_hv, p_flag, GATE,
              HAS_A, HAS_BIAS, GAM_ON_CHIP, False, MAX_SPLIT)
    else:
        _rows(q, k, gam, akk, aqk, qg, kr, store_qg, store_kr, scale, T, i_blk, H, HV, K, BT, BC, BKA, BT,
              DOT_PREC, INTERPRET, FAST_EXP, beta, kbg, KBG, g, A_log, dt_bias, lower_bound, i_hv, p_flag, GATE,
              HAS_A, HAS_BIAS, GAM_ON_CHIP, False, MAX_SPLIT)


@triton.jit
def _rows(q, k, gam, akk, aqk, qg, kr, store_qg, store_kr, scale, T, i_blk, H, HV,
          K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BKA: tl.constexpr, CW: tl.constexpr,
          DOT_PREC: tl.constexpr, INTERPRET: tl.constexpr, FAST_EXP: tl.constexpr,
          beta=None, kbg=None, KBG: tl.constexpr = False, g=None, A_log=None, dt_bias=None, lower_bound=0.0,
          i_hv=0, p_flag=None, GATE: tl.constexpr = 0,
          HAS_A: tl.constexpr = False, HAS_BIAS: tl.constexpr = False, GAM_ON_CHIP: tl.constexpr = False,
          FLAG: tl.constexpr = False, MAX_SPLIT: tl.constexpr = 0):
    """Block ``i_blk``'s rows of the A's on [BC, CW] tiles (CW >= the block's end),
    the columns from CW stored as zeros, and its rows of Qg, Kr and (KBG) Kb; with
    GAM_ON_CHIP gam from the raw gate ``g`` (at the chunk's first row and this head) with
    A_log, dt_bias and lower_bound of value head ``i_hv``, and with FLAG the chunk's steep
    flag (at ``p_flag``) and last row of gam stored. The pointers are
    at the chunk's first row and this head; T the rows from there to the sequence's end."""
    o_i = i_blk * BC + tl.arange(0, BC)
    m_i = o_i < T
    o_j = tl.arange(0, CW)
    upto = o_j < (i_blk + 1) * BC
    m_j = (o_j < T) & upto
    b_akk = tl.zeros([BC, CW], dtype=tl.float32)
    b_aqk = tl.zeros([BC, CW], dtype=tl.float32)
    if KBG:
        b_beta = tl.load(beta + o_i * HV, mask=m_i, other=0.0).to(tl.float32)
    spread = tl.full([], 0.0, tl.float32)
    for i_s in range(tl.cdiv(K, BKA)):
        o_k = i_s * BKA + tl.arange(0, BKA)
        m_k = o_k < K
        m_ik = m_i[:, None] & m_k[None, :]
        p_ik = o_i[:, None] * (HV * K) + o_k[None, :]
        if GAM_ON_CHIP:
            b_full = _gated_chunk_gam(g, A_log, dt_bias, lower_bound, i_hv, T, o_k, m_k, HV, K, BT, GATE, HAS_A,
                                      HAS_BIAS)  # [BT, BKA]
            b_gi = _row_block(b_full, i_blk, BT // BC, BC, BKA)
            b_gm = _row(b_gi, BC // 2, BC)
            b_gl = _row(b_full, BT - 1, BT)
            if CW == BT:
                b_gj = b_full
            else:
                b_gj = _row_block(b_full, 0, BT // CW, CW, BKA)
            if FLAG:
                # as gam_fwd.py's reader does: gam falls down each column, so its spread from
                # the middle row is largest at the first or last row
                b_mid = _row(b_full, BT // 2, BT)
                b_first = _row(b_full, 0, BT)
                spread = tl.maximum(spread, tl.max(tl.maximum(b_first - b_mid, b_mid - b_gl), 0))
                tl.store(gam + gam_row(BT - 1, T) * (HV * K) + o_k, b_gl, mask=m_k)
        else:
            b_gm = tl.load(gam + gam_row(i_blk * BC + BC // 2, T) * (HV * K) + o_k, mask=m_k, other=0.0)
            b_gi = tl.load(gam + gam_row(o_i, T)[:, None] * (HV * K) + o_k[None, :], mask=m_k[None, :], other=0.0)
        b_qi = tl.load(q + o_i[:, None] * (H * K) + o_k[None, :], mask=m_ik, other=0.0).to(tl.float32) * scale
        b_ki = tl.load(k + o_i[:, None] * (H * K) + o_k[None, :], mask=m_ik, other=0.0).to(tl.float32)
        if store_qg:
            tl.store(qg + p_ik, as_stored(b_qi * exp(b_gi, FAST_EXP), qg, INTERPRET).to(qg.dtype.element_ty), mask=m_ik)
        if store_kr:
            if not GAM_ON_CHIP:
                b_gl = tl.load(gam + gam_row(BT - 1, T) * (HV * K) + o_k, mask=m_k, other=0.0)
            tl.store(kr + p_ik, as_stored(b_ki * exp(b_gl[None, :] - b_gi, FAST_EXP), kr,
                                          INTERPRET).to(kr.dtype.element_ty), mask=m_ik)
        if KBG:
            # the product in intra_wu_fwd's order (beta, then K, then exp(gam)): the fp32 value
            # it forms, stored in kbg's dtype (bf16), the one difference W's dot then sees
            b_kb = b_beta[:, None] * b_ki * exp(b_gi, FAST_EXP)
            tl.store(kbg + p_ik, as_stored(b_kb, kbg, INTERPRET).to(kbg.dtype.element_ty), mask=m_ik)
        b_ei = exp(b_gi - b_gm[None, :], FAST_EXP)
        b_kj = tl.load(k + o_j[:, None] * (H * K) + o_k[None, :], mask=m_j[:, None] & m_k[None, :],
                       other=0.0).to(tl.float32)
        if not GAM_ON_CHIP:
            b_gj = tl.load(gam + gam_row(o_j, T)[:, None] * (HV * K) + o_k[None, :], mask=m_k[None, :], other=0.0)
        b_kc = tl.trans(b_kj * exp(tl.where(upto[:, None], b_gm[None, :] - b_gj, float("-inf")), FAST_EXP))
        b_akk += tl.dot(b_ki * b_ei, b_kc, input_precision=DOT_PREC)
        b_aqk += tl.dot(b_qi * b_ei, b_kc, input_precision=DOT_PREC)
    if FLAG:
        tl.store(p_flag, tl.where(spread <= MAX_SPLIT, 0, 1).to(tl.int32))
    p_a = o_i[:, None] * (HV * BT) + o_j[None, :]
    tl.store(akk + p_a, as_stored(tl.where(o_i[:, None] > o_j[None, :], b_akk, 0.0), akk,
                                  INTERPRET).to(akk.dtype.element_ty), mask=m_i[:, None])
    tl.store(aqk + p_a, as_stored(tl.where(o_i[:, None] >= o_j[None, :], b_aqk, 0.0), aqk,
                                  INTERPRET).to(aqk.dtype.element_ty), mask=m_i[:, None])
    if CW < BT:  # every byte of the rows written (kept intermediates): the columns from CW zero
        o_z = tl.arange(0, BT)  # (BT - CW need not be a power of two)
        p_z = o_i[:, None] * (HV * BT) + o_z[None, :]
        m_z = m_i[:, None] & (o_z >= CW)[None, :]
        b_z = tl.zeros([BC, BT], dtype=tl.float32)
        tl.store(akk + p_z, b_z.to(akk.dtype.element_ty), mask=m_z)
        tl.store(aqk + p_z, b_z.to(aqk.dtype.element_ty), mask=m_z)


@triton.jit
def _gated_chunk_gam(g, A_log, dt_bias, lower_bound, i_hv, T, o_k, m_k, HV, K: tl.constexpr, BT: tl.constexpr,
                     GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The chunk's gam [BT, len(o_k)] for the K slice ``o_k`` from the raw gate, as gam_fwd.py
    forms it: the gate on the raw tile, rows past the end (and columns past K) 0, so that their
    gam repeats the last row's, then a cumsum down the rows. ``g``: at the chunk's first row
    and this head."""
    o_t = tl.arange(0, BT)
    m_tk = (o_t < T)[:, None] & m_k[None, :]
    b_g = tl.load(g + o_t[:, None] * (HV * K) + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    b_a, b_bias = gate_params(A_log, dt_bias, i_hv, o_k, m_k, K, HAS_A, HAS_BIAS)
    return tl.cumsum(tl.where(m_tk, gate_fwd(b_g, b_a, b_bias, lower_bound, GATE), 0.0), axis=0)


@triton.jit
def _row_block(b_x, i_b, NB: tl.constexpr, RB: tl.constexpr, BKA: tl.constexpr):
    """Rows [i_b * RB, (i_b + 1) * RB) of ``b_x`` [NB * RB, BKA], exactly (the other blocks
    summed in as zeros)."""
    b_3 = tl.reshape(b_x, (NB, RB, BKA))
    return tl.sum(tl.where((tl.arange(0, NB) == i_b)[:, None, None], b_3, 0.0), 0)


@triton.jit
def _row(b_x, r, R: tl.constexpr):
    """Row ``r`` of ``b_x`` [R, columns], exactly."""
    return tl.sum(tl.where((tl.arange(0, R) == r)[:, None], b_x, 0.0), 0)
