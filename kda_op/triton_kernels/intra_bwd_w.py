"""Stage 2 of the backward, first part: back through the chunk's states and W,
one slice of K (BKS wide) per program.

One program per (chunk, batch * value head, K slice). From the residuals U',
their grads dU', the chunk's saved state S0 and the grad dS_C of its end state:
  O = (Q * exp(gam)) S0 + ...,   S_C = exp(Gam) S0 + (K * exp(Gam - gam))^T U',
  W = Tm diag(beta) (K * exp(gam)),   U' = U - W S0
give the partial dq, dk, d(gam) of the slice (fp32, per value head), its d(Gam)
(the chunk's last row), and its share of dTm and dbeta, which intra_bwd.py sums
over the slices (slices, not the whole of K, per program: more programs in
flight and fewer registers each).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._dot import dot_bf16
from ._math import exp
from ._indexing import chunk_coords, chunk_in_sequence, gam_row


@triton.jit
def kda_intra_bwd_w_kernel(
    q, k, beta, gam, tm, up, dup, chunk_states, dchunk_states, do,
    dq, dk, dgam, dgam_last, dtm_part, dbeta_part,
    cu_seqlens, chunk_index,  # varlen (IS_VARLEN): _indexing.py
    ds_offsets,  # COMPACT: each sequence's first dS_C slot (state_bwd.py; a stand-in otherwise)
    scale, T, NC,
    H, HV,  # runtime: one compiled kernel serves every head count
    K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr,
    DOT_PREC: tl.constexpr,
    IS_VARLEN: tl.constexpr = False, HAS_H0: tl.constexpr = True, HAS_DHT: tl.constexpr = True,
    COMPACT: tl.constexpr = False, BF16_DQG: tl.constexpr = False, INTERPRET: tl.constexpr = False,
    BF16_DKR: tl.constexpr = False, FAST_EXP: tl.constexpr = False, STATES_IN_REGISTERS: tl.constexpr = False,
    EARLY_QKG: tl.constexpr = False, BF16_DW: tl.constexpr = False,
):
    # FAST_EXP: _math.exp without subnormals.
    # BF16_DQG (settings.INTRA_BWD_W_BF16_DQG): dO and the chunk states both hold bf16
    # (bf16 inputs and chunk states): dO S0^T on bf16 operands, the same products as
    # at TF32 (bf16 values are exact in both), accumulated in fp32. BF16_DKR
    # (settings.INTRA_BWD_W_BF16_DKR): likewise U' dS_C^T where U' and dS_C both hold
    # bf16. BF16_DW (settings.BF16_DUP): dU' and S0 both stored in bf16, dU' S0^T on bf16
    # operands (the same products as at TF32), else TF32 on dU' as stored.
    # The K slice varies fastest over the grid: the slices of one chunk run side by
    # side and share their loads of dO, U', dU', Tm through L2.
    i_s = tl.program_id(0)
    i_c = tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    i_b, i_hv, i_h, bos, T, g_c, s_c = chunk_coords(i_c, i_bh, T, NC, H, HV, cu_seqlens, chunk_index, BT, IS_VARLEN)
    if IS_VARLEN:
        if T <= 0:  # an unused chunk slot (past the last sequence's chunks): nothing to compute
            return
    # Each pointer moves to this chunk and head once, in 64-bit (bos: the chunk's
    # first row); offsets inside the chunk are 32-bit at any T.
    q += (bos * H + i_h) * K
    k += (bos * H + i_h) * K
    up += (bos * HV + i_hv) * V
    dup += (bos * HV + i_hv) * V
    do += (bos * HV + i_hv) * V
    beta += bos * HV + i_hv
    gam += (bos * HV + i_hv) * K
    tm += (bos * HV + i_hv) * BT
    dq += (bos * HV + i_hv) * K
    dk += (bos * HV + i_hv) * K
    dgam += (bos * HV + i_hv) * K
    i_chunk = g_c * HV + i_hv  # this chunk and head among [B, NC, HV]
    dgam_last += i_chunk * K
    # the slices' shares of dTm and dbeta, per row like the other per-row buffers
    # ([B, T, HV, NS, BT] and [B, T, HV, NS]): no rows past a short chunk's end
    NS = tl.num_programs(0)
    dtm_part += ((bos * HV + i_hv) * NS + i_s) * BT
    dbeta_part += (bos * HV + i_hv) * NS + i_s

    o_r = tl.arange(0, BT)
    o_t = o_r
    m_t = o_t < T
    o_s = i_s * BKS + tl.arange(0, BKS)
    m_s = o_s < K
    m_ts = m_t[:, None] & m_s[None, :]
    row_s = (o_t[:, None]) * (HV * K) + o_s[None, :]
    # What is zero and not read: the state entering a sequence's first chunk without an
    # initial state (S0), and the grad of the state leaving its last chunk without a
    # final-state grad (dS_C; state_bwd.py does not store it for packed sequences).
    # Both at once (a sequence of one chunk): every output of the slice is zero.
    c_seq = chunk_in_sequence(i_c, chunk_index, IS_VARLEN)
    need_s0 = (c_seq > 0) | HAS_H0
    need_dsc = (T > BT) | HAS_DHT
    if need_s0 | need_dsc:
        # as block masks (Triton >= 3.7's interpreter refuses a block & scalar mask)
        use_s0 = (need_s0.to(tl.int32) + 0 * o_s) > 0
        use_dsc = (need_dsc.to(tl.int32) + 0 * o_s) > 0
        s0_base = chunk_states + (s_c * HV + i_hv) * K * V
        if COMPACT:  # chunk c's dS_C: slot c of its sequence's (read only where c is not the last)
            dsc_base = dchunk_states + ((tl.load(ds_offsets + i_b) + c_seq) * HV + i_hv) * K * V
        else:
            dsc_base = dchunk_states + i_chunk * K * V
        p_qk = (o_t[:, None]) * (H * K) + o_s[None, :]
        p_gam = (gam_row(o_t, T)[:, None]) * (HV * K) + o_s[None, :]
        if EARLY_QKG:  # (settings.INTRA_BWD_W_EARLY_QKG) in flight while the V loop runs
            b_q, b_k, b_gam = _qkg_slice(q, k, gam, p_qk, p_gam, m_ts, m_s)
        b_dqg = tl.zeros([BT, BKS], dtype=tl.float32)
        b_dkr = tl.zeros([BT, BKS], dtype=tl.float32)
        b_dw = tl.zeros([BT, BKS], dtype=tl.float32)
        b_dglast = tl.zeros([BKS], dtype=tl.float32)
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < V
            m_tv = m_t[:, None] & m_v[None, :]
            row_v = (o_t[:, None]) * (HV * V) + o_v[None, :]
            b_do = tl.load(do + row_v, mask=m_tv, other=0.0)
            b_up = tl.load(up + row_v, mask=m_tv, other=0.0)
            b_dup = tl.load(dup + row_v, mask=m_tv, other=0.0)
            sv = o_s[:, None] * V + o_v[None, :]
            m_sv = m_s[:, None] & m_v[None, :]
            b_s0 = tl.load(s0_base + sv, mask=m_sv & use_s0[:, None], other=0.0)
            b_dsc = tl.load(dsc_base + sv, mask=m_sv & use_dsc[:, None], other=0.0)
            if STATES_IN_REGISTERS:
                # S0 and dS_C through registers (an identity: columns past K are zero
                # already), so that each bf16 dot's transposed operand is a tile this
                # program stored, which Triton < 3.9 fences (the V loop's loads ahead
                # come by cp.async: _compat.fences_wgmma_after_cp_async)
                b_s0 = tl.where(m_s[:, None], b_s0, 0.0)
                b_dsc = tl.where(m_s[:, None], b_dsc, 0.0)
            if BF16_DQG:
                b_dqg += dot_bf16(b_do, tl.trans(b_s0), INTERPRET)
            else:
                b_dqg += tl.dot(b_do.to(tl.float32), tl.trans(b_s0.to(tl.float32)), input_precision=DOT_PREC)
            if BF16_DW:
                b_dw -= dot_bf16(b_dup, tl.trans(b_s0), INTERPRET)
            b_s0 = b_s0.to(tl.float32)
            if BF16_DKR:
                b_dkr += dot_bf16(b_up, tl.trans(b_dsc), INTERPRET)
            else:
                b_dkr += tl.dot(b_up.to(tl.float32), tl.trans(b_dsc.to(tl.float32)), input_precision=DOT_PREC)
            if not BF16_DW:
                b_dw -= tl.dot(b_dup.to(tl.float32), tl.trans(b_s0), input_precision=DOT_PREC)
            b_dglast += tl.sum(b_s0 * b_dsc.to(tl.float32), 1)

        if not EARLY_QKG:
            b_q, b_k, b_gam = _qkg_slice(q, k, gam, p_qk, p_gam, m_ts, m_s)
        b_q = b_q.to(tl.float32) * scale
        b_k = b_k.to(tl.float32)
        b_glast = tl.load(gam + gam_row(BT - 1, T) * (HV * K) + o_s, mask=m_s, other=0.0)
        b_eg = exp(b_gam, FAST_EXP)
        b_kg = b_k * b_eg
        b_rf = exp(b_glast[None, :] - b_gam, FAST_EXP)
        b_kr = b_k * b_rf

        # O = Qg S0 + ...; S_C = exp(Gam) S0 + Kr^T U'
        b_dq = b_dqg * b_eg
        b_dgam = b_dqg * b_q * b_eg
        b_dk = b_dkr * b_rf
        b_dgam -= b_dkr * b_kr
        b_dglast = b_dglast * tl.exp(b_glast) + tl.sum(b_dkr * b_kr, 0)
        # W = Tm diag(beta) Kg (beta and Tm loaded here: not live through the V loop)
        b_beta = tl.load(beta + o_t * HV, mask=m_t, other=0.0).to(tl.float32)
        b_tm = tl.load(tm + (o_t[:, None]) * (HV * BT) + o_r[None, :], mask=m_t[:, None],
                       other=0.0).to(tl.float32)  # (bf16 under _contract.BF16_TM)
        b_bkg = b_beta[:, None] * b_kg
        b_dtm = tl.dot(b_dw, tl.trans(b_bkg), input_precision=DOT_PREC)
        b_tdw = tl.dot(tl.trans(b_tm), b_dw, input_precision=DOT_PREC)
        b_dbeta = tl.sum(b_kg * b_tdw, 1)
        b_dkg = b_beta[:, None] * b_tdw
        b_dk += b_dkg * b_eg
        b_dgam += b_dkg * b_kg

        tl.store(dq + row_s, b_dq, mask=m_ts)
        tl.store(dk + row_s, b_dk, mask=m_ts)
        tl.store(dgam + row_s, b_dgam, mask=m_ts)
        tl.store(dgam_last + o_s, b_dglast, mask=m_s)
        # this slice's share of dTm and dbeta (rows past the end are zero: not stored);
        # intra_bwd.py sums the slices
        tl.store(dtm_part + o_t[:, None] * (HV * NS * BT) + o_r[None, :], b_dtm, mask=m_t[:, None])
        tl.store(dbeta_part + o_t * (HV * NS), b_dbeta, mask=m_t)
    else:
        b_zero = tl.zeros([BT, BKS], dtype=tl.float32)
        tl.store(dq + row_s, b_zero, mask=m_ts)
        tl.store(dk + row_s, b_zero, mask=m_ts)
        tl.store(dgam + row_s, b_zero, mask=m_ts)
        tl.store(dgam_last + o_s, tl.zeros([BKS], dtype=tl.float32), mask=m_s)
        tl.store(dtm_part + o_t[:, None] * (HV * NS * BT) + o_r[None, :], tl.zeros([BT, BT], dtype=tl.float32),
                 mask=m_t[:, None])
        tl.store(dbeta_part + o_t * (HV * NS), tl.zeros([BT], dtype=tl.float32), mask=m_t)


@triton.jit
def _qkg_slice(q, k, gam, p_qk, p_gam, m_ts, m_s):
    """The chunk's q, k (as stored) and gam tiles of the K slice."""
    b_q = tl.load(q + p_qk, mask=m_ts, other=0.0)
    b_k = tl.load(k + p_qk, mask=m_ts, other=0.0)
    b_gam = tl.load(gam + p_gam, mask=m_s[None, :], other=0.0)
    return b_q, b_k, b_gam
