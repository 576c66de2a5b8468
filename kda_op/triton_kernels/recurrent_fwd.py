"""Decode and short sequences: the recurrence token by token, state on chip.

One program per (V block, batch * value head) holds S [BK, BV] in fp32 registers
for the whole sequence: the state is read once and written once, so at T = 1 the
kernel moves little more than the state's bytes. Per token:
  S <- exp(g_t)[:, None] * S;  r = v_t - k_t^T S;  S <- S + (beta_t k_t) r^T;  o_t = (scale q_t)^T S.
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
    K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, STREAM_HINTS: tl.constexpr = False, INPUT_HINTS: tl.constexpr = False,
    GATE: tl.constexpr = 0, HAS_A: tl.constexpr = False, HAS_BIAS: tl.constexpr = False,
    IS_VARLEN: tl.constexpr = False,
    POOL: tl.constexpr = False, SLOTS_2D: tl.constexpr = False, HAS_ACCEPTED: tl.constexpr = False,
    V_FIRST: tl.constexpr = False,
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
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
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
    m_kv = m_k[:, None] & m_v[None, :]
    if V_FIRST:
        state_off = o_v[None, :] * K + o_k[:, None]
    else:
        state_off = o_k[:, None] * V + o_v[None, :]
    if POOL:
        slot_size = tl.cast(HV, tl.int64) * K * V
        h0 += i_hv * K * V  # the pool, at this head; slots move it further
        ht += i_hv * K * V
        if SLOTS_2D:
            if HAS_ACCEPTED:
                t_start = tl.load(accepted + i_b).to(tl.int64) - 1
            else:
                t_start = 0
            slot0 = tl.load(slots + i_b * slots_stride + t_start).to(tl.int64)
        else:
            slot0 = tl.load(slots + i_b).to(tl.int64)
        live = slot0 >= 0
        # the state tile's mask with it, as a block (Triton >= 3.7's interpreter
        # refuses a block & scalar mask)
        m_live = m_kv & ((slot0 + 0 * o_k) >= 0)[:, None]
        h0 += tl.maximum(slot0, 0) * slot_size
    else:
        h0 += (i_b * HV + i_hv) * K * V
        ht += (i_b * HV + i_hv) * K * V
        live = True
        m_live = m_kv

    # The hints as policy names, "" being Triton's default (no hint).
    if STREAM_HINTS:
        state_load: tl.constexpr = "evict_first"
        state_store: tl.constexpr = ".cs"
    else:
        state_load: tl.constexpr = ""
        state_store: tl.constexpr = ""
    if INPUT_HINTS:
        reread: tl.constexpr = "evict_last"
        once: tl.constexpr = "evict_first"
    else:
        reread: tl.constexpr = ""
        once: tl.constexpr = ""

    if HAS_H0:
        b_s = tl.load(h0 + state_off, mask=m_live, other=0.0, eviction_policy=state_load).to(tl.float32)
    else:
        b_s = tl.zeros([BK, BV], dtype=tl.float32)

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
