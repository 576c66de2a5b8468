"""Stage 2 of the backward, first half: everything inside one chunk but the way
back through A_kk and A_qk. Parallel over chunks.

One program per (chunk, batch * value head). From the residuals U', their grads
dU', the chunk's saved state S0 and the grad dS_C of its end state, it undoes
  U = Tm diag(beta) V,  W = Tm diag(beta) (K * exp(gam)),  Tm = (I + diag(beta) A_kk)^-1,
  O = (Q * exp(gam)) S0 + A_qk U',  S_C = exp(Gam) S0 + (K * exp(Gam - gam))^T U',
writing dv and dbeta, and per value head the partial dq, dk, d(gam) (fp32),
d(Gam) of the chunk's last row, and dA_kk, dA_qk: it runs over slices of K (BKS
wide) while it builds dTm, then dM = -Tm^T dTm Tm^T gives dA_kk.
intra_bwd_a.py takes both dA's back through A_kk and A_qk and finishes dq, dk, dg.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._indexing import sequence_and_heads


@triton.jit
def kda_intra_bwd_kernel(
    q, k, v, beta, gam, akk, tm, up, dup, chunk_states, dchunk_states, do,
    dq, dk, dv, dbeta, dgam, dgam_last, dakk, daqk,
    scale, T, NC,
    H, HV,  # runtime: one compiled kernel serves every head count
    K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_hv, i_h, bos = sequence_and_heads(i_bh, T, H, HV)
    bos_pad = i_b * NC * BT  # where the sequence starts in the padded gam buffer
    # Each pointer moves to this sequence and head once, in 64-bit; offsets inside
    # the sequence stay 32-bit (launch.py checks T * HV * max(K, V, BT) < 2^31).
    q += (bos * H + i_h) * K
    k += (bos * H + i_h) * K
    v += (bos * HV + i_hv) * V
    up += (bos * HV + i_hv) * V
    dup += (bos * HV + i_hv) * V
    do += (bos * HV + i_hv) * V
    dv += (bos * HV + i_hv) * V
    beta += bos * HV + i_hv
    dbeta += bos * HV + i_hv
    gam += (bos_pad * HV + i_hv) * K
    akk += (bos * HV + i_hv) * BT
    tm += (bos * HV + i_hv) * BT
    dakk += (bos * HV + i_hv) * BT
    daqk += (bos * HV + i_hv) * BT
    dq += (bos * HV + i_hv) * K
    dk += (bos * HV + i_hv) * K
    dgam += (bos * HV + i_hv) * K
    dgam_last += ((i_b * NC + i_c) * HV + i_hv) * K
    t0 = i_c * BT

    o_r = tl.arange(0, BT)
    o_t = t0 + o_r
    m_t = o_t < T
    s0_base = chunk_states + ((i_b * (NC + 1) + i_c) * HV + i_hv) * K * V
    dsc_base = dchunk_states + ((i_b * NC + i_c) * HV + i_hv) * K * V
    row_c = (o_t[:, None]) * (HV * BT) + o_r[None, :]

    b_beta = tl.load(beta + o_t * HV, mask=m_t, other=0.0).to(tl.float32)
    b_tm = tl.load(tm + row_c, mask=m_t[:, None], other=0.0)

    # ---- over V: dA_qk, dv, dbeta and dTm from U = Tm diag(beta) V
    b_daqk = tl.zeros([BT, BT], dtype=tl.float32)
    b_dtm = tl.zeros([BT, BT], dtype=tl.float32)
    b_dbeta = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        row_v = (o_t[:, None]) * (HV * V) + o_v[None, :]
        b_do = tl.load(do + row_v, mask=m_tv, other=0.0).to(tl.float32)
        b_up = tl.load(up + row_v, mask=m_tv, other=0.0)
        b_dup = tl.load(dup + row_v, mask=m_tv, other=0.0)
        b_v = tl.load(v + row_v, mask=m_tv, other=0.0).to(tl.float32)
        b_daqk += tl.dot(b_do, tl.trans(b_up), input_precision=DOT_PREC)
        b_tdu = tl.dot(tl.trans(b_tm), b_dup, input_precision=DOT_PREC)
        tl.store(dv + row_v, (b_beta[:, None] * b_tdu).to(dv.dtype.element_ty), mask=m_tv)
        b_dbeta += tl.sum(b_v * b_tdu, 1)
        b_dtm += tl.dot(b_dup, tl.trans(b_beta[:, None] * b_v), input_precision=DOT_PREC)
    b_daqk = tl.where(m_t[:, None] & (o_r[:, None] >= o_r[None, :]), b_daqk, 0.0)

    # ---- pass 1 over K slices: everything but the A's
    for i_s in range(tl.cdiv(K, BKS)):
        o_s = i_s * BKS + tl.arange(0, BKS)
        m_s = o_s < K
        m_ts = m_t[:, None] & m_s[None, :]
        b_dqg = tl.zeros([BT, BKS], dtype=tl.float32)
        b_dkr = tl.zeros([BT, BKS], dtype=tl.float32)
        b_dw = tl.zeros([BT, BKS], dtype=tl.float32)
        b_dglast = tl.zeros([BKS], dtype=tl.float32)
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < V
            m_tv = m_t[:, None] & m_v[None, :]
            row_v = (o_t[:, None]) * (HV * V) + o_v[None, :]
            b_do = tl.load(do + row_v, mask=m_tv, other=0.0).to(tl.float32)
            b_up = tl.load(up + row_v, mask=m_tv, other=0.0)
            b_dup = tl.load(dup + row_v, mask=m_tv, other=0.0)
            sv = o_s[:, None] * V + o_v[None, :]
            m_sv = m_s[:, None] & m_v[None, :]
            b_s0 = tl.load(s0_base + sv, mask=m_sv, other=0.0)
            b_dsc = tl.load(dsc_base + sv, mask=m_sv, other=0.0)
            b_dqg += tl.dot(b_do, tl.trans(b_s0), input_precision=DOT_PREC)
            b_dkr += tl.dot(b_up, tl.trans(b_dsc), input_precision=DOT_PREC)
            b_dw -= tl.dot(b_dup, tl.trans(b_s0), input_precision=DOT_PREC)
            b_dglast += tl.sum(b_s0 * b_dsc, 1)

        b_q = tl.load(q + (o_t[:, None]) * (H * K) + o_s[None, :], mask=m_ts, other=0.0).to(tl.float32) * scale
        b_k = tl.load(k + (o_t[:, None]) * (H * K) + o_s[None, :], mask=m_ts, other=0.0).to(tl.float32)
        b_gam = tl.load(gam + (o_t[:, None]) * (HV * K) + o_s[None, :], mask=m_s[None, :], other=0.0)
        b_glast = tl.load(gam + (t0 + BT - 1) * (HV * K) + o_s, mask=m_s, other=0.0)
        b_eg = tl.exp(b_gam)
        b_kg = b_k * b_eg
        b_rf = tl.exp(b_glast[None, :] - b_gam)
        b_kr = b_k * b_rf

        # O = Qg S0 + ...; S_C = exp(Gam) S0 + Kr^T U'
        b_dq = b_dqg * b_eg
        b_dgam = b_dqg * b_q * b_eg
        b_dk = b_dkr * b_rf
        b_dgam -= b_dkr * b_kr
        b_dglast = b_dglast * tl.exp(b_glast) + tl.sum(b_dkr * b_kr, 0)
        # W = Tm diag(beta) Kg
        b_bkg = b_beta[:, None] * b_kg
        b_dtm += tl.dot(b_dw, tl.trans(b_bkg), input_precision=DOT_PREC)
        b_tdw = tl.dot(tl.trans(b_tm), b_dw, input_precision=DOT_PREC)
        b_dbeta += tl.sum(b_kg * b_tdw, 1)
        b_dkg = b_beta[:, None] * b_tdw
        b_dk += b_dkg * b_eg
        b_dgam += b_dkg * b_kg

        row_s = (o_t[:, None]) * (HV * K) + o_s[None, :]
        tl.store(dq + row_s, b_dq, mask=m_ts)
        tl.store(dk + row_s, b_dk, mask=m_ts)
        tl.store(dgam + row_s, b_dgam, mask=m_ts)
        tl.store(dgam_last + o_s, b_dglast, mask=m_s)

    # ---- Tm = (I + M)^-1  =>  dM = -Tm^T dTm Tm^T; M = diag(beta) A_kk
    b_dm = -tl.dot(tl.dot(tl.trans(b_tm), b_dtm, input_precision=DOT_PREC), tl.trans(b_tm), input_precision=DOT_PREC)
    b_dm = tl.where(m_t[:, None] & (o_r[:, None] > o_r[None, :]), b_dm, 0.0)
    b_akk = tl.load(akk + row_c, mask=m_t[:, None] & (o_r[:, None] > o_r[None, :]), other=0.0)
    b_dbeta += tl.sum(b_dm * b_akk, 1)
    tl.store(dbeta + o_t * HV, b_dbeta.to(dbeta.dtype.element_ty), mask=m_t)
    tl.store(dakk + row_c, b_beta[:, None] * b_dm, mask=m_t[:, None])
    tl.store(daqk + row_c, b_daqk, mask=m_t[:, None])
