"""Stage 2 of the backward, second half, by row blocks (settings.INTRA_BWD_A_ROW_PROGRAMS).

The work of intra_bwd_a.py's block-reference path, for inputs whose every chunk can
take block references: fla's bounded gate (``lower_bound * sigmoid(...)`` with
``lower_bound <= 0``, every log decay in [lower_bound, 0], and BC / 2 * |lower_bound|
below MAX_SPLIT, so that gam strays at most that far from any BC-row block's middle
row). intra_bwd_a.py walks a chunk's BT / BC row blocks in one program (255 registers
and kilobytes of spills on sm_90a); here each block has a program of its own, as fla's
``chunk_kda_bwd_kernel_intra`` does, and the chunk's reverse cumulative sum of d(gam)
moves to a second, small launch.

kda_intra_bwd_a_rows_kernel, one program per (row block b and K slice of BKD, chunk,
batch * value head), m the middle row of block b:
  its rows i:     T_q[i] = exp(gam_i - gam_m) sum_j dA_qk[i, j] K_j exp(gam_m - gam_j)
                  (j up to the block's end: exp(gam_m - gam_j) <= 1 before the block, within
                  the bound in it; dA is zero above its diagonal), T_k alike with dA_kk;
  its columns j:  T_kj[j] = exp(gam_m - gam_j) sum_r (dA_qk[r, j] Q_r + dA_kk[r, j] K_r) exp(gam_r - gam_m)
                  over the rows r from the block's start (exp(gam_r - gam_m) within the bound
                  before m, <= 1 after it): one reference for every row after the block,
                  where intra_bwd_a.py takes each row block's own;
then dq += T_q, dk += T_k + T_kj and d(gam) += Q T_q + K (T_k - T_kj) of its rows, d(gam)
written back in place for:

kda_dg_of_chunk_kernel, one program per (K slice, chunk, batch * value head): dg = the
reverse cumulative sum of d(gam) over the chunk's rows plus dGam, on through fla's gate
with the chunk's partial sums for d(dt_bias) and d(A_log) (intra_bwd_a._dg_of_chunk).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._gate import gate_params
from ._indexing import chunk_coords, gam_row, row_block_slice
from ._math import exp
from .intra_bwd_a import _dg_of_chunk, store_dq_dk


@triton.jit
def kda_intra_bwd_a_rows_kernel(
    q, k, gam, dakk, daqk,
    dq, dk, dgam, dq_out, dk_out, out_scale,  # dq_out, dk_out, out_scale: intra_bwd_a.store_dq_dk
    cu_seqlens, chunk_index,  # varlen (IS_VARLEN): _indexing.py
    scale, T, NC,
    H, HV,  # runtime: one compiled kernel serves every head count
    K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BKD: tl.constexpr,
    DOT_PREC: tl.constexpr, IS_VARLEN: tl.constexpr = False, FAST_EXP: tl.constexpr = False,
    DIRECT_OUT: tl.constexpr = False,  # intra_bwd_a.store_dq_dk
    SUB_BLOCKS: tl.constexpr = False,
):
    # FAST_EXP: _math.exp without subnormals.
    # SUB_BLOCKS (settings.INTRA_BWD_A_ROWS_SUB_BLOCKS): the sums over the chunk's rows
    # walked BC rows at a time, only where they can be nonzero (the block's rows: the row
    # blocks up to its own; its columns: from its own to the chunk's last), instead of one
    # dot over all BT rows with the rest masked to zero: five BC-row blocks of Q, K, gam and
    # their exps a program instead of eight, on [BC, BKD] tiles.
    # The K slice varies fastest, then the row block (both on the grid's first axis, so
    # the chunks keep the second, limited to 65535 as elsewhere): the programs of one
    # chunk run side by side and share their loads of Q, K, gam and dA through L2.
    NKS: tl.constexpr = (K + BKD - 1) // BKD
    i_s = tl.program_id(0) % NKS
    i_blk = tl.program_id(0) // NKS
    i_c = tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    i_b, i_hv, i_h, bos, T, g_c, s_c = chunk_coords(i_c, i_bh, T, NC, H, HV, cu_seqlens, chunk_index, BT, IS_VARLEN)
    # a block past the chunk's rows (short or last chunks; an unused slot, T <= 0): nothing
    if i_blk * BC >= T:
        return
    # Each pointer moves to this chunk and head once, in 64-bit (bos: the chunk's
    # first row); offsets inside the chunk are 32-bit at any T.
    q += (bos * H + i_h) * K
    k += (bos * H + i_h) * K
    gam += (bos * HV + i_hv) * K
    dakk += (bos * HV + i_hv) * BT
    daqk += (bos * HV + i_hv) * BT
    dq += (bos * HV + i_hv) * K
    dk += (bos * HV + i_hv) * K
    if DIRECT_OUT:  # the op's [B, T, H, K] dq, dk (G = 1: H = HV)
        dq_out += (bos * HV + i_hv) * K
        dk_out += (bos * HV + i_hv) * K
    dgam += (bos * HV + i_hv) * K

    o_s = i_s * BKD + tl.arange(0, BKD)
    m_s = o_s < K
    o_r = tl.arange(0, BT)
    m_t = o_r < T
    o_i = i_blk * BC + tl.arange(0, BC)  # the block's rows, and as columns
    m_i = o_i < T
    m_is = m_i[:, None] & m_s[None, :]

    if not SUB_BLOCKS:  # the chunk's slice
        _, _, b_q, b_k, b_g = row_block_slice(q, k, gam, o_r, m_t, i_s, scale, T, H, HV, K, BKD)
    # the block's rows of it
    _, _, b_qi, b_ki, b_gi = row_block_slice(q, k, gam, o_i, m_i, i_s, scale, T, H, HV, K, BKD)
    b_gm = tl.load(gam + gam_row(i_blk * BC + BC // 2, T) * (HV * K) + o_s, mask=m_s, other=0.0)
    if SUB_BLOCKS:
        b_tq, b_tk, b_tkj = _row_block_terms_by_sub_blocks(
            q, k, gam, daqk, dakk, b_gm, b_gi, i_s, o_s, m_s, o_i, m_i, i_blk, T, scale,
            H, HV, K, BT, BC, BKD, DOT_PREC, FAST_EXP)
    else:
        # the block's rows: columns up to its end (past it dA is zero, the factor dropped)
        p_rows = (o_i[:, None]) * (HV * BT) + o_r[None, :]
        b_dqk_i = tl.load(daqk + p_rows, mask=m_i[:, None], other=0.0)
        b_dkk_i = tl.load(dakk + p_rows, mask=m_i[:, None], other=0.0)
        b_kc = b_k * exp(tl.where((o_r < (i_blk + 1) * BC)[:, None], b_gm[None, :] - b_g, float("-inf")), FAST_EXP)
        b_eri = exp(b_gi - b_gm[None, :], FAST_EXP)
        b_tq = b_eri * tl.dot(b_dqk_i, b_kc, input_precision=DOT_PREC)
        b_tk = b_eri * tl.dot(b_dkk_i, b_kc, input_precision=DOT_PREC)

        # the block's columns: rows from its start (before it dA is zero, and the factor,
        # which could overflow there, is dropped)
        from_blk = (o_r >= i_blk * BC)[:, None]
        b_er = exp(tl.where(from_blk, b_g - b_gm[None, :], float("-inf")), FAST_EXP)
        p_cols = (o_r[:, None]) * (HV * BT) + o_i[None, :]
        m_cols = m_t[:, None] & from_blk
        b_dqk_j = tl.load(daqk + p_cols, mask=m_cols, other=0.0)
        b_dkk_j = tl.load(dakk + p_cols, mask=m_cols, other=0.0)
        b_tkj = exp(b_gm[None, :] - b_gi, FAST_EXP) * (tl.dot(tl.trans(b_dqk_j), b_q * b_er, input_precision=DOT_PREC)
                                                      + tl.dot(tl.trans(b_dkk_j), b_k * b_er, input_precision=DOT_PREC))

    row_is = (o_i[:, None]) * (HV * K) + o_s[None, :]
    b_dq = tl.load(dq + row_is, mask=m_is, other=0.0) + b_tq
    b_dk = tl.load(dk + row_is, mask=m_is, other=0.0) + b_tk + b_tkj
    b_dgam = tl.load(dgam + row_is, mask=m_is, other=0.0) + b_qi * b_tq + b_ki * (b_tk - b_tkj)
    store_dq_dk(dq, dk, dq_out, dk_out, out_scale, row_is, m_is, b_dq, b_dk, DIRECT_OUT)
    tl.store(dgam + row_is, b_dgam, mask=m_is)


@triton.jit
def _row_block_terms_by_sub_blocks(q, k, gam, daqk, dakk, b_gm, b_gi, i_s, o_s, m_s, o_i, m_i, i_blk, T, scale,
                                   H, HV, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BKD: tl.constexpr,
                                   DOT_PREC: tl.constexpr, FAST_EXP: tl.constexpr):
    """T_q, T_k and T_kj of the block's rows (SUB_BLOCKS): the sums over the chunk's rows
    BC rows at a time, only over the row blocks where dA can be nonzero."""
    b_tq = tl.zeros([BC, BKD], dtype=tl.float32)
    b_tk = tl.zeros([BC, BKD], dtype=tl.float32)
    # the block's rows: columns in the row blocks up to its own (exp(gam_m - gam_j) <= 1
    # before the block, within the bound in it)
    for jb in range(0, i_blk + 1):
        o_j = jb * BC + tl.arange(0, BC)
        m_js = (o_j < T)[:, None] & m_s[None, :]
        b_kj = tl.load(k + (o_j[:, None]) * (H * K) + o_s[None, :], mask=m_js, other=0.0).to(tl.float32)
        b_gj = tl.load(gam + (gam_row(o_j, T)[:, None]) * (HV * K) + o_s[None, :], mask=m_s[None, :], other=0.0)
        b_kc = b_kj * exp(b_gm[None, :] - b_gj, FAST_EXP)
        p_rows = (o_i[:, None]) * (HV * BT) + o_j[None, :]
        b_dqk_i = tl.load(daqk + p_rows, mask=m_i[:, None], other=0.0)
        b_dkk_i = tl.load(dakk + p_rows, mask=m_i[:, None], other=0.0)
        b_tq += tl.dot(b_dqk_i, b_kc, input_precision=DOT_PREC)
        b_tk += tl.dot(b_dkk_i, b_kc, input_precision=DOT_PREC)
    b_eri = exp(b_gi - b_gm[None, :], FAST_EXP)
    b_tq = b_eri * b_tq
    b_tk = b_eri * b_tk
    # the block's columns: rows in the row blocks from its own to the chunk's last
    # (exp(gam_r - gam_m) within the bound before m, <= 1 after it)
    b_c = tl.zeros([BC, BKD], dtype=tl.float32)
    for rb in range(i_blk, tl.cdiv(tl.minimum(T, BT), BC)):
        o_r = rb * BC + tl.arange(0, BC)
        m_r = o_r < T
        _, _, b_qr, b_kr, b_gr = row_block_slice(q, k, gam, o_r, m_r, i_s, scale, T, H, HV, K, BKD)
        b_er = exp(b_gr - b_gm[None, :], FAST_EXP)
        p_cols = (o_r[:, None]) * (HV * BT) + o_i[None, :]
        b_dqk_j = tl.load(daqk + p_cols, mask=m_r[:, None], other=0.0)
        b_dkk_j = tl.load(dakk + p_cols, mask=m_r[:, None], other=0.0)
        b_c += tl.dot(tl.trans(b_dqk_j), b_qr * b_er, input_precision=DOT_PREC)
        b_c += tl.dot(tl.trans(b_dkk_j), b_kr * b_er, input_precision=DOT_PREC)
    b_tkj = exp(b_gm[None, :] - b_gi, FAST_EXP) * b_c
    return b_tq, b_tk, b_tkj


@triton.jit
def kda_dg_of_chunk_kernel(
    dgam, dgam_last, dg,
    g, A_log, dt_bias, lower_bound, ddt_part, dla_part,
    cu_seqlens, chunk_index,  # varlen (IS_VARLEN): _indexing.py
    T, NC,
    H, HV,  # runtime: one compiled kernel serves every head count
    K: tl.constexpr, BT: tl.constexpr, BKD: tl.constexpr,
    GATE: tl.constexpr = 0, HAS_A: tl.constexpr = False, HAS_BIAS: tl.constexpr = False,
    IS_VARLEN: tl.constexpr = False,
):
    i_s = tl.program_id(0)
    i_c = tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    i_b, i_hv, i_h, bos, T, g_c, s_c = chunk_coords(i_c, i_bh, T, NC, H, HV, cu_seqlens, chunk_index, BT, IS_VARLEN)
    dgam_last += (g_c * HV + i_hv) * K
    o_s = i_s * BKD + tl.arange(0, BKD)
    m_s = o_s < K
    if GATE:
        ddt_part += (g_c * HV + i_hv) * K
        dla_part += (g_c * HV + i_hv) * K
        b_ga, b_gbias = gate_params(A_log, dt_bias, i_hv, o_s, m_s, K, HAS_A, HAS_BIAS)
    else:  # unread without the gate
        b_ga = 0.0
        b_gbias = 0.0
    if IS_VARLEN:
        if T <= 0:  # an unused chunk slot: zero gate partial sums (the host sums every slot)
            if GATE:
                tl.store(ddt_part + o_s, tl.zeros([BKD], dtype=tl.float32), mask=m_s)
                tl.store(dla_part + o_s, tl.zeros([BKD], dtype=tl.float32), mask=m_s)
            return
    dgam += (bos * HV + i_hv) * K
    dg += (bos * HV + i_hv) * K
    if GATE:
        g += (bos * HV + i_hv) * K  # the raw gate: dg's layout
    o_t = tl.arange(0, BT)
    m_ts = (o_t < T)[:, None] & m_s[None, :]
    row_ts = (o_t[:, None]) * (HV * K) + o_s[None, :]
    b_dgam = tl.load(dgam + row_ts, mask=m_ts, other=0.0)
    _dg_of_chunk(dg, dgam_last, g, ddt_part, dla_part, row_ts, m_ts, o_s, m_s, b_dgam, b_ga, b_gbias, lower_bound,
                 GATE)
