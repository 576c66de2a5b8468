"""Stage 1 (forward, and recomputed in the backward): everything inside one chunk.

One program per (chunk, batch * value head). With gam = cumsum(g) inside the
chunk, it writes
  gam                        [B, NC*BT, HV, K]  (padded rows repeat the last gam)
  A_kk (strictly lower)      [B, T, HV, BT]
  A_qk (lower, with diagonal)[B, T, HV, BT]
  W = Tm diag(beta) (K * exp(gam)),  U = Tm diag(beta) V,
and Tm = (I + diag(beta) A_kk)^-1 when STORE_TM (the backward needs it).

Numerics: exp(gam_i - gam_j) is never split as exp(gam_i) * exp(-gam_j) over the
whole chunk. The chunk is cut into sub-blocks of BC rows; an off-diagonal block
(I > J) uses the first row r of block I as reference, so both factors
exp(gam_i - gam_r) and exp(gam_r - gam_j) are <= 1 for a decaying gate. A
diagonal block splits at its middle row when that keeps both factors within
exp(+-MAX_SPLIT), and otherwise forms exp(gam_i - gam_j) per pair.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._indexing import sequence_and_heads


@triton.jit
def kda_intra_fwd_kernel(
    q, k, v, g, beta,
    gam, akk, aqk, w, u, tm,
    scale, T, NC,
    H, HV,  # runtime: one compiled kernel serves every head count
    K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    STORE_TM: tl.constexpr, DOT_PREC: tl.constexpr, MAX_SPLIT: tl.constexpr,
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
    u += (bos * HV + i_hv) * V
    g += (bos * HV + i_hv) * K
    w += (bos * HV + i_hv) * K
    beta += bos * HV + i_hv
    gam += (bos_pad * HV + i_hv) * K
    akk += (bos * HV + i_hv) * BT
    aqk += (bos * HV + i_hv) * BT
    tm += (bos * HV + i_hv) * BT
    t0 = i_c * BT

    o_t = t0 + tl.arange(0, BT)
    m_t = o_t < T
    o_k = tl.arange(0, BK)
    m_k = o_k < K

    # gam = cumsum(g) in fp32; padded rows load g = 0, so they repeat the last gam.
    b_g = tl.load(g + (o_t[:, None]) * (HV * K) + o_k[None, :],
                  mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32)
    b_gam = tl.cumsum(b_g, axis=0)
    tl.store(gam + (o_t[:, None]) * (HV * K) + o_k[None, :], b_gam, mask=m_k[None, :])
    tl.debug_barrier()

    # Whole chunk at once when its gates allow: split every exp(gam_i - gam_j) at
    # the chunk's middle row m, exp(gam_i - gam_m) exp(gam_m - gam_j), and form
    # both A's with two [BT, K] x [K, BT] dots. Every factor lies within
    # exp(+-MAX_SPLIT) (checked over the chunk), so the kept entries (i >= j) are
    # the exact products; entries above the diagonal may overflow and are dropped.
    o_r = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    b_gmid = tl.load(gam + (t0 + BT // 2) * (HV * K) + o_k, mask=m_k, other=0.0)
    b_dmid = b_gam - b_gmid[None, :]
    if tl.max(tl.max(tl.abs(b_dmid), 1), 0) <= MAX_SPLIT:
        m_tk = m_t[:, None] & m_k[None, :]
        b_qc = tl.load(q + (o_t[:, None]) * (H * K) + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32) * scale
        b_kc = tl.load(k + (o_t[:, None]) * (H * K) + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_ep_c = tl.exp(b_dmid)
        b_kn_c = tl.trans(b_kc * tl.exp(-b_dmid))
        b_akk_c = tl.dot(b_kc * b_ep_c, b_kn_c, input_precision=DOT_PREC)
        b_aqk_c = tl.dot(b_qc * b_ep_c, b_kn_c, input_precision=DOT_PREC)
        p_a = (o_t[:, None]) * (HV * BT) + o_r[None, :]
        tl.store(akk + p_a, tl.where(o_r[:, None] > o_r[None, :], b_akk_c, 0.0), mask=m_t[:, None])
        tl.store(aqk + p_a, tl.where(o_r[:, None] >= o_r[None, :], b_aqk_c, 0.0), mask=m_t[:, None])
    else:
        # Steeper gates: sub-blocks of BC rows (see the module docstring).
        for i_i in tl.static_range(BT // BC):
            o_i = t0 + i_i * BC + o_c
            m_i = o_i < T
            p_qi = q + (o_i[:, None]) * (H * K) + o_k[None, :]
            p_ki = k + (o_i[:, None]) * (H * K) + o_k[None, :]
            b_qi = tl.load(p_qi, mask=m_i[:, None] & m_k[None, :], other=0.0).to(tl.float32) * scale
            b_ki = tl.load(p_ki, mask=m_i[:, None] & m_k[None, :], other=0.0).to(tl.float32)
            b_gi = tl.load(gam + (o_i[:, None]) * (HV * K) + o_k[None, :], mask=m_k[None, :], other=0.0)
            b_gr = tl.load(gam + (t0 + i_i * BC) * (HV * K) + o_k, mask=m_k, other=0.0)
            b_ei = tl.exp(b_gi - b_gr[None, :])
            b_kia = b_ki * b_ei
            b_qia = b_qi * b_ei
            row_off = (o_i[:, None]) * (HV * BT)
            for i_j in tl.static_range(i_i):
                o_j = t0 + i_j * BC + o_c
                m_j = o_j < T
                b_kj = tl.load(k + (o_j[:, None]) * (H * K) + o_k[None, :],
                               mask=m_j[:, None] & m_k[None, :], other=0.0).to(tl.float32)
                b_gj = tl.load(gam + (o_j[:, None]) * (HV * K) + o_k[None, :], mask=m_k[None, :], other=0.0)
                b_kjb = tl.trans(b_kj * tl.exp(b_gr[None, :] - b_gj))
                b_akk = tl.dot(b_kia, b_kjb, input_precision=DOT_PREC)
                b_aqk = tl.dot(b_qia, b_kjb, input_precision=DOT_PREC)
                col = i_j * BC + o_c[None, :]
                tl.store(akk + row_off + col, b_akk, mask=m_i[:, None])
                tl.store(aqk + row_off + col, b_aqk, mask=m_i[:, None])

            # Diagonal block. Split at the middle row m: exp(gam_i - gam_j) =
            # exp(gam_i - gam_m) exp(gam_m - gam_j), two dots. Each factor stays within
            # exp(+-MAX_SPLIT) when the block's gates do (checked here, per block); the
            # products of the kept entries (i >= j) are the exact exp(gam_i - gam_j).
            # Entries above the diagonal may overflow and are dropped by the where.
            b_gm = tl.load(gam + (t0 + i_i * BC + BC // 2) * (HV * K) + o_k, mask=m_k, other=0.0)
            b_dm = b_gi - b_gm[None, :]
            if tl.max(tl.max(tl.abs(b_dm), 1), 0) <= MAX_SPLIT:
                b_em = tl.exp(b_dm)
                b_kn = tl.trans(b_ki * tl.exp(-b_dm))
                b_akk_d = tl.dot(b_ki * b_em, b_kn, input_precision=DOT_PREC)
                b_aqk_d = tl.dot(b_qi * b_em, b_kn, input_precision=DOT_PREC)
                col = i_i * BC + o_c[None, :]
                tl.store(akk + row_off + col, tl.where(o_c[:, None] > o_c[None, :], b_akk_d, 0.0), mask=m_i[:, None])
                tl.store(aqk + row_off + col, tl.where(o_c[:, None] >= o_c[None, :], b_aqk_d, 0.0), mask=m_i[:, None])
            else:
                # Steep gates: exact exp(gam_i - gam_j) per pair, one column j at a time.
                for j in range(BC):  # a runtime loop: unrolled, it multiplies compile time
                    t_j = t0 + i_i * BC + j
                    b_krow = tl.load(k + t_j * (H * K) + o_k[None, :], mask=m_k[None, :] & (t_j < T),
                                     other=0.0).to(tl.float32)
                    b_grow = tl.load(gam + t_j * (HV * K) + o_k[None, :], mask=m_k[None, :], other=0.0)
                    b_kje = b_krow * tl.exp(tl.where(o_c[:, None] >= j, b_gi - b_grow, float("-inf")))
                    p_col = row_off + i_i * BC + j
                    # strictly lower for A_kk (its diagonal is 0), lower with the diagonal for A_qk
                    tl.store(akk + p_col, tl.where(o_c[:, None] > j, tl.sum(b_ki * b_kje, 1, keep_dims=True), 0.0),
                             mask=m_i[:, None])
                    tl.store(aqk + p_col, tl.sum(b_qi * b_kje, 1, keep_dims=True), mask=m_i[:, None])
    tl.debug_barrier()

    # Tm = (I + M)^-1, M = diag(beta) A_kk strictly lower. With D the BC x BC
    # diagonal blocks of M and N the rest, I + M = (I + D)(I + P), P = (I + D)^-1 N.
    # The four (I + D) blocks are inverted together by forward substitution (BC - 1
    # steps on [NB, BC, BC]); P is strictly block-lower, so P^NB = 0 and
    # (I + P)^-1 = (I - P)(I + P^2) for NB = 4: three dots instead of BT - 1
    # sequential row updates.
    b_beta = tl.load(beta + o_t * HV, mask=m_t, other=0.0).to(tl.float32)
    b_a = tl.load(akk + (o_t[:, None]) * (HV * BT) + o_r[None, :],
                  mask=m_t[:, None] & (o_r[:, None] > o_r[None, :]), other=0.0)
    b_m = b_beta[:, None] * b_a
    NB: tl.constexpr = BT // BC
    tl.static_assert(BT // BC == 4, "(I + P)^-1 = (I - P)(I + P^2) needs exactly 4 sub-blocks")
    o_b = tl.arange(0, NB)
    same_block = (o_b[:, None, None, None] == o_b[None, None, :, None])  # [NB, 1, NB, 1]
    b_d = tl.sum(tl.where(same_block, tl.reshape(b_m, (NB, BC, NB, BC)), 0.0), 2)  # [NB, BC, BC]
    b_x = tl.where((o_c[:, None] == o_c[None, :])[None, :, :], 1.0, 0.0) + tl.zeros([NB, BC, BC], dtype=tl.float32)
    for i in range(1, BC):
        row = (o_c == i)
        b_di = tl.sum(tl.where(row[None, :, None], b_d, 0.0), 1)  # row i of every block, [NB, BC]
        b_row = tl.where(row[None, :], 1.0, 0.0) - tl.sum(b_di[:, :, None] * b_x, 1)
        b_x = tl.where(row[None, :, None], b_row[:, None, :], b_x)
    b_dinv = tl.reshape(tl.where(same_block, b_x[:, :, None, :], 0.0), (BT, BT))
    b_n = tl.where(o_r[:, None] // BC > o_r[None, :] // BC, b_m, 0.0)
    b_eye = tl.where(o_r[:, None] == o_r[None, :], 1.0, 0.0)
    b_p = tl.dot(b_dinv, b_n, input_precision=DOT_PREC)
    b_p2 = tl.dot(b_p, b_p, input_precision=DOT_PREC)
    b_tm = tl.dot(tl.dot(b_eye - b_p, b_eye + b_p2, input_precision=DOT_PREC), b_dinv, input_precision=DOT_PREC)
    if STORE_TM:
        tl.store(tm + (o_t[:, None]) * (HV * BT) + o_r[None, :], b_tm, mask=m_t[:, None])

    b_k = tl.load(k + (o_t[:, None]) * (H * K) + o_k[None, :],
                  mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32)
    # gam is reloaded rather than kept live through the inverse (register pressure).
    b_gam = tl.load(gam + (o_t[:, None]) * (HV * K) + o_k[None, :], mask=m_k[None, :], other=0.0)
    b_w = tl.dot(b_tm, b_beta[:, None] * b_k * tl.exp(b_gam), input_precision=DOT_PREC)
    tl.store(w + (o_t[:, None]) * (HV * K) + o_k[None, :], b_w, mask=m_t[:, None] & m_k[None, :])
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        p_v = (o_t[:, None]) * (HV * V) + o_v[None, :]
        b_v = tl.load(v + p_v, mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)
        b_u = tl.dot(b_tm, b_beta[:, None] * b_v, input_precision=DOT_PREC)
        tl.store(u + p_v, b_u, mask=m_t[:, None] & m_v[None, :])
