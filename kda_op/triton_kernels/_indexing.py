"""Index helpers shared by the kernels: which sequence, head and chunk a
program serves, for a batch of equal-length sequences ([B, T, ...]) or, with
IS_VARLEN, for sequences packed along T (B = 1, ``cu_seqlens`` [N + 1]).

Packed sequences never share a chunk: sequence n's chunks are numbered
globally from ``chunk_offsets[n]`` (the chunks of the sequences before it), so
per-chunk buffers ([NCB, HV, ...], NCB = T // BT + N slots, an upper bound on
the chunk count that needs no host sync) take the global chunk index. The chunk
states take the layout of ``_contract.varlen_state_slots``: with initial states
each sequence's NC_n + 1 boundaries from ``chunk_offsets[n] + n``; without, only
the states entering its chunks after the first (chunk 0 enters from zero, which
is neither stored nor read, and the final state is not kept), T // BT + 2 slots.
Chunk-parallel kernels run one program per slot of NCB; ``chunk_index`` [NCB, 3]
says which (sequence, chunk, state slot) a slot holds, (-1, 0, -1) for a slot
beyond the last chunk, whose program sees a sequence of length 0 (T_c = 0; a
used slot always has T_c >= 1): the chunk-parallel kernels return at once there,
but for what an op output or a host-side sum over the slots needs (intra_a_fwd
first writes its steep flag 0, intra_bwd_a its zero gate partial sums). The
per-sequence kernels read ``seq_offsets`` [N, 2]: the first chunk's global index
and the slot of the state entering it.

gam (the cumsum of the log decay in each chunk) has the rows of the inputs,
[B, T, HV, K]: a row past the sequence's end (in a short or last chunk) reads the
chunk's last row instead (``gam_row``), the value a cumsum over zeros there would
hold, so no buffer is padded to whole chunks (three times the rows at 2048
packed sequences of 1 to 64 tokens).

64-bit offsets: the base of every tensor moves once per program in 64-bit, to
the chunk (chunk-parallel kernels) or, per chunk or token, inside the loop of a
per-sequence kernel; what is added to it then spans one chunk or one row, so no
32-bit offset grows with T (T up to 2^31 - 1 rows, Triton's int32 arguments).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def chunk_coords(i_c, i_bh, T, NC, H, HV, cu_seqlens, chunk_index, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """For a chunk-parallel program (chunk slot ``i_c``, (batch *) value head
    ``i_bh``, 64-bit): ``(n, i_hv, i_h, bos, T_c, g_c, s_c)``: the sequence, the
    value head, the key head, the chunk's first row (64-bit, among all B * T or
    packed rows), how many rows of the sequence lie from there on (int32; the
    chunk's valid rows are those below both BT and T_c, none for an unused slot),
    the chunk's global index (per-chunk buffers) and the slot of the state
    entering it (chunk states). Offsets inside a chunk then stay small at any T."""
    if IS_VARLEN:
        i_hv = i_bh
        n = tl.load(chunk_index + i_c * 3).to(tl.int64)
        c = tl.load(chunk_index + i_c * 3 + 1)
        valid = n >= 0
        n = tl.maximum(n, 0)
        bos = tl.load(cu_seqlens + n).to(tl.int64)
        T_n = tl.where(valid, tl.load(cu_seqlens + n + 1).to(tl.int64) - bos, 0)
        g_c = i_c.to(tl.int64)
        s_c = tl.load(chunk_index + i_c * 3 + 2).to(tl.int64)
    else:
        n = i_bh // HV
        i_hv = i_bh % HV
        c = i_c
        bos = n * T
        T_n = T
        g_c = n * NC + i_c
        s_c = n * (NC + 1) + i_c
    i_h = i_hv // (HV // H)
    T_c = (T_n - c * BT).to(tl.int32)
    return n, i_hv, i_h, bos + c * BT, T_c, g_c, s_c


@triton.jit
def sequence_coords(i_bh, T, NC, H, HV, cu_seqlens, seq_offsets, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """For a per-sequence program ((sequence *) value head ``i_bh``, 64-bit):
    ``(n, i_hv, i_h, bos, T_n, NC_n, g_0, s_0)``: the sequence, the heads, its
    first row, length and chunk count, its first chunk's global index and the slot
    of the state entering its first chunk (chunk c's at s_0 + c; without initial
    states s_0 itself is never stored: see the module docstring)."""
    n = i_bh // HV
    i_hv = i_bh % HV
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + n).to(tl.int64)
        T_n = tl.load(cu_seqlens + n + 1).to(tl.int64) - bos
        NC_n = tl.cdiv(T_n, BT)
        g_0 = tl.load(seq_offsets + n * 2)
        s_0 = tl.load(seq_offsets + n * 2 + 1)
    else:
        bos = n * T
        T_n = T
        NC_n = NC
        g_0 = n * NC
        s_0 = n * (NC + 1)
    i_h = i_hv // (HV // H)
    return n, i_hv, i_h, bos, T_n, NC_n, g_0, s_0


@triton.jit
def gam_row(r, T_c):
    """The row of gam that row ``r`` of a chunk (``T_c`` rows from the chunk's first
    to the sequence's end, >= 1) reads: ``r`` itself, or past the sequence's end the
    chunk's last row, what gam would hold there (g = 0 past the end). Every such
    read stays inside the chunk's rows."""
    return tl.minimum(r, T_c - 1)


@triton.jit
def row_block_slice(q, k, gam, o_i, m_i, i_s, scale, T, H, HV, K: tl.constexpr, BKS: tl.constexpr):
    """K slice ``i_s`` (``BKS`` wide) of rows ``o_i`` (mask ``m_i``) of a chunk's Q * scale,
    K and gam (gam's rows past the end: the last, gam_row), fp32, with the slice's columns
    and their mask. The pointers are at the chunk's first row and this head."""
    o_s = i_s * BKS + tl.arange(0, BKS)
    m_s = o_s < K
    m_is = m_i[:, None] & m_s[None, :]
    b_qi = tl.load(q + (o_i[:, None]) * (H * K) + o_s[None, :], mask=m_is, other=0.0).to(tl.float32) * scale
    b_ki = tl.load(k + (o_i[:, None]) * (H * K) + o_s[None, :], mask=m_is, other=0.0).to(tl.float32)
    b_gi = tl.load(gam + (gam_row(o_i, T)[:, None]) * (HV * K) + o_s[None, :], mask=m_s[None, :], other=0.0)
    return o_s, m_s, b_qi, b_ki, b_gi


@triton.jit
def chunk_in_sequence(i_c, chunk_index, IS_VARLEN: tl.constexpr):
    """Which chunk of its sequence chunk slot ``i_c`` holds (0: the first), for the
    chunk-parallel kernels that skip what is zero there: the state entering a
    sequence's first chunk without an initial state."""
    if IS_VARLEN:
        return tl.load(chunk_index + i_c * 3 + 1)
    else:
        return i_c


@triton.jit
def left_to_the_other_launch(T_c, TILE: tl.constexpr, SKIP_TILED: tl.constexpr):
    """For a chunk-parallel kernel launched twice for short packed sequences
    (settings.SHORT_TILE): whether this launch leaves the chunk (``T_c`` rows from
    its first to the sequence's end, >= 1) to the other one. The launch on tiles of
    TILE rows takes the chunks of at most TILE rows; the launch at BT, told
    SKIP_TILED, the others. Neither set (one launch): False."""
    leave = T_c < 0
    if TILE > 0:
        leave = T_c > TILE
    if SKIP_TILED > 0:
        leave = T_c <= SKIP_TILED
    return leave


# Work lists (settings.STEEP_WORK_LIST): a launch whose items are mostly idle (the steep
# launches: one item per chunk, head and row block or K slice, most of whose flags say
# "not mine") runs a 1-D grid of a few programs per SM instead; each reads its share of
# the flags WL_BLOCK at a time and does the flagged items one after another. Items are
# numbered as the flags ([B, NC, HV] or [NCB, HV] packed), SUB items per flag.


@triton.jit
def work_list_range(n_flags, SUB: tl.constexpr):
    """This program's share of the ``n_flags * SUB`` items, contiguous: its first
    item and one past its last (64-bit; empty for the programs past the items)."""
    n_items = tl.cast(n_flags, tl.int64) * SUB
    per = tl.cdiv(n_items, tl.num_programs(0))
    start = tl.program_id(0).to(tl.int64) * per
    return start, tl.minimum(start + per, n_items)


@triton.jit
def work_list_block(flags, base, end, SUB: tl.constexpr, WANT: tl.constexpr, WL_BLOCK: tl.constexpr):
    """Items ``base`` to ``base + WL_BLOCK - 1`` (those below ``end``): ``(o_w,
    pending, n_todo)``: the items, the same with every item not to do replaced by
    ``end`` (take ``tl.min(pending)`` for the next one to do, then replace it), and
    how many there are to do. An item is to do where its flag equals WANT, or (WANT
    < 0) is not 0."""
    o_w = base + tl.arange(0, WL_BLOCK)
    m_w = o_w < end
    f = tl.load(flags + o_w // SUB, mask=m_w, other=0)
    if WANT < 0:
        todo = m_w & (f != 0)
    else:
        todo = m_w & (f == WANT)
    return o_w, tl.where(todo, o_w, end), tl.sum(todo.to(tl.int32), 0)


@triton.jit
def work_list_item(item, NC, HV, SUB: tl.constexpr):
    """``(i_c, i_bh, i_sub)`` of work-list ``item`` = (g_c * HV + i_hv) * SUB + i_sub:
    the chunk slot and the (batch *) value head (64-bit) that a program of the full
    grid would have had (g_c = b * NC + i_c, the flags' layout; packed sequences
    have B = 1 and g_c = i_c), and the sub-item (row block or K slice)."""
    flat = item // SUB
    g_c = flat // HV
    return (g_c % NC).to(tl.int32), (g_c // NC) * HV + flat % HV, (item % SUB).to(tl.int32)


# The scans (state_fwd.py, state_output_fwd.py, state_bwd.py): each program holds the
# [BK, BV] tile of a [K, V] state that its V block covers.


@triton.jit
def state_tile(i_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """V block ``i_v``'s tile of a [K, V] state: ``(o_k, m_k, o_v, m_v, m_kv, state_off)``,
    the rows and columns with their masks, the tile's mask and its offsets in the state."""
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    return o_k, m_k, o_v, m_v, m_k[:, None] & m_v[None, :], o_k[:, None] * V + o_v[None, :]


@triton.jit
def scan_ends(h0, ht, slots, i_b, i_hv, HV, o_k, o_v, m_kv, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr, HAS_H0: tl.constexpr, POOL: tl.constexpr, V_FIRST: tl.constexpr):
    """Where a forward scan starts and what it leaves: ``(b_s, ht, ends_off, m_ends, live)``,
    the fp32 tile of the initial state (h0's, or zeros without HAS_H0), ht moved to
    sequence ``i_b``'s final state (64-bit), or with POOL both at its slot ``slots[i_b]``
    in the pool that h0 and ht both are; the tile's offsets there ([.., V, K] with
    V_FIRST: the pool's layout) and their mask, and whether the slot is live (a negative
    slot: zeros read, nothing written; POOL only)."""
    if POOL:
        slot = tl.load(slots + i_b).to(tl.int64)
        h0 += (tl.maximum(slot, 0) * HV + i_hv) * K * V
        ht += (tl.maximum(slot, 0) * HV + i_hv) * K * V
        live = slot >= 0
        m_ends = m_kv & ((slot + 0 * o_k) >= 0)[:, None]  # a block mask: Triton >= 3.7's interpreter
    else:
        h0 += (i_b * HV + i_hv) * K * V
        ht += (i_b * HV + i_hv) * K * V
        live = True
        m_ends = m_kv
    if V_FIRST:
        ends_off = o_v[None, :] * K + o_k[:, None]
    else:
        ends_off = o_k[:, None] * V + o_v[None, :]
    if HAS_H0:
        b_s = tl.load(h0 + ends_off, mask=m_ends, other=0.0).to(tl.float32)
    else:
        b_s = tl.zeros([BK, BV], dtype=tl.float32)
    return b_s, ht, ends_off, m_ends, live
