"""The packed sequences' chunk index (_indexing.py reads it) in one launch.

The same tensors as the torch-op version in ``_host._varlen_index_torch`` (which the
traced export op keeps: inductor compiles torch ops): per chunk slot of NCB its sequence,
its chunk in the sequence and the slot of the state entering it; per sequence its first
chunk's global index and the slot of the state entering it; the first unused state slot;
and each sequence's first compact dS_C slot (the backward's, settings.COMPACT_DSTATES:
one fewer than its chunks, none for an empty one; at most T // BT in all, as
ceil(L / BT) - 1 <= (L - 1) / BT for each length L >= 1).
On short packed sequences the host path bounds the wall time, and those torch ops are
some 25 launches a call (twice a training step); this is one.

Each program takes BS slots. It walks the sequences in blocks of BN, carrying the chunk
count and the stored-state count of the blocks before; for a block whose chunks overlap
its slots it finds each slot's sequence with a [BS, BN] comparison (a slot lies in at
most one sequence's chunk range). Program 0 also writes the per-sequence tensors.
Cost per program: N / BN loads of BN offsets, the comparison only where the ranges meet.
32-bit arithmetic: offsets, chunk and state counts stay below T + 2 N < 2^31 (the
kernels' int32 T, _host._check_grid).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def kda_varlen_index_kernel(
    cu_seqlens, chunk_index, seq_offsets, first_unused, dstate_offsets,
    N, NCB,
    BT: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, HAS_H0: tl.constexpr,
):
    i_p = tl.program_id(0)
    o_s = i_p * BS + tl.arange(0, BS)  # this program's chunk slots
    s_lo = i_p * BS
    o_b = tl.arange(0, BN)
    chunks_before = 0  # chunks of the sequences in earlier blocks
    stored_before = 0  # states stored for them without initial states: chunks - 1 each (at least 0)
    n_of = tl.full([BS], -1, dtype=tl.int32)
    c_of = tl.zeros([BS], dtype=tl.int32)
    st_of = tl.full([BS], -1, dtype=tl.int32)
    for i_n in range(0, tl.cdiv(N, BN)):
        o_n = i_n * BN + o_b
        m_n = o_n < N
        bos = tl.load(cu_seqlens + o_n, mask=m_n, other=0).to(tl.int32)
        eos = tl.load(cu_seqlens + o_n + 1, mask=m_n, other=0).to(tl.int32)
        chunks = tl.where(m_n, (eos - bos + BT - 1) // BT, 0)
        stored = tl.maximum(chunks - 1, 0)
        first_chunk = chunks_before + tl.cumsum(chunks, 0) - chunks
        stored_first = stored_before + tl.cumsum(stored, 0) - stored
        if HAS_H0:  # NC_n + 1 boundaries each (_contract.varlen_state_slots)
            state_start = first_chunk + o_n
        else:  # chunk c >= 1's entering state at the sequence's stored start + c - 1
            state_start = stored_first - 1
        if i_p == 0:
            tl.store(seq_offsets + o_n * 2, first_chunk.to(tl.int64), mask=m_n)
            tl.store(seq_offsets + o_n * 2 + 1, state_start.to(tl.int64), mask=m_n)
            tl.store(dstate_offsets + o_n, stored_first.to(tl.int64), mask=m_n)
        block_chunks = tl.sum(chunks, 0)
        if (chunks_before < s_lo + BS) & (chunks_before + block_chunks > s_lo):
            hit = ((o_s[:, None] >= first_chunk[None, :]) & (o_s[:, None] < (first_chunk + chunks)[None, :]))
            found = tl.sum(hit.to(tl.int32), 1) > 0
            n_hit = tl.sum(tl.where(hit, o_n[None, :], 0), 1)
            first_hit = tl.sum(tl.where(hit, first_chunk[None, :], 0), 1)
            st_hit = tl.sum(tl.where(hit, state_start[None, :], 0), 1)
            n_of = tl.where(found, n_hit, n_of)
            c_of = tl.where(found, o_s - first_hit, c_of)
            st_of = tl.where(found, st_hit + o_s - first_hit, st_of)
        chunks_before += block_chunks
        stored_before += tl.sum(stored, 0)
    m_s = o_s < NCB
    tl.store(chunk_index + o_s * 3, n_of, mask=m_s)
    tl.store(chunk_index + o_s * 3 + 1, c_of, mask=m_s)
    tl.store(chunk_index + o_s * 3 + 2, st_of, mask=m_s)
    if i_p == 0:
        if HAS_H0:
            tl.store(first_unused, (chunks_before + N).to(tl.int64))
        else:
            tl.store(first_unused, stored_before.to(tl.int64))
        tl.store(dstate_offsets + N, stored_before.to(tl.int64))
