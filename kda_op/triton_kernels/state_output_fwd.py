"""Stages 2 and 3 of the forward in one pass (settings.FUSED_OUTPUT): the scan over
chunks that also writes the output.

One program per (V block, sequence * value head) carries S [K, BV] in fp32 through
the chunks as state_fwd.py does, and at each chunk forms
O = Qg S0 + A_qk U' (output_fwd.py's product) from the S0 and U' it holds, so
neither the chunk states nor U' travel through memory for the output. What the
backward needs is still stored where asked: the chunk states (STORE_STATES) and
U' (STORE_UP, kept intermediates). A forward that keeps nothing (no grad, the
state pool's prefill) stores neither: at B8-T8192-H16, K = V = 128, that is
1.5 KB a token and head (chunk states and U', written then read) and one launch.

The output's two dots are off the scan's chain (S0 -> U' -> S_C): Qg S0 needs the
S0 that W S0 needs, A_qk U' the U' that Kr^T U' needs. Where the scan is latency
bound (few programs, small V blocks: B1-T8192-H16) they lengthen each chunk's
step; where its programs fill the device (B8) they share its loads' latency.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._dot import as_stored, dot
from ._indexing import scan_ends, sequence_coords, state_tile


@triton.jit
def kda_state_output_fwd_kernel(
    kr, w, u, gam, qg, aqk, h0,
    up, chunk_states, ht, o,
    cu_seqlens, seq_offsets,  # varlen (IS_VARLEN): _indexing.py
    T, NC,
    H, HV,  # runtime: one compiled kernel serves every head count
    slots,  # POOL: each sequence's slot in the pool that h0 and ht both are (a stand-in otherwise)
    K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, DOT_PREC: tl.constexpr, STORE_HT: tl.constexpr,
    STORE_STATES: tl.constexpr, STORE_UP: tl.constexpr,
    BF16_DOTS: tl.constexpr = False, OUTPUT_BF16_DOTS: tl.constexpr = False, INTERPRET: tl.constexpr = False,
    IS_VARLEN: tl.constexpr = False, POOL: tl.constexpr = False, V_FIRST: tl.constexpr = False,
    COMPACT_STATES: tl.constexpr = False, GLAST_AHEAD: tl.constexpr = False,
    beta=None, tm=None, SOLVE_U: tl.constexpr = False,
):
    # SOLVE_U (settings.FUSED_OUTPUT_SOLVE_U): ``w`` holds Kb = diag(beta) K exp(gam) and ``u``
    # is V itself (the inputs' v), ``tm`` Tm = (I + diag(beta) A_kk)^-1 and ``beta`` beta:
    # U' = U - W S = Tm (diag(beta) V - Kb S) is formed here, one more dot a chunk, so that
    # neither W nor U is written by intra_wu_fwd and read back (64 of its 76 KB a chunk and
    # head at K = V = 128, bf16).
    # STORE_STATES: the state entering every chunk (and the final one, unless
    # COMPACT_STATES) into chunk_states, laid out as state_fwd.py lays them out.
    # STORE_UP: U' into up (kept for the backward).
    # POOL, V_FIRST: prefill into a state pool in place (state_fwd.py); a negative slot
    # reads zeros, writes no state and outputs zeros.
    # BF16_DOTS: the scan's dots (W S0, Kr^T U') on bf16 operands; OUTPUT_BF16_DOTS: the
    # output's (Qg S0, A_qk U'), where the unfused output reads bf16 chunk states and U'.
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_hv, i_h, bos, T, NC, g_0, s_0 = sequence_coords(i_bh, T, NC, H, HV, cu_seqlens, seq_offsets, BT, IS_VARLEN)
    # Each pointer moves to this sequence and head once, in 64-bit, and to each
    # chunk in 64-bit in the loop; offsets inside a chunk are 32-bit at any T.
    kr += (bos * HV + i_hv) * K
    w += (bos * HV + i_hv) * K
    qg += (bos * HV + i_hv) * K
    gam += (bos * HV + i_hv) * K
    aqk += (bos * HV + i_hv) * BT
    u += (bos * HV + i_hv) * V
    up += (bos * HV + i_hv) * V
    o += (bos * HV + i_hv) * V
    chunk_states += (s_0 * HV + i_hv) * K * V
    if SOLVE_U:
        beta += bos * HV + i_hv
        tm += (bos * HV + i_hv) * BT
    cs_stride = tl.cast(HV, tl.int64) * K * V  # from one chunk boundary to the next

    o_k, m_k, o_v, m_v, m_kv, state_off = state_tile(i_v, K, V, BK, BV)
    # S from h0's tile (or zeros) and ht at this sequence's final state (POOL: both at its
    # slot; a negative slot reads zeros, writes nothing and outputs zeros: not live)
    b_s, ht, ends_off, m_ends, live = scan_ends(h0, ht, slots, i_b, i_hv, HV, o_k, o_v, m_kv, K, V, BK, BV,
                                                HAS_H0, POOL, V_FIRST)

    o_r = tl.arange(0, BT)
    row_k = (o_r[:, None]) * (HV * K) + o_k[None, :]
    row_v = (o_r[:, None]) * (HV * V) + o_v[None, :]
    row_a = (o_r[:, None]) * (HV * BT) + o_r[None, :]
    causal = o_r[:, None] >= o_r[None, :]
    tl.static_assert(HAS_H0 or not POOL, "the pool's scan starts from its slots")
    tl.static_assert(not COMPACT_STATES or (STORE_STATES and IS_VARLEN and not HAS_H0),
                     "the compact layout: packed sequences without initial states")
    # Without initial states the first chunk starts from zero: U' = U, O = A_qk U and
    # S_C = Kr^T U need neither W, Qg nor a dot with S0 (W and Qg of first chunks may
    # be left unwritten by the intra-chunk stage: fwd.py's qg_first / w_first). Taken
    # here, out of the loop.
    PEEL: tl.constexpr = not HAS_H0
    # whether a state leaving the last chunk is kept (else a one-chunk sequence forms none)
    KEEPS_LAST: tl.constexpr = STORE_HT or (STORE_STATES and not COMPACT_STATES)
    if PEEL:
        if NC > 0:
            if STORE_STATES and not COMPACT_STATES:
                tl.store(chunk_states + state_off, as_stored(b_s, chunk_states, INTERPRET), mask=m_kv)
            m_t = o_r < T
            m_tv = m_t[:, None] & m_v[None, :]
            b_u = tl.load(u + row_v, mask=m_tv, other=0.0).to(tl.float32)
            if SOLVE_U:  # U = Tm diag(beta) V
                b_beta = tl.load(beta + o_r * HV, mask=m_t, other=0.0).to(tl.float32)
                b_tm = tl.load(tm + row_a, mask=m_t[:, None], other=0.0)
                b_u = dot(b_tm, b_beta[:, None] * b_u, BF16_DOTS, DOT_PREC, INTERPRET)
            if STORE_UP:
                tl.store(up + row_v, as_stored(b_u, up, INTERPRET), mask=m_tv)
            b_a = tl.where(causal, tl.load(aqk + row_a, mask=m_t[:, None], other=0.0), 0.0)
            b_o = dot(b_a, b_u, OUTPUT_BF16_DOTS, DOT_PREC, INTERPRET)
            tl.store(o + row_v, as_stored(b_o, o, INTERPRET).to(o.dtype.element_ty), mask=m_tv)
            if KEEPS_LAST:
                wants_state = NC > 0
            else:
                wants_state = NC > 1
            if wants_state:
                b_kr = tl.load(kr + row_k, mask=m_t[:, None] & m_k[None, :], other=0.0)
                b_s = dot(tl.trans(b_kr), b_u, BF16_DOTS, DOT_PREC, INTERPRET)
    I_FIRST: tl.constexpr = 1 if PEEL else 0
    # GLAST_AHEAD (settings.FUSED_OUTPUT_GLAST_AHEAD): each chunk's last row of gam loaded a
    # chunk ahead, as state_fwd.py's. Loaded where it is used, it is one more round trip to
    # memory on each chunk's chain, after the output's stores (sm_90a SASS).
    if GLAST_AHEAD:
        b_glast = tl.load(gam + (tl.minimum(tl.cast((I_FIRST + 1) * BT, tl.int64), T) - 1) * (HV * K) + o_k,
                          mask=m_k & ((I_FIRST + 0 * o_k) < NC), other=0.0)
    for i_c in range(I_FIRST, NC):
        if STORE_STATES:
            tl.store(chunk_states + i_c * cs_stride + state_off, as_stored(b_s, chunk_states, INTERPRET), mask=m_kv)
        r0 = tl.cast(i_c * BT, tl.int64)  # the chunk's first row
        if GLAST_AHEAD:
            b_glast_next = tl.load(gam + (tl.minimum(r0 + 2 * BT, T) - 1) * (HV * K) + o_k,
                                   mask=m_k & ((i_c + 1 + 0 * o_k) < NC), other=0.0)
        m_t = i_c * BT + o_r < T
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_w = tl.load(w + r0 * (HV * K) + row_k, mask=m_tk, other=0.0)
        b_qg = tl.load(qg + r0 * (HV * K) + row_k, mask=m_tk, other=0.0)
        b_u = tl.load(u + r0 * (HV * V) + row_v, mask=m_tv, other=0.0).to(tl.float32)
        b_kr = tl.load(kr + r0 * (HV * K) + row_k, mask=m_tk, other=0.0)
        # A_qk under its row mask, its upper triangle zeroed after the load (as state_bwd.py's
        # AQK_ROW_MASK): under the causal mask the load goes element by element on sm_90a
        b_a = tl.where(causal, tl.load(aqk + r0 * (HV * BT) + row_a, mask=m_t[:, None], other=0.0), 0.0)
        if SOLVE_U:  # U' = Tm (diag(beta) V - Kb S); b_w is Kb, b_u is V
            b_beta = tl.load(beta + (r0 + o_r) * HV, mask=m_t, other=0.0).to(tl.float32)
            b_tm = tl.load(tm + r0 * (HV * BT) + row_a, mask=m_t[:, None], other=0.0)
            b_up = dot(b_tm, b_beta[:, None] * b_u - dot(b_w, b_s, BF16_DOTS, DOT_PREC, INTERPRET),
                       BF16_DOTS, DOT_PREC, INTERPRET)
        else:
            b_up = b_u - dot(b_w, b_s, BF16_DOTS, DOT_PREC, INTERPRET)
        if STORE_UP:
            tl.store(up + r0 * (HV * V) + row_v, as_stored(b_up, up, INTERPRET), mask=m_tv)
        # in output_fwd.py's order (A_qk U' first): the same sums, bit for bit
        b_o = dot(b_a, b_up, OUTPUT_BF16_DOTS, DOT_PREC, INTERPRET)
        b_o += dot(b_qg, b_s, OUTPUT_BF16_DOTS, DOT_PREC, INTERPRET)
        if POOL:
            b_o = tl.where(live, b_o, 0.0)
        tl.store(o + r0 * (HV * V) + row_v, as_stored(b_o, o, INTERPRET).to(o.dtype.element_ty), mask=m_tv)
        if not GLAST_AHEAD:
            # the chunk's last row of gam (gam has the rows of the inputs, _indexing.py)
            b_glast = tl.load(gam + (tl.minimum(r0 + BT, T) - 1) * (HV * K) + o_k, mask=m_k, other=0.0)
        b_s = b_s * tl.exp(b_glast)[:, None] + dot(tl.trans(b_kr), b_up, BF16_DOTS, DOT_PREC, INTERPRET)
        if GLAST_AHEAD:
            b_glast = b_glast_next

    if STORE_STATES and not COMPACT_STATES:
        tl.store(chunk_states + NC * cs_stride + state_off, as_stored(b_s, chunk_states, INTERPRET), mask=m_kv)
    if STORE_HT:  # not without output_final_state (ht is then a stand-in)
        tl.store(ht + ends_off, b_s, mask=m_ends)
