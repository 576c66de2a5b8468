"""Stage 1a' (forward, settings.INTRA_DIAG_INV_KERNEL): the inverses of the diagonal
blocks of I + diag(beta) A_kk, in small programs of NBLK blocks each.

intra_wu_fwd.py forms Tm = (I + M)^-1, M = diag(beta) A_kk strictly lower, from the
inverses of M's BC x BC diagonal blocks D and dots. Its own forward substitution for
them runs BC - 1 dependent steps in each chunk's program. Here one program per (NBLK
16-row blocks, chunk, batch * value head), a single warp, runs them instead, each
step's reductions inside one warp; with NBLK > 1 (settings.DIAG_INV_BLOCKS) the
blocks' substitutions run side by side, so that one step's latency covers them all.
The blocks' rows of A_kk are read once into registers.

  dinv [B, T, HV, BC] fp32: row t holds row (t mod BC) of its block's (I + D)^-1;
  rows past a sequence's end are not written (intra_wu_fwd.py takes them as rows of I).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._indexing import chunk_coords


@triton.jit
def kda_diag_inv_kernel(
    akk, beta, dinv,
    cu_seqlens, chunk_index,  # varlen (IS_VARLEN): _indexing.py
    T, NC,
    H, HV,  # runtime: one compiled kernel serves every head count
    BT: tl.constexpr, BC: tl.constexpr, IS_VARLEN: tl.constexpr = False, NBLK: tl.constexpr = 1,
):
    # NBLK (settings.DIAG_INV_BLOCKS): blocks per program, their substitutions side by
    # side on a [NBLK, BC, BC] tile (fewer, longer programs: the steps' latency overlaps)
    i_blk = tl.program_id(0)
    i_c = tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    i_b, i_hv, i_h, bos, T, g_c, s_c = chunk_coords(i_c, i_bh, T, NC, H, HV, cu_seqlens, chunk_index, BT, IS_VARLEN)
    t0 = i_blk * NBLK * BC
    if t0 >= T:  # past the chunk's rows (a short chunk, or an unused slot: T <= 0)
        return
    # Each pointer moves to this chunk and head once, in 64-bit (bos: the chunk's
    # first row); offsets inside the chunk are 32-bit at any T.
    akk += (bos * HV + i_hv) * BT
    beta += bos * HV + i_hv
    dinv += (bos * HV + i_hv) * BC

    if NBLK > 1:
        _blocks(akk, beta, dinv, t0, T, HV, BT, BC, NBLK)
        return
    o_c = tl.arange(0, BC)
    o_t = t0 + o_c
    m_t = o_t < T
    # D = diag(beta) A_kk on the block (strictly lower; rows past T are zero, so their
    # rows of the inverse come out as rows of I)
    b_beta = tl.load(beta + o_t * HV, mask=m_t, other=0.0).to(tl.float32)
    b_d = b_beta[:, None] * tl.load(akk + o_t[:, None] * (HV * BT) + (t0 + o_c)[None, :],
                                    mask=m_t[:, None] & (o_c[:, None] > o_c[None, :]), other=0.0)
    # forward substitution: row r of X = (I + D)^-1 is e_r - D[r, :r] X[:r, :]
    b_x = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)
    for r in range(1, BC):
        row = o_c == r
        b_dr = tl.sum(tl.where(row[:, None], b_d, 0.0), 0)  # D[r, :], over the rows of X
        b_row = tl.where(row, 1.0, 0.0) - tl.sum(b_dr[:, None] * b_x, 0)
        b_x = tl.where(row[:, None], b_row[None, :], b_x)
    tl.store(dinv + o_t[:, None] * (HV * BC) + o_c[None, :], b_x, mask=m_t[:, None])


@triton.jit
def _blocks(akk, beta, dinv, t0, T, HV, BT: tl.constexpr, BC: tl.constexpr, NBLK: tl.constexpr):
    """NBLK blocks from row ``t0``: the same substitution on [NBLK, BC, BC] (block, row,
    column); the pointers are at the chunk's first row and this head."""
    o_b = tl.arange(0, NBLK)
    o_c = tl.arange(0, BC)
    o_t = t0 + o_b[:, None] * BC + o_c[None, :]  # [NBLK, BC]: each block's rows
    m_t = o_t < T
    b_beta = tl.load(beta + o_t * HV, mask=m_t, other=0.0).to(tl.float32)
    lower = (o_c[:, None] > o_c[None, :])[None, :, :]
    b_d = b_beta[:, :, None] * tl.load(akk + o_t[:, :, None] * (HV * BT) + (t0 + o_b * BC)[:, None, None]
                                       + o_c[None, None, :], mask=m_t[:, :, None] & lower, other=0.0)
    b_x = tl.where((o_c[:, None] == o_c[None, :])[None, :, :], 1.0, 0.0) + tl.zeros([NBLK, BC, BC], dtype=tl.float32)
    for r in range(1, BC):
        row = o_c == r
        b_dr = tl.sum(tl.where(row[None, :, None], b_d, 0.0), 1)  # D[b, r, :], [NBLK, BC]
        b_row = tl.where(row[None, :], 1.0, 0.0) - tl.sum(b_dr[:, :, None] * b_x, 1)
        b_x = tl.where(row[None, :, None], b_row[:, None, :], b_x)
    tl.store(dinv + o_t[:, :, None] * (HV * BC) + o_c[None, None, :], b_x, mask=m_t[:, :, None])
