"""Stage 1 (the first launch unless settings.INTRA_GAM_KERNEL is 0): gam = cumsum(g) in each chunk.

One program per (chunk, batch * value head, K block of BKG). It writes gam
[B, T, HV, K] in fp32 (the chunk's valid rows; readers take a row past the
sequence's end from its last one, _indexing.gam_row), so that intra_a_fwd.py reads gam, and the chunk's middle and last
rows as plain vector loads, instead of forming them with a cross-warp scan and
two cross-warp reductions for every K slice.

With fla's in-kernel gate (GATE > 0, _gate.py) g is the raw gate and the log
decay is formed here, on the way into the cumsum, so it is never stored.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._gate import gate_fwd, gate_params
from ._indexing import chunk_coords


@triton.jit
def kda_gam_fwd_kernel(
    g, gam, spreads, A_log, dt_bias, lower_bound,
    cu_seqlens, chunk_index,  # varlen (IS_VARLEN): _indexing.py
    T, NC,
    H, HV,  # runtime: one compiled kernel serves every head count
    K: tl.constexpr, BT: tl.constexpr, BKG: tl.constexpr,
    GATE: tl.constexpr = 0, HAS_A: tl.constexpr = False, HAS_BIAS: tl.constexpr = False,
    IS_VARLEN: tl.constexpr = False, BC: tl.constexpr = 16, SPREADS: tl.constexpr = True,
):
    """SPREADS: also write, for intra_a_fwd.py's choice of path, how far this K
    block's gam strays from the chunk's middle row and, the largest over the chunk's
    BC-row blocks, from its block's middle row: spreads [B * NC * HV, NKB, 2] fp32.
    Not where the log decay is known <= 0 (intra_a_fwd's ROW_SPREADS: it reads
    them off three rows of gam a block; the reductions here took gam_fwd 0.39 -> 1.34 ms
    at 2048 packed sequences of 1-64 tokens, H200)."""
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_k = tl.program_id(2)
    i_b, i_hv, _, bos, T, g_c, _ = chunk_coords(i_c, i_bh, T, NC, H, HV, cu_seqlens, chunk_index, BT, IS_VARLEN)
    if IS_VARLEN:
        if T <= 0:  # an unused chunk slot (past the last sequence's chunks): no row of gam
            return
    # Each pointer moves to this chunk and head once, in 64-bit (bos: the chunk's
    # first row); offsets inside the chunk are 32-bit at any T.
    g += (bos * HV + i_hv) * K
    gam += (bos * HV + i_hv) * K
    o_t = tl.arange(0, BT)
    o_k = i_k * BKG + tl.arange(0, BKG)
    m_k = o_k < K
    p_tk = (o_t[:, None]) * (HV * K) + o_k[None, :]
    m_tk = (o_t < T)[:, None] & m_k[None, :]
    b_g = tl.load(g + p_tk, mask=m_tk, other=0.0).to(tl.float32)
    if GATE:
        b_a, b_bias = gate_params(A_log, dt_bias, i_hv, o_k, m_k, K, HAS_A, HAS_BIAS)
        # rows past the end stay 0 (the gate of 0 is not 0)
        b_g = tl.where(m_tk, gate_fwd(b_g, b_a, b_bias, lower_bound, GATE), 0.0)
    b_gam = tl.cumsum(b_g, axis=0)
    tl.store(gam + p_tk, b_gam, mask=m_tk)
    if SPREADS:
        # rows past the end hold the last gam here, as every reader of gam sees them
        # (_indexing.gam_row); columns past K hold 0
        # each spread in one reduction over the flattened tile (max is exact in any
        # order): as row then column reductions the kernel took 3832 SASS instructions
        # (644 shuffles) and 0.035 -> 0.102 ms at 8192 tokens of 16 heads (H200); so
        # 2192 (12 shuffles) in the same time (0.101 ms; H200, 2026-12-01)
        b_mid = tl.sum(tl.where((o_t == BT // 2)[:, None], b_gam, 0.0), 0)
        chunk_spread = tl.max(tl.reshape(tl.abs(b_gam - b_mid[None, :]), (BT * BKG,)), 0)
        NB: tl.constexpr = BT // BC
        b_blocks = tl.reshape(b_gam, (NB, BC, BKG))
        o_c = tl.arange(0, BC)
        b_bmid = tl.sum(tl.where((o_c == BC // 2)[None, :, None], b_blocks, 0.0), 1)  # [NB, BKG]
        block_spread = tl.max(tl.reshape(tl.abs(b_blocks - b_bmid[:, None, :]), (BT * BKG,)), 0)
        p_sp = spreads + ((g_c * HV + i_hv) * tl.num_programs(2) + i_k) * 2
        tl.store(p_sp, chunk_spread)
        tl.store(p_sp + 1, block_spread)
