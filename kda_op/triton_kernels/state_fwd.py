"""Stage 2 (forward): the scan over chunks, the only sequential part.

One program per (V block, batch * value head) carries S [K, BV] in fp32 through
the chunks: it saves S at every chunk boundary, writes the residuals
U' = U - W S0, and hands S on with S_C = exp(Gam) S0 + Kr^T U',
Kr = K * exp(Gam - gam) (from intra_a_fwd.py, like W in the scans' operand dtype).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._dot import as_stored, dot
from ._indexing import scan_ends, sequence_coords, state_tile


@triton.jit
def kda_state_fwd_kernel(
    kr, w, u, gam, h0,
    up, chunk_states, ht,
    cu_seqlens, seq_offsets,  # varlen (IS_VARLEN): _indexing.py
    T, NC,
    H, HV,  # runtime: one compiled kernel serves every head count
    slots,  # POOL: each sequence's slot in the pool that h0 and ht both are (a stand-in otherwise)
    K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, DOT_PREC: tl.constexpr, STORE_HT: tl.constexpr = True,
    BF16_DOTS: tl.constexpr = False, INTERPRET: tl.constexpr = False,
    IS_VARLEN: tl.constexpr = False, POOL: tl.constexpr = False, V_FIRST: tl.constexpr = False,
    COMPACT_STATES: tl.constexpr = False, FIRST_UP: tl.constexpr = True, SKIP_UNKEPT_STATE: tl.constexpr = False,
    GLAST_AHEAD: tl.constexpr = False,
):
    # COMPACT_STATES (packed sequences without initial states; _indexing.py): the zero
    # state entering a sequence's first chunk and its final state are not stored in
    # chunk_states (the final one goes to ht only, when STORE_HT).
    # FIRST_UP = False (packed sequences without initial states, U' not kept): the first
    # chunks' U' (= U) is not written; the output kernel reads U there (its FIRST_FROM_U).
    # SKIP_UNKEPT_STATE (settings.SKIP_UNREAD): a one-chunk sequence forms no leaving
    # state where neither chunk_states (compact) nor ht keeps it.
    # POOL: prefill into a state pool [num_slots, HV, K, V] ([.., V, K] with
    # V_FIRST) in place: sequence i_b starts from slot slots[i_b] and leaves its
    # final state there; a negative slot reads zeros and writes nothing. Each
    # program reads its state tile whole before it writes it back.
    # BF16_DOTS (bf16 W and Kr only): the state and U' enter the dots rounded to
    # bf16 (fp32 accumulation, S itself carried in fp32): half the MMA steps of TF32
    # on the scan's serial path and no widening of W and Kr.
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_hv, i_h, bos, T, NC, g_0, s_0 = sequence_coords(i_bh, T, NC, H, HV, cu_seqlens, seq_offsets, BT, IS_VARLEN)
    # Each pointer moves to this sequence and head once, in 64-bit, and to each
    # chunk in 64-bit in the loop; offsets inside a chunk are 32-bit at any T.
    kr += (bos * HV + i_hv) * K
    w += (bos * HV + i_hv) * K
    u += (bos * HV + i_hv) * V
    up += (bos * HV + i_hv) * V
    gam += (bos * HV + i_hv) * K
    chunk_states += (s_0 * HV + i_hv) * K * V
    cs_stride = tl.cast(HV, tl.int64) * K * V  # from one chunk boundary to the next

    o_k, m_k, o_v, m_v, m_kv, state_off = state_tile(i_v, K, V, BK, BV)
    # S from h0's tile (or zeros) and ht at this sequence's final state (POOL: both at its
    # slot; a negative slot reads zeros and writes nothing); the chunk states stay K-first
    b_s, ht, ends_off, m_ends, _ = scan_ends(h0, ht, slots, i_b, i_hv, HV, o_k, o_v, m_kv, K, V, BK, BV,
                                             HAS_H0, POOL, V_FIRST)

    o_r = tl.arange(0, BT)
    row_k = (o_r[:, None]) * (HV * K) + o_k[None, :]
    row_v = (o_r[:, None]) * (HV * V) + o_v[None, :]
    # Packed sequences without initial states (training): the first chunk starts from
    # zero, so U' = U and S_C = Kr^T U' need neither W nor a dot with S0; that chunk is
    # taken here, out of the loop (a one-chunk sequence: short packed sequences). Not for
    # equal-length batches, whose loop it would lengthen for the one chunk in NC it saves.
    PEEL: tl.constexpr = IS_VARLEN and not HAS_H0
    tl.static_assert(PEEL or not COMPACT_STATES, "the compact layout has no slot for a first chunk's state")
    tl.static_assert(PEEL or FIRST_UP, "U' of first chunks not written: packed sequences without initial states")
    if PEEL:
        # the state after the first chunk is not wanted by a one-chunk sequence when
        # neither chunk_states nor ht keeps it: then neither Kr nor the dot is needed
        # (one-chunk sequences: every one at 2048 packed sequences of 1-64 tokens)
        if SKIP_UNKEPT_STATE and COMPACT_STATES and not STORE_HT:
            wants_state = NC > 1
        else:
            wants_state = NC > 0
        if NC > 0:
            if not COMPACT_STATES:
                tl.store(chunk_states + state_off, as_stored(b_s, chunk_states, INTERPRET), mask=m_kv)
            if FIRST_UP or wants_state:
                m_t = o_r < T
                b_u = tl.load(u + row_v, mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)
                if FIRST_UP:
                    tl.store(up + row_v, as_stored(b_u, up, INTERPRET), mask=m_t[:, None] & m_v[None, :])
                if wants_state:
                    b_kr = tl.load(kr + row_k, mask=m_t[:, None] & m_k[None, :], other=0.0)
                    b_s = dot(tl.trans(b_kr), b_u, BF16_DOTS, DOT_PREC, INTERPRET)
    # GLAST_AHEAD (settings.SCAN_GLAST_AHEAD): each chunk's last row of gam loaded a chunk
    # ahead. Loaded where it is used it stays outside the pipeliner (two LDG a thread on
    # sm_90a, the only loads of the loop not taken by it), and every chunk waits on it.
    I_FIRST: tl.constexpr = 1 if PEEL else 0
    if GLAST_AHEAD:
        b_glast = tl.load(gam + (tl.minimum(tl.cast((I_FIRST + 1) * BT, tl.int64), T) - 1) * (HV * K) + o_k,
                          mask=m_k & ((I_FIRST + 0 * o_k) < NC), other=0.0)
    for i_c in range(I_FIRST, NC):
        tl.store(chunk_states + i_c * cs_stride + state_off, as_stored(b_s, chunk_states, INTERPRET), mask=m_kv)
        r0 = tl.cast(i_c * BT, tl.int64)  # the chunk's first row
        if GLAST_AHEAD:
            b_glast_next = tl.load(gam + (tl.minimum(r0 + 2 * BT, T) - 1) * (HV * K) + o_k,
                                   mask=m_k & ((i_c + 1 + 0 * o_k) < NC), other=0.0)
        m_t = i_c * BT + o_r < T
        b_w = tl.load(w + r0 * (HV * K) + row_k, mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_u = tl.load(u + r0 * (HV * V) + row_v, mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)
        b_kr = tl.load(kr + r0 * (HV * K) + row_k, mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_up = b_u - dot(b_w, b_s, BF16_DOTS, DOT_PREC, INTERPRET)
        tl.store(up + r0 * (HV * V) + row_v, as_stored(b_up, up, INTERPRET), mask=m_t[:, None] & m_v[None, :])

        if not GLAST_AHEAD:
            # the chunk's last row of gam (gam has the rows of the inputs, _indexing.py)
            b_glast = tl.load(gam + (tl.minimum(r0 + BT, T) - 1) * (HV * K) + o_k, mask=m_k, other=0.0)
        b_s = b_s * tl.exp(b_glast)[:, None] + dot(tl.trans(b_kr), b_up, BF16_DOTS, DOT_PREC, INTERPRET)
        if GLAST_AHEAD:
            b_glast = b_glast_next

    if not COMPACT_STATES:
        tl.store(chunk_states + NC * cs_stride + state_off, as_stored(b_s, chunk_states, INTERPRET), mask=m_kv)
    if STORE_HT:  # not without output_final_state (ht is then a stand-in)
        tl.store(ht + ends_off, b_s, mask=m_ends)
