"""Stage 1 of the backward: the reverse scan over chunks.

One program per (V block, batch * value head) carries dS [K, BV] (the grad of the
state at the end of the current chunk) from the last chunk to the first. Per
chunk it recomputes the residuals U' = U - W S0 from the saved chunk state, and
writes them with
  dU' = A_qk^T dO + (K * exp(Gam - gam)) dS_C,
and dS_C itself; then dS0 = (Q * exp(gam))^T dO + exp(Gam) dS_C - W^T dU'.
After the first chunk dS is the grad of the initial state.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._indexing import sequence_and_heads


@triton.jit
def kda_state_bwd_kernel(
    qg, kr, w, u, gam, aqk, chunk_states, do, dht,
    up, dup, dchunk_states, dh0,
    T, NC,
    H, HV,  # runtime: one compiled kernel serves every head count
    K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DHT: tl.constexpr, DOT_PREC: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_hv, i_h, bos = sequence_and_heads(i_bh, T, H, HV)
    bos_pad = i_b * NC * BT  # where the sequence starts in the padded gam buffer
    # Each pointer moves to this sequence and head once, in 64-bit; offsets inside
    # the sequence stay 32-bit (launch.py checks T * HV * max(K, V, BT) < 2^31).
    qg += (bos * HV + i_hv) * K
    kr += (bos * HV + i_hv) * K
    w += (bos * HV + i_hv) * K
    u += (bos * HV + i_hv) * V
    up += (bos * HV + i_hv) * V
    dup += (bos * HV + i_hv) * V
    do += (bos * HV + i_hv) * V
    gam += (bos_pad * HV + i_hv) * K
    aqk += (bos * HV + i_hv) * BT
    dht += (i_b * HV + i_hv) * K * V
    dh0 += (i_b * HV + i_hv) * K * V
    chunk_states += (i_b * (NC + 1) * HV + i_hv) * K * V
    dchunk_states += (i_b * NC * HV + i_hv) * K * V
    cs_stride = tl.cast(HV, tl.int64) * K * V  # from one chunk to the next

    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    state_off = o_k[:, None] * V + o_v[None, :]
    o_r = tl.arange(0, BT)

    if HAS_DHT:
        b_ds = tl.load(dht + state_off, mask=m_kv, other=0.0).to(tl.float32)
    else:
        b_ds = tl.zeros([BK, BV], dtype=tl.float32)

    for i_rev in range(NC):
        i_c = NC - 1 - i_rev
        tl.store(dchunk_states + i_c * cs_stride + state_off, b_ds, mask=m_kv)
        o_t = i_c * BT + o_r
        m_t = o_t < T
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        row_k = (o_t[:, None]) * (HV * K) + o_k[None, :]
        row_v = (o_t[:, None]) * (HV * V) + o_v[None, :]

        b_s0 = tl.load(chunk_states + i_c * cs_stride + state_off, mask=m_kv, other=0.0)
        b_w = tl.load(w + row_k, mask=m_tk, other=0.0).to(tl.float32)
        b_u = tl.load(u + row_v, mask=m_tv, other=0.0)
        b_up = b_u - tl.dot(b_w, b_s0, input_precision=DOT_PREC)
        tl.store(up + row_v, b_up, mask=m_tv)

        b_glast = tl.load(gam + (i_c * BT + BT - 1) * (HV * K) + o_k, mask=m_k, other=0.0)
        b_kr = tl.load(kr + row_k, mask=m_tk, other=0.0).to(tl.float32)
        b_qg = tl.load(qg + row_k, mask=m_tk, other=0.0).to(tl.float32)
        b_a = tl.load(aqk + (o_t[:, None]) * (HV * BT) + o_r[None, :],
                      mask=m_t[:, None] & (o_r[:, None] >= o_r[None, :]), other=0.0)
        b_do = tl.load(do + row_v, mask=m_tv, other=0.0).to(tl.float32)

        b_dup = tl.dot(tl.trans(b_a), b_do, input_precision=DOT_PREC)
        b_dup += tl.dot(b_kr, b_ds, input_precision=DOT_PREC)
        tl.store(dup + row_v, b_dup, mask=m_tv)

        b_ds = b_ds * tl.exp(b_glast)[:, None]
        b_ds += tl.dot(tl.trans(b_qg), b_do, input_precision=DOT_PREC)
        b_ds -= tl.dot(tl.trans(b_w), b_dup, input_precision=DOT_PREC)

    tl.store(dh0 + state_off, b_ds, mask=m_kv)
