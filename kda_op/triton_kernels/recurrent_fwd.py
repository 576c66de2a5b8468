"""Decode and short sequences: the recurrence token by token, state on chip.

One program per (V block, batch * value head) holds S [BK, BV] in fp32 registers
for the whole sequence: the state is read once and written once, so at T = 1 the
kernel moves little more than the state's bytes. Per token:
  S <- exp(g_t)[:, None] * S;  r = v_t - k_t^T S;  S <- S + (beta_t k_t) r^T;  o_t = (scale q_t)^T S.

PERSISTENT (settings.RECURRENT_PERSISTENT): a fixed number of programs, each walking
the tiles (V block, sequence * value head) p, p + P, p + 2P, ... With PREFETCH 1 a
program loads the next tile's pool slot while it works on the current tile (the
state load then does not wait on the slot's); with PREFETCH 2 it also loads the
next tile's state then, so that one tile's state is in flight while the program
computes and stores another's. A tile's state is read before the program writes
any: distinct tiles touch distinct state bytes (sequences of one call do not share
a slot), so reading the next tile early changes no result.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._gate import gate_fwd, gate_params
from ._indexing import sequence_coords


@triton.jit
def kda_recurrent_fwd_kernel(
    q, k, v, g, beta, h0,
    o, ht,
    A_log, dt_bias, lower_bound,
    cu_seqlens,  # varlen (IS_VARLEN): _indexing.py
    scale, T,
    H, HV,  # runtime: one compiled kernel serves every head count
    slots, accepted, slots_stride,  # POOL (stand-ins otherwise, never read)
    n_tiles,  # PERSISTENT: V blocks times sequences times value heads
    K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, STREAM_HINTS: tl.constexpr = False, INPUT_HINTS: tl.constexpr = False,
    GATE: tl.constexpr = 0, HAS_A: tl.constexpr = False, HAS_BIAS: tl.constexpr = False,
    IS_VARLEN: tl.constexpr = False,
    POOL: tl.constexpr = False, SLOTS_2D: tl.constexpr = False, HAS_ACCEPTED: tl.constexpr = False,
    V_FIRST: tl.constexpr = False, PERSISTENT: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
):
    # POOL: h0 and ht are one state pool [num_slots, HV, K, V] ([.., V, K] with
    # V_FIRST), updated in place: sequence i_b starts from slot slots[i_b] (1-D) or
    # slots[i_b, accepted[i_b] - 1] (SLOTS_2D; column 0 without HAS_ACCEPTED) and
    # writes its final state there (1-D) or its state after token t to slots[i_b,
    # t] (SLOTS_2D). A negative start slot: a padding sequence, which reads and
    # writes no state and outputs zeros; a negative slots[i_b, t]: no write. Each
    # program reads its state tile whole before it writes any.
    # GATE: fla's in-kernel gate (_gate.py) on each token's raw g
    # STREAM_HINTS: the state is read once and written once, never reused by this
    # launch: load it evict-first and store it streaming (.cs), keeping L2 for q,
    # k, g, v of the other programs. INPUT_HINTS: q, k and g, which the programs of
    # the other V blocks (and of the other value heads of a group) read again,
    # evict-last; v and o, read or written once, evict-first.
    # PERSISTENT / PREFETCH: the module docstring. Without PERSISTENT the grid is
    # (V blocks, sequences * value heads), one tile a program.
    NV: tl.constexpr = (V + BV - 1) // BV
    if PERSISTENT:
        pid = tl.program_id(0)
        n_prog = tl.num_programs(0)
        slot0 = _start_slot(pid // NV // HV, slots, accepted, slots_stride, POOL, SLOTS_2D, HAS_ACCEPTED)
        if PREFETCH == 2:
            b_s = _load_state(pid, slot0, h0, HV, K, V, BK, BV, NV, HAS_H0, STREAM_HINTS, POOL, V_FIRST)
        else:
            b_s = tl.zeros([BK, BV], dtype=tl.float32)
        for tile in range(pid, n_tiles, n_prog):
            # the next tile (this one again past the last: read, never used)
            nxt = tl.minimum(tile + n_prog, n_tiles - 1)
            if PREFETCH >= 1:
                slot_n = _start_slot(nxt // NV // HV, slots, accepted, slots_stride, POOL, SLOTS_2D, HAS_ACCEPTED)
            else:
                slot_n = slot0
            if PREFETCH == 2:
                b_s_n = _load_state(nxt, slot_n, h0, HV, K, V, BK, BV, NV, HAS_H0, STREAM_HINTS, POOL, V_FIRST)
            else:
                if PREFETCH == 0:
                    slot0 = _start_slot(tile // NV // HV, slots, accepted, slots_stride, POOL, SLOTS_2D, HAS_ACCEPTED)
                b_s = _load_state(tile, slot0, h0, HV, K, V, BK, BV, NV, HAS_H0, STREAM_HINTS, POOL, V_FIRST)
                b_s_n = b_s
            _tile(tile, slot0, b_s, q, k, v, g, beta, o, ht, A_log, dt_bias, lower_bound, cu_seqlens, scale, T,
                  H, HV, slots, slots_stride, K, V, BK, BV, NV, STREAM_HINTS, INPUT_HINTS, GATE, HAS_A, HAS_BIAS,
                  IS_VARLEN, POOL, SLOTS_2D, V_FIRST)
            slot0 = slot_n
            b_s = b_s_n
    else:
        tile = tl.program_id(1).to(tl.int64) * NV + tl.program_id(0)
        slot0 = _start_slot(tile // NV // HV, slots, accepted, slots_stride, POOL, SLOTS_2D, HAS_ACCEPTED)
        b_s = _load_state(tile, slot0, h0, HV, K, V, BK, BV, NV, HAS_H0, STREAM_HINTS, POOL, V_FIRST)
        _tile(tile, slot0, b_s, q, k, v, g, beta, o, ht, A_log, dt_bias, lower_bound, cu_seqlens, scale, T,
              H, HV, slots, slots_stride, K, V, BK, BV, NV, STREAM_HINTS, INPUT_HINTS, GATE, HAS_A, HAS_BIAS,
              IS_VARLEN, POOL, SLOTS_2D, V_FIRST)


@triton.jit
def _start_slot(i_b, slots, accepted, slots_stride, POOL: tl.constexpr, SLOTS_2D: tl.constexpr,
                HAS_ACCEPTED: tl.constexpr):
    """The pool slot sequence ``i_b`` starts from (0 without POOL: unused)."""
    if POOL:
        i_b = tl.cast(i_b, tl.int64)
        if SLOTS_2D:
            if HAS_ACCEPTED:
                t_start = tl.load(accepted + i_b).to(tl.int64) - 1
            else:
                t_start = 0
            slot0 = tl.load(slots + i_b * slots_stride + t_start).to(tl.int64)
        else:
            slot0 = tl.load(slots + i_b).to(tl.int64)
    else:
        slot0 = tl.zeros([], dtype=tl.int64)
    return slot0


@triton.jit
def _state_offsets(i_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   V_FIRST: tl.constexpr):
    """The state tile's offsets inside one [K, V] state ([V, K] with V_FIRST) and its mask."""
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k < K)[:, None] & (o_v < V)[None, :]
    if V_FIRST:
        state_off = o_v[None, :] * K + o_k[:, None]
    else:
        state_off = o_k[:, None] * V + o_v[None, :]
    return state_off, m_kv


