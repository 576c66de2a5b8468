"""Stage 2 of the backward, second part: dv, dbeta and the grads of the A's.

One program per (chunk, batch * value head). Through U = Tm diag(beta) V and
O = ... + A_qk U' it forms dv, dA_qk and the V share of dTm and dbeta, adds the
K slices' shares (intra_bwd_w.py), and through Tm = (I + diag(beta) A_kk)^-1,
dM = -Tm^T dTm Tm^T, gives dA_kk = diag(beta) dM and the rest of dbeta.
intra_bwd_a.py takes both dA's back through A_kk and A_qk.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._dot import dot_bf16
from ._indexing import chunk_coords


@triton.jit
def kda_intra_bwd_kernel(
    v, beta, akk, tm, up, dup, do, dtm_part, dbeta_part,
    dv, dbeta, dakk, daqk,
    cu_seqlens, chunk_index,  # varlen (IS_VARLEN): _indexing.py
    T, NC,
    H, HV,  # runtime: one compiled kernel serves every head count
    V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, NS: tl.constexpr,
    DOT_PREC: tl.constexpr,
    IS_VARLEN: tl.constexpr = False, BF16_DAQK: tl.constexpr = False, INTERPRET: tl.constexpr = False,
    UP_IN_REGISTERS: tl.constexpr = False, BF16_TDU: tl.constexpr = False,
):
    # BF16_DAQK (settings.INTRA_BWD_BF16_DAQK; dO and U' both stored in bf16): dO U'^T on
    # bf16 operands, the same products as at TF32, accumulated in fp32; dO and U' stay
    # bf16 in registers.
    # UP_IN_REGISTERS (Triton < 3.9, _compat.fences_wgmma_after_cp_async): U' passes
    # through registers (an identity where on its rows) before dO U'^T, so that the tile
    # the dot reads is stored by this program and Triton fences it; otherwise, on fp16
    # inputs, the wgmma read U' straight from the tile cp.async wrote, unfenced.
    # BF16_TDU (_contract.BF16_TM with settings.BF16_DUP: Tm and dU' both stored in bf16):
    # Tm^T dU' on bf16 operands (exact products, fp32 sums; dU' through registers where
    # UP_IN_REGISTERS says why), so that dU' needs no fp32 copy for it.
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_hv, i_h, bos, T, g_c, s_c = chunk_coords(i_c, i_bh, T, NC, H, HV, cu_seqlens, chunk_index, BT, IS_VARLEN)
    if IS_VARLEN:
        if T <= 0:  # an unused chunk slot (past the last sequence's chunks): nothing to compute
            return
    # Each pointer moves to this chunk and head once, in 64-bit (bos: the chunk's
    # first row); offsets inside the chunk are 32-bit at any T.
    v += (bos * HV + i_hv) * V
    up += (bos * HV + i_hv) * V
    dup += (bos * HV + i_hv) * V
    do += (bos * HV + i_hv) * V
    dv += (bos * HV + i_hv) * V
    beta += bos * HV + i_hv
    dbeta += bos * HV + i_hv
    akk += (bos * HV + i_hv) * BT
    tm += (bos * HV + i_hv) * BT
    dakk += (bos * HV + i_hv) * BT
    daqk += (bos * HV + i_hv) * BT
    dtm_part += (bos * HV + i_hv) * NS * BT  # [B, T, HV, NS, BT]
    dbeta_part += (bos * HV + i_hv) * NS  # [B, T, HV, NS]

    o_r = tl.arange(0, BT)
    o_t = o_r
    m_t = o_t < T
    row_c = (o_t[:, None]) * (HV * BT) + o_r[None, :]

    b_beta = tl.load(beta + o_t * HV, mask=m_t, other=0.0).to(tl.float32)
    b_tm = tl.load(tm + row_c, mask=m_t[:, None], other=0.0)  # (bf16 under _contract.BF16_TM)
    if BF16_TDU:
        b_tm_stored = b_tm
    b_tm = b_tm.to(tl.float32)

    # ---- over V: dA_qk, dv, dbeta and dTm from U = Tm diag(beta) V
    b_daqk = tl.zeros([BT, BT], dtype=tl.float32)
    b_dtm = tl.zeros([BT, BT], dtype=tl.float32)
    b_dbeta = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        row_v = (o_t[:, None]) * (HV * V) + o_v[None, :]
        b_do = tl.load(do + row_v, mask=m_tv, other=0.0)
        b_up = tl.load(up + row_v, mask=m_tv, other=0.0)
        b_dup = tl.load(dup + row_v, mask=m_tv, other=0.0)  # (bf16 under settings.BF16_DUP)
        if not BF16_TDU:
            b_dup = b_dup.to(tl.float32)
        b_v = tl.load(v + row_v, mask=m_tv, other=0.0).to(tl.float32)
        if BF16_DAQK:
            b_daqk += dot_bf16(b_do, tl.trans(b_up), INTERPRET)
        else:
            if UP_IN_REGISTERS:
                b_up = tl.where(m_t[:, None], b_up, 0.0)  # rows past the end: zero already
            b_daqk += tl.dot(b_do.to(tl.float32), tl.trans(b_up.to(tl.float32)), input_precision=DOT_PREC)
        if BF16_TDU:
            if UP_IN_REGISTERS:
                b_dup = tl.where(m_t[:, None], b_dup, 0.0)  # rows past the end: zero already
            b_tdu = dot_bf16(tl.trans(b_tm_stored), b_dup, INTERPRET)
            b_dup = b_dup.to(tl.float32)
        else:
            b_tdu = tl.dot(tl.trans(b_tm), b_dup, input_precision=DOT_PREC)
        tl.store(dv + row_v, (b_beta[:, None] * b_tdu).to(dv.dtype.element_ty), mask=m_tv)
        b_dbeta += tl.sum(b_v * b_tdu, 1)
        b_dtm += tl.dot(b_dup, tl.trans(b_beta[:, None] * b_v), input_precision=DOT_PREC)
    b_daqk = tl.where(m_t[:, None] & (o_r[:, None] >= o_r[None, :]), b_daqk, 0.0)

    # ---- the K slices' shares of dTm and dbeta (intra_bwd_w.py; rows past the end: zero)
    for i_s in range(NS):
        b_dtm += tl.load(dtm_part + o_t[:, None] * (HV * NS * BT) + i_s * BT + o_r[None, :], mask=m_t[:, None],
                         other=0.0)
        b_dbeta += tl.load(dbeta_part + o_t * (HV * NS) + i_s, mask=m_t, other=0.0)

    # ---- Tm = (I + M)^-1  =>  dM = -Tm^T dTm Tm^T; M = diag(beta) A_kk
    b_dm = -tl.dot(tl.dot(tl.trans(b_tm), b_dtm, input_precision=DOT_PREC), tl.trans(b_tm), input_precision=DOT_PREC)
    b_dm = tl.where(m_t[:, None] & (o_r[:, None] > o_r[None, :]), b_dm, 0.0)
    b_akk = tl.load(akk + row_c, mask=m_t[:, None] & (o_r[:, None] > o_r[None, :]), other=0.0)
    b_dbeta += tl.sum(b_dm * b_akk, 1)
    tl.store(dbeta + o_t * HV, b_dbeta.to(dbeta.dtype.element_ty), mask=m_t)
    tl.store(dakk + row_c, b_beta[:, None] * b_dm, mask=m_t[:, None])
    tl.store(daqk + row_c, b_daqk, mask=m_t[:, None])
