"""Stage 1 of the backward: the reverse scan over chunks, and its parallel part.

Per chunk, with S0 the saved state at its start and dS_C the grad of the state
at its end:
  U' = U - W S0                                  (the forward's residuals)
  dU' = A_qk^T dO + Kr dS_C,                     Kr = K * exp(Gam - gam)
  dS0 = exp(Gam) dS_C + Qg^T dO - W^T dU',       Qg = Q * scale * exp(gam)
By default (settings.SCAN_BWD_FUSED) kda_state_bwd_fused_kernel, one program per V
block and batch * value head, carries dS from the last chunk to the first and forms
every term itself, four dots a chunk; kda_state_bwd_prep_kernel then only writes U'
where the forward did not keep it. Otherwise, since everything but the terms with
dS_C is independent across chunks: kda_state_bwd_prep_kernel (one program per chunk, batch * value head and V block)
writes U' (unless the forward kept it), A_qk^T dO (into dU') and Qg^T dO (into the chunk's slot of the
dchunk_states buffer). kda_state_bwd_kernel (one program per V block and batch *
value head) then carries dS from the last chunk to the first with two dots a
chunk, writing dU' and dS_C (over the slot it read); after the first chunk dS is
the grad of the initial state.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._dot import as_stored, dot
from ._indexing import chunk_coords, chunk_in_sequence, sequence_coords, state_tile


@triton.jit
def kda_state_bwd_prep_kernel(
    qg, w, u, aqk, chunk_states, do,
    up, dup, dchunk_states,
    cu_seqlens, chunk_index,  # varlen (IS_VARLEN): _indexing.py
    ds_offsets,  # COMPACT: each sequence's first dS_C slot (varlen_index.py; a stand-in otherwise)
    T, NC,
    H, HV,  # runtime: one compiled kernel serves every head count
    K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_UP: tl.constexpr, DOT_PREC: tl.constexpr, INTERPRET: tl.constexpr = False,
    IS_VARLEN: tl.constexpr = False, HAS_DH0: tl.constexpr = True, COMPACT: tl.constexpr = False,
    DO_TERMS: tl.constexpr = True,
):
    """DO_TERMS = False (the fused scan, settings.SCAN_BWD_FUSED, forms A_qk^T dO and
    Qg^T dO itself): U' only, launched only where the forward did not keep it.
    HAS_UP: U' is already there (the forward kept it); skip S0, W and U. HAS_DH0:
    the initial state's grad is wanted (else no Qg^T dO for first chunks). COMPACT
    (packed sequences without dh0 and dht; settings.COMPACT_DSTATES): a sequence's
    chunk c > 0 puts its Qg^T dO in the slot of chunk c - 1's dS_C, which the scan
    reads it from, so each sequence takes one slot fewer than its chunks."""
    # The V block varies fastest over the grid: the blocks of one chunk run side by
    # side and share their loads of dO, A_qk and Qg through L2.
    i_v = tl.program_id(0)
    i_c = tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    i_b, i_hv, i_h, bos, T, g_c, s_c = chunk_coords(i_c, i_bh, T, NC, H, HV, cu_seqlens, chunk_index, BT, IS_VARLEN)
    if IS_VARLEN:
        if T <= 0:  # an unused chunk slot (past the last sequence's chunks): nothing to compute
            return
    # Each pointer moves to this chunk and head once, in 64-bit (bos: the chunk's
    # first row); offsets inside the chunk are 32-bit at any T.
    qg += (bos * HV + i_hv) * K
    w += (bos * HV + i_hv) * K
    u += (bos * HV + i_hv) * V
    up += (bos * HV + i_hv) * V
    dup += (bos * HV + i_hv) * V
    do += (bos * HV + i_hv) * V
    aqk += (bos * HV + i_hv) * BT
    chunk_states += (s_c * HV + i_hv) * K * V
    c_seq = chunk_in_sequence(i_c, chunk_index, IS_VARLEN)
    if COMPACT:
        dchunk_states += ((tl.load(ds_offsets + i_b) + c_seq - 1) * HV + i_hv) * K * V
    else:
        dchunk_states += (g_c * HV + i_hv) * K * V

    o_r = tl.arange(0, BT)
    o_t = o_r
    m_t = o_t < T
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_tk = m_t[:, None] & m_k[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    m_kv = m_k[:, None] & m_v[None, :]
    state_off = o_k[:, None] * V + o_v[None, :]
    row_k = (o_t[:, None]) * (HV * K) + o_k[None, :]
    row_v = (o_t[:, None]) * (HV * V) + o_v[None, :]

    if not HAS_UP:
        # S0 = 0 entering a sequence's first chunk without an initial state: not read
        # (not stored either in the chunk states' compact layout, _indexing.py)
        use_s0 = ((((c_seq > 0) | HAS_DH0).to(tl.int32) + 0 * o_k) > 0)[:, None]  # a block mask
        b_s0 = tl.load(chunk_states + state_off, mask=m_kv & use_s0, other=0.0).to(tl.float32)
        b_w = tl.load(w + row_k, mask=m_tk, other=0.0).to(tl.float32)
        b_u = tl.load(u + row_v, mask=m_tv, other=0.0).to(tl.float32)
        tl.store(up + row_v, as_stored(b_u - tl.dot(b_w, b_s0, input_precision=DOT_PREC), up, INTERPRET), mask=m_tv)

    if not DO_TERMS:
        return
    b_do = tl.load(do + row_v, mask=m_tv, other=0.0).to(tl.float32)
    b_a = tl.load(aqk + (o_t[:, None]) * (HV * BT) + o_r[None, :],
                  mask=m_t[:, None] & (o_r[:, None] >= o_r[None, :]), other=0.0).to(tl.float32)
    tl.store(dup + row_v, tl.dot(tl.trans(b_a), b_do, input_precision=DOT_PREC), mask=m_tv)
    # Qg^T dO: its share of dS entering the chunk, not needed for a sequence's first
    # chunk without an initial state (kda_state_bwd_kernel does not read it there)
    if (c_seq > 0) | HAS_DH0:
        b_qg = tl.load(qg + row_k, mask=m_tk, other=0.0).to(tl.float32)
        tl.store(dchunk_states + state_off,
                 as_stored(tl.dot(tl.trans(b_qg), b_do, input_precision=DOT_PREC), dchunk_states, INTERPRET),
                 mask=m_kv)


@triton.jit
def kda_state_bwd_kernel(
    kr, w, gam, dht,
    dup, dchunk_states, dh0,
    cu_seqlens, seq_offsets,  # varlen (IS_VARLEN): _indexing.py
    ds_offsets,  # COMPACT: each sequence's first dS_C slot (a stand-in otherwise)
    T, NC,
    H, HV,  # runtime: one compiled kernel serves every head count
    K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DHT: tl.constexpr, DOT_PREC: tl.constexpr,
    IS_VARLEN: tl.constexpr = False, HAS_DH0: tl.constexpr = True, INTERPRET: tl.constexpr = False,
    COMPACT: tl.constexpr = False,
):
    # COMPACT (packed, without dht and dh0; see the prep kernel): chunk c's dS_C in slot
    # c of the sequence's NC - 1, and chunk c's Qg^T dO read from slot c - 1.
    # HAS_DH0: write dS entering the first chunk (the initial state's grad); off
    # without an initial state (dh0 a stand-in then: [N, HV, K, V] fp32 unwritten,
    # 2 GiB at 2048 packed sequences of 16 heads).
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_hv, i_h, bos, T, NC, g_0, s_0 = sequence_coords(i_bh, T, NC, H, HV, cu_seqlens, seq_offsets, BT,
                                                         IS_VARLEN)
    # Each pointer moves to this sequence and head once, in 64-bit, and to each
    # chunk in 64-bit in the loop; offsets inside a chunk are 32-bit at any T.
    kr += (bos * HV + i_hv) * K
    w += (bos * HV + i_hv) * K
    dup += (bos * HV + i_hv) * V
    gam += (bos * HV + i_hv) * K
    dht += (i_b * HV + i_hv) * K * V
    dh0 += (i_b * HV + i_hv) * K * V
    if COMPACT:
        dchunk_states += (tl.load(ds_offsets + i_b) * HV + i_hv) * K * V
    else:
        dchunk_states += (g_0 * HV + i_hv) * K * V
    cs_stride = tl.cast(HV, tl.int64) * K * V  # from one chunk to the next
    # where chunk c's Qg^T dO sits: its own slot, or (COMPACT) chunk c - 1's
    QDO_SHIFT: tl.constexpr = 1 if COMPACT else 0

    o_k, m_k, o_v, m_v, m_kv, state_off = state_tile(i_v, K, V, BK, BV)
    o_r = tl.arange(0, BT)

    if HAS_DHT:
        b_ds = tl.load(dht + state_off, mask=m_kv, other=0.0).to(tl.float32)
    else:
        b_ds = tl.zeros([BK, BV], dtype=tl.float32)

    row_k = (o_r[:, None]) * (HV * K) + o_k[None, :]
    row_v = (o_r[:, None]) * (HV * V) + o_v[None, :]
    # Packed sequences without a grad of their final states (training): the last chunk's
    # dS_C is 0 and its dU' is the prep kernel's A_qk^T dO as it stands (+ Kr 0), so that
    # chunk is taken here, out of the loop: its dS_C is not stored (intra_bwd_w.py does not
    # read it without dht), and dS entering it is formed only where an earlier chunk or
    # dh0 reads it. A sequence of one chunk without an initial state then costs nothing
    # here (short packed sequences: 2048 of 1-64 tokens spent 8.9 ms here, fla's dh kernel
    # 4.0). Not for equal-length batches, whose loop (SASS) it would lengthen for the one
    # chunk in NC it saves.
    PEEL: tl.constexpr = IS_VARLEN and not HAS_DHT
    PEEL_ONE: tl.constexpr = 1 if PEEL else 0
    if PEEL:
        if NC > 0:
            i_c = NC - 1
            r0 = tl.cast(i_c * BT, tl.int64)
            p_ds = dchunk_states + (i_c - QDO_SHIFT) * cs_stride + state_off
            if (NC > 1) | HAS_DH0:
                m_t = i_c * BT + o_r < T
                b_w = tl.load(w + r0 * (HV * K) + row_k, mask=m_t[:, None] & m_k[None, :], other=0.0)
                b_dup = tl.load(dup + r0 * (HV * V) + row_v, mask=m_t[:, None] & m_v[None, :], other=0.0)
                b_ds = (tl.load(p_ds, mask=m_kv, other=0.0).to(tl.float32)
                        - tl.dot(tl.trans(b_w).to(tl.float32), b_dup, input_precision=DOT_PREC))

    for i_rev in range(PEEL_ONE, NC):
        i_c = NC - 1 - i_rev
        r0 = tl.cast(i_c * BT, tl.int64)  # the chunk's first row
        m_t = i_c * BT + o_r < T
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        p_ds = dchunk_states + i_c * cs_stride + state_off

        # Qg^T dO from the prep kernel sits in the slot this chunk's dS_C goes to (COMPACT:
        # the one before): use it and pass a barrier before the store (every thread's
        # read lands first). Not for the first chunk without dh0: dS entering it is not
        # needed, the prep kernel does not form it.
        # the chunk's last row of gam (gam has the rows of the inputs, _indexing.py)
        b_glast = tl.load(gam + (tl.minimum(r0 + BT, T) - 1) * (HV * K) + o_k, mask=m_k, other=0.0)
        m_qdo = m_kv & ((i_c + 0 * o_k > 0) | HAS_DH0)[:, None]
        b_next = b_ds * tl.exp(b_glast)[:, None] + tl.load(p_ds - QDO_SHIFT * cs_stride, mask=m_qdo,
                                                           other=0.0).to(tl.float32)
        tl.debug_barrier()
        tl.store(p_ds, as_stored(b_ds, dchunk_states, INTERPRET), mask=m_kv)

        b_kr = tl.load(kr + r0 * (HV * K) + row_k, mask=m_tk, other=0.0)
        b_w = tl.load(w + r0 * (HV * K) + row_k, mask=m_tk, other=0.0)
        # dU' = A_qk^T dO (from the prep kernel) + Kr dS_C
        p_dup = dup + r0 * (HV * V) + row_v
        b_dup = tl.load(p_dup, mask=m_tv, other=0.0) + tl.dot(b_kr.to(tl.float32), b_ds, input_precision=DOT_PREC)
        tl.store(p_dup, b_dup, mask=m_tv)
        b_ds = b_next - tl.dot(tl.trans(b_w).to(tl.float32), b_dup, input_precision=DOT_PREC)

    if HAS_DH0:
        tl.store(dh0 + state_off, b_ds, mask=m_kv)


@triton.jit
def kda_state_bwd_fused_kernel(
    qg, kr, w, aqk, gam, do, dht,
    dup, dchunk_states, dh0,
    cu_seqlens, seq_offsets,  # varlen (IS_VARLEN): _indexing.py
    ds_offsets,  # COMPACT: each sequence's first dS_C slot (a stand-in otherwise)
    T, NC,
    H, HV,  # runtime: one compiled kernel serves every head count
    K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DHT: tl.constexpr, DOT_PREC: tl.constexpr, BF16_DOTS: tl.constexpr = False,
    IS_VARLEN: tl.constexpr = False, HAS_DH0: tl.constexpr = True, INTERPRET: tl.constexpr = False,
    COMPACT: tl.constexpr = False, GLAST_AHEAD: tl.constexpr = False, AQK_ROW_MASK: tl.constexpr = False,
):
    """The reverse scan with its parallel part inside (settings.SCAN_BWD_FUSED): per
    chunk, from the last, dS_C is stored, then
      dU' = A_qk^T dO + Kr dS_C          (stored: intra_bwd_w.py and intra_bwd.py read it)
      dS0 = exp(Gam) dS_C + Qg^T dO - W^T dU'.
    Each chunk reads only the inputs of its own dots and writes what it forms, nothing
    it read (no slot shared with the prep kernel, so no barrier), in the order of
    the forward scan's loop. dU' is stored in ``dup``'s dtype (bf16 under
    settings.BF16_DUP, the rounding its own dot W^T dU' takes with BF16_DOTS). BF16_DOTS (bf16 Qg,
    Kr, W, A_qk and dO): dS_C and dU' enter their dots rounded to bf16, as fla's dh
    kernel does; dS is carried in fp32. COMPACT: as kda_state_bwd_kernel (dS_C of a
    sequence's chunk c in its slot c; the last chunk's, zero, not stored)."""
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_hv, i_h, bos, T, NC, g_0, s_0 = sequence_coords(i_bh, T, NC, H, HV, cu_seqlens, seq_offsets, BT,
                                                         IS_VARLEN)
    # Each pointer moves to this sequence and head once, in 64-bit, and to each
    # chunk in 64-bit in the loop; offsets inside a chunk are 32-bit at any T.
    qg += (bos * HV + i_hv) * K
    kr += (bos * HV + i_hv) * K
    w += (bos * HV + i_hv) * K
    gam += (bos * HV + i_hv) * K
    aqk += (bos * HV + i_hv) * BT
    do += (bos * HV + i_hv) * V
    dup += (bos * HV + i_hv) * V
    dht += (i_b * HV + i_hv) * K * V
    dh0 += (i_b * HV + i_hv) * K * V
    if COMPACT:
        dchunk_states += (tl.load(ds_offsets + i_b) * HV + i_hv) * K * V
    else:
        dchunk_states += (g_0 * HV + i_hv) * K * V
    cs_stride = tl.cast(HV, tl.int64) * K * V  # from one chunk to the next

    o_k, m_k, o_v, m_v, m_kv, state_off = state_tile(i_v, K, V, BK, BV)
    o_r = tl.arange(0, BT)
    row_k = (o_r[:, None]) * (HV * K) + o_k[None, :]
    row_v = (o_r[:, None]) * (HV * V) + o_v[None, :]
    row_a = (o_r[:, None]) * (HV * BT) + o_r[None, :]
    causal = o_r[:, None] >= o_r[None, :]  # A_qk's lower triangle, its diagonal included

    if HAS_DHT:
        b_ds = tl.load(dht + state_off, mask=m_kv, other=0.0).to(tl.float32)
    else:
        b_ds = tl.zeros([BK, BV], dtype=tl.float32)

    # Packed sequences without a grad of their final states (training): the last chunk's
    # dS_C is 0, so its dU' is A_qk^T dO alone and its dS_C is not stored (intra_bwd_w.py
    # does not read it without dht); dS entering it is formed only where an earlier chunk
    # or dh0 reads it (as kda_state_bwd_kernel).
    PEEL: tl.constexpr = IS_VARLEN and not HAS_DHT
    if PEEL:
        if NC > 0:
            i_c = NC - 1
            r0 = tl.cast(i_c * BT, tl.int64)
            m_t = i_c * BT + o_r < T
            b_do = tl.load(do + r0 * (HV * V) + row_v, mask=m_t[:, None] & m_v[None, :], other=0.0)
            b_a = tl.load(aqk + r0 * (HV * BT) + row_a, mask=m_t[:, None] & causal, other=0.0)
            b_dup = dot(tl.trans(b_a), b_do, BF16_DOTS, DOT_PREC, INTERPRET)
            tl.store(dup + r0 * (HV * V) + row_v, as_stored(b_dup, dup, INTERPRET), mask=m_t[:, None] & m_v[None, :])
            if (NC > 1) | HAS_DH0:
                b_qg = tl.load(qg + r0 * (HV * K) + row_k, mask=m_t[:, None] & m_k[None, :], other=0.0)
                b_w = tl.load(w + r0 * (HV * K) + row_k, mask=m_t[:, None] & m_k[None, :], other=0.0)
                b_ds = (dot(tl.trans(b_qg), b_do, BF16_DOTS, DOT_PREC, INTERPRET)
                        - dot(tl.trans(b_w), b_dup, BF16_DOTS, DOT_PREC, INTERPRET))
    # GLAST_AHEAD (settings.SCAN_BWD_GLAST_AHEAD): each chunk's last row of gam loaded a chunk
    # ahead, as in the forward scan (the chunks before the last are full).
    if GLAST_AHEAD:
        i_first = NC - 1 - (1 if PEEL else 0)
        b_glast = tl.load(gam + (tl.minimum(tl.cast(i_first + 1, tl.int64) * BT, T) - 1) * (HV * K) + o_k,
                          mask=m_k & ((i_first + 0 * o_k) >= 0), other=0.0)
    for i_rev in range(1 if PEEL else 0, NC):
        i_c = NC - 1 - i_rev
        r0 = tl.cast(i_c * BT, tl.int64)  # the chunk's first row
        if GLAST_AHEAD:
            b_glast_next = tl.load(gam + (r0 - 1) * (HV * K) + o_k, mask=m_k & ((i_c + 0 * o_k) > 0), other=0.0)
        m_t = i_c * BT + o_r < T
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        tl.store(dchunk_states + i_c * cs_stride + state_off, as_stored(b_ds, dchunk_states, INTERPRET), mask=m_kv)
        b_kr = tl.load(kr + r0 * (HV * K) + row_k, mask=m_tk, other=0.0)
        b_do = tl.load(do + r0 * (HV * V) + row_v, mask=m_tv, other=0.0)
        if AQK_ROW_MASK:
            # (settings.SCAN_AQK_ROW_MASK) rows masked in the load, the upper triangle after
            # it: under the causal mask the load goes element by element (16 LDG.U16 a
            # thread on sm_90a) and outside the pipeliner, so every chunk waits on it
            b_a = tl.where(causal, tl.load(aqk + r0 * (HV * BT) + row_a, mask=m_t[:, None], other=0.0), 0.0)
        else:
            b_a = tl.load(aqk + r0 * (HV * BT) + row_a, mask=m_t[:, None] & causal, other=0.0)
        b_dup = (dot(tl.trans(b_a), b_do, BF16_DOTS, DOT_PREC, INTERPRET)
                 + dot(b_kr, b_ds, BF16_DOTS, DOT_PREC, INTERPRET))
        tl.store(dup + r0 * (HV * V) + row_v, as_stored(b_dup, dup, INTERPRET), mask=m_tv)
        b_qg = tl.load(qg + r0 * (HV * K) + row_k, mask=m_tk, other=0.0)
        b_w = tl.load(w + r0 * (HV * K) + row_k, mask=m_tk, other=0.0)
        if not GLAST_AHEAD:
            # the chunk's last row of gam (gam has the rows of the inputs, _indexing.py)
            b_glast = tl.load(gam + (tl.minimum(r0 + BT, T) - 1) * (HV * K) + o_k, mask=m_k, other=0.0)
        b_ds = (b_ds * tl.exp(b_glast)[:, None] + dot(tl.trans(b_qg), b_do, BF16_DOTS, DOT_PREC, INTERPRET)
                - dot(tl.trans(b_w), b_dup, BF16_DOTS, DOT_PREC, INTERPRET))
        if GLAST_AHEAD:
            b_glast = b_glast_next

    if HAS_DH0:
        tl.store(dh0 + state_off, b_ds, mask=m_kv)