@triton.jit
def _load_state(tile, slot0, h0, HV, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                NV: tl.constexpr, HAS_H0: tl.constexpr, STREAM_HINTS: tl.constexpr, POOL: tl.constexpr,
                V_FIRST: tl.constexpr):
    """Tile ``tile``'s initial state [BK, BV] in fp32 (zeros without HAS_H0 or for a
    padding sequence's negative slot)."""
    if HAS_H0:
        tile = tl.cast(tile, tl.int64)
        i_v = tile % NV
        i_bh = tile // NV
        i_hv = i_bh % HV
        state_off, m_kv = _state_offsets(i_v, K, V, BK, BV, V_FIRST)
        if POOL:
            # the mask as a block (Triton >= 3.7's interpreter refuses a block & scalar mask)
            m_kv = m_kv & ((slot0 + 0 * state_off) >= 0)
            h0 += (tl.maximum(slot0, 0) * HV + i_hv) * K * V
        else:
            h0 += i_bh * K * V
        if STREAM_HINTS:
            b_s = tl.load(h0 + state_off, mask=m_kv, other=0.0, eviction_policy="evict_first").to(tl.float32)
        else:
            b_s = tl.load(h0 + state_off, mask=m_kv, other=0.0).to(tl.float32)
    else:
        b_s = tl.zeros([BK, BV], dtype=tl.float32)
    return b_s


@triton.jit
def _tile(tile, slot0, b_s, q, k, v, g, beta, o, ht, A_log, dt_bias, lower_bound, cu_seqlens, scale, T, H, HV,
          slots, slots_stride, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
          NV: tl.constexpr, STREAM_HINTS: tl.constexpr, INPUT_HINTS: tl.constexpr, GATE: tl.constexpr,
          HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr, IS_VARLEN: tl.constexpr, POOL: tl.constexpr,
          SLOTS_2D: tl.constexpr, V_FIRST: tl.constexpr):
    """Tile ``tile`` (V block tile % NV of sequence * value head tile // NV) from its
    initial state ``b_s`` (read from slot ``slot0`` under POOL): its tokens' outputs,
    and its final state (or, SLOTS_2D, the state after each token) stored."""
    tile = tl.cast(tile, tl.int64)
    i_v = tile % NV
    i_bh = tile // NV
    i_b, i_hv, i_h, bos, T, _, _, _ = sequence_coords(i_bh, T, 0, H, HV, cu_seqlens, cu_seqlens, 1, IS_VARLEN)
    # Each pointer moves to this sequence and head once, in 64-bit, and to each
    # token in 64-bit in the loop; offsets inside a row are 32-bit at any T.
    q += (bos * H + i_h) * K
    k += (bos * H + i_h) * K
    v += (bos * HV + i_hv) * V
    o += (bos * HV + i_hv) * V
    g += (bos * HV + i_hv) * K
    beta += bos * HV + i_hv
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    state_off, m_kv = _state_offsets(i_v, K, V, BK, BV, V_FIRST)
    if POOL:
        slot_size = tl.cast(HV, tl.int64) * K * V
        ht += i_hv * K * V  # the pool, at this head; slots move it further
        live = slot0 >= 0
        m_live = m_kv & ((slot0 + 0 * o_k) >= 0)[:, None]
    else:
        ht += (i_b * HV + i_hv) * K * V
        live = True
        m_live = m_kv

    # The hints as policy names, "" being Triton's default (no hint).
    if STREAM_HINTS:
        state_store: tl.constexpr = ".cs"
    else:
        state_store: tl.constexpr = ""
    if INPUT_HINTS:
        reread: tl.constexpr = "evict_last"
        once: tl.constexpr = "evict_first"
    else:
        reread: tl.constexpr = ""
        once: tl.constexpr = ""

    if GATE:
        b_ga, b_gbias = gate_params(A_log, dt_bias, i_hv, o_k, m_k, K, HAS_A, HAS_BIAS)

    for t in range(T):
        t64 = tl.cast(t, tl.int64)
        row_qk = t64 * (H * K)  # scalars: the pointers move first, then the 32-bit o_k, o_v
        row_hv = t64 * HV
        b_q = tl.load(q + row_qk + o_k, mask=m_k, other=0.0, eviction_policy=reread).to(tl.float32) * scale
        b_k = tl.load(k + row_qk + o_k, mask=m_k, other=0.0, eviction_policy=reread).to(tl.float32)
        b_g = tl.load(g + row_hv * K + o_k, mask=m_k, other=0.0, eviction_policy=reread).to(tl.float32)
        # beta between q, k, g and v: the load order of the kernel timed on the H200
        b_beta = tl.load(beta + row_hv).to(tl.float32)
        b_v = tl.load(v + row_hv * V + o_v, mask=m_v, other=0.0, eviction_policy=once).to(tl.float32)

        if GATE:
            b_g = tl.sum(gate_fwd(b_g[None, :], b_ga, b_gbias, lower_bound, GATE), 0)
        b_s = b_s * tl.exp(b_g)[:, None]
        b_r = b_v - tl.sum(b_k[:, None] * b_s, 0)
        b_s += (b_beta * b_k)[:, None] * b_r[None, :]
        b_o = tl.sum(b_q[:, None] * b_s, 0)
        if POOL:
            b_o = tl.where(live, b_o, 0.0)  # a padding sequence outputs zeros
            if SLOTS_2D:
                # a token past T_max (slots_stride) has no slot: no write, and no read
                # into the next sequence's row
                slot_t = tl.load(slots + i_b * slots_stride + tl.minimum(t, slots_stride - 1)).to(tl.int64)
                slot_t = tl.where(t < slots_stride, slot_t, -1)
                tl.store(ht + tl.maximum(slot_t, 0) * slot_size + state_off, b_s,
                         mask=m_live & ((slot_t + 0 * o_k) >= 0)[:, None], cache_modifier=state_store)
        tl.store(o + row_hv * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v, eviction_policy=once)

    if POOL:
        if not SLOTS_2D:
            tl.store(ht + tl.maximum(slot0, 0) * slot_size + state_off, b_s, mask=m_live & ((T + 0 * o_k) > 0)[:, None],
                     cache_modifier=state_store)
    else:
        tl.store(ht + state_off, b_s, mask=m_kv, cache_modifier=state_store)
