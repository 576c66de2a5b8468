"""Stage 1a (forward, and recomputed in the backward): gam and the chunk's A's.

One program per (chunk, batch * value head). With gam = cumsum(g) inside the
chunk it writes
  gam                          [B, T, HV, K]      (_indexing.gam_row: rows past the end read the last)
  A_kk (strictly lower)        [B, T, HV, BT]     A_kk[i, j] = sum_k K_ik K_jk exp(gam_ik - gam_jk)
  A_qk (lower, with diagonal)  [B, T, HV, BT]     A_qk alike with Q * scale for K_i
  steep                        [B, NC, HV]        the chunk's path: 0 split at its middle row, else steep
                                                  (1 block references here, 2 the steep launch)
  Qg = Q * scale * exp(gam),  Kr = K * exp(Gam - gam)   [B, T, HV, K]  (Gam: the chunk's
                               last gam) in the scans' operand dtype: what the scans and
                               the output read instead of Q, K and gam
Where the forward keeps nothing (settings.INTRA_A_GAM_ON_CHIP) gam stays on chip but each
chunk's last row (the scans' decay) and a steep chunk's rows, and it also writes
  Kb = diag(beta) K exp(gam)   [B, T, HV, K]      (the scans' operand dtype) for intra_wu_fwd's W

Numerics: exp(gam_i - gam_j) is never formed as exp(gam_i) * exp(-gam_j) over
the chunk. kda_intra_a_fwd_kernel splits it at the chunk's middle row m,
exp(gam_i - gam_m) exp(gam_m - gam_j), when every factor stays within
exp(+-MAX_SPLIT) (fp32 overflows past exp(88)): then both A's are two
[BT, K] x [K, BT] dots whose kept entries (i >= j) are exact; the entries above
the diagonal may overflow and are dropped. Otherwise, where each BC-row block's
gam stays within MAX_SPLIT of the block's middle row (fla's safe_gate range), it
takes those middle rows as the references of their blocks' rows (settings.
INTRA_A_BLOCK_REFS). Otherwise it marks the chunk for
kda_intra_a_fwd_steep_kernel, a separate launch so that the common kernel stays
small, forms the A's row block by row block (BC rows), over K slices: the columns
before block I use its first row r as reference, so both exp(gam_i - gam_r) and
exp(gam_r - gam_j) are <= 1 for a decaying gate; the diagonal block splits at its
own middle row where the slice allows, and otherwise forms each pair exactly.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._dot import as_stored
from ._indexing import (chunk_coords, chunk_in_sequence, gam_row, row_block_slice, left_to_the_other_launch, work_list_block,
                        work_list_item, work_list_range)
from ._math import exp


@triton.jit
def _chunk_gam(g, p_tk, m_tk):
    """gam = cumsum(g) down a chunk's rows for one K slice (rows past the end load g = 0,
    so they repeat the last gam)."""
    return tl.cumsum(tl.load(g + p_tk, mask=m_tk, other=0.0).to(tl.float32), axis=0)


@triton.jit
def _split_a_dots(b_q, b_k, b_dmid, b_akk, b_aqk, DOT_PREC: tl.constexpr, FAST_EXP: tl.constexpr):
    """One K slice's share of both A's, split at the middle row:
    A[i, j] += sum_k X_ik exp(dmid_ik) * K_jk exp(-dmid_jk), X = K or Q * scale."""
    b_ep = exp(b_dmid, FAST_EXP)
    b_kn = tl.trans(b_k * exp(-b_dmid, FAST_EXP))
    b_akk += tl.dot(b_k * b_ep, b_kn, input_precision=DOT_PREC)
    b_aqk += tl.dot(b_q * b_ep, b_kn, input_precision=DOT_PREC)
    return b_akk, b_aqk


@triton.jit
def _block_ref_a_dots(b_q, b_k, b_gam, gam, o_k, m_k, T, b_akk, b_aqk, HV,
                      K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, DOT_PREC: tl.constexpr,
                      FAST_EXP: tl.constexpr):
    """One K slice's share of both A's with the middle row m of each BC-row block as
    the reference of its rows: A[i, j] += sum_k X_ik exp(gam_ik - gam_mk) *
    K_jk exp(gam_mk - gam_jk), X = K or Q * scale, for the columns j up to the end of
    i's block (0 after it). Within exp(+-MAX_SPLIT) where every block's gam strays at
    most MAX_SPLIT from its middle row; before the block exp(gam_m - gam_j) <= 1 for
    a decaying gate. Entries above the diagonal inside the block may overflow: the
    stores drop them. Row blocks past the sequence's end hold no row: skipped."""
    o_r = tl.arange(0, BT)
    b_gmb = tl.load(gam + gam_row((o_r // BC) * BC + BC // 2, T)[:, None] * (HV * K) + o_k[None, :],
                    mask=m_k[None, :], other=0.0)
    b_er = exp(b_gam - b_gmb, FAST_EXP)
    b_kl = b_k * b_er
    b_ql = b_q * b_er
    for i_i in tl.static_range(BT // BC):
        if i_i * BC < T:
            rows = (o_r // BC == i_i)[:, None]
            b_gm = tl.load(gam + gam_row(i_i * BC + BC // 2, T) * (HV * K) + o_k, mask=m_k, other=0.0)
            b_kc = tl.trans(b_k * exp(tl.where((o_r < (i_i + 1) * BC)[:, None], b_gm[None, :] - b_gam,
                                               float("-inf")), FAST_EXP))
            b_akk += tl.dot(tl.where(rows, b_kl, 0.0), b_kc, input_precision=DOT_PREC)
            b_aqk += tl.dot(tl.where(rows, b_ql, 0.0), b_kc, input_precision=DOT_PREC)
    return b_akk, b_aqk


@triton.jit
def kda_intra_a_fwd_kernel(
    q, k, g, gam, spreads, akk, aqk, steep, qg, kr,
    cu_seqlens, chunk_index,  # varlen (IS_VARLEN): _indexing.py
    scale, T, NC,
    H, HV,  # runtime: one compiled kernel serves every head count
    K: tl.constexpr, BT: tl.constexpr, BKA: tl.constexpr,
    DOT_PREC: tl.constexpr, MAX_SPLIT: tl.constexpr, SPREAD_TILE: tl.constexpr = 0,
    GAM_IN: tl.constexpr = False, INTERPRET: tl.constexpr = False,
    IS_VARLEN: tl.constexpr = False, NKB: tl.constexpr = 1,
    BLOCK_REFS: tl.constexpr = False, BC: tl.constexpr = 16, ROW_SPREADS: tl.constexpr = False,
    BKR: tl.constexpr = 64, TILE: tl.constexpr = 0, SKIP_TILED: tl.constexpr = 0,
    PICK_TILE: tl.constexpr = 0, QG_FIRST: tl.constexpr = True, KR_LAST: tl.constexpr = True,
    FAST_EXP: tl.constexpr = False, MODE_LOOPS: tl.constexpr = False,
    beta=None, kbg=None, STORE_GAM: tl.constexpr = True, KBG: tl.constexpr = False,
):
    # FAST_EXP: _math.exp without subnormals.
    # Without GAM_IN only (settings.INTRA_A_GAM_ON_CHIP, a forward that keeps nothing):
    # STORE_GAM = False: of gam only each chunk's last row is stored
    # (the scans' decay), and a steep chunk's every row (the steep launch reads them).
    # KBG: Kb = diag(beta) K exp(gam) stored into ``kbg`` (the scans' operand dtype) for
    # intra_wu_fwd's W (its KBG_IN), which then reads neither K nor gam.
    # MODE_LOOPS (with GAM_IN; settings.INTRA_A_MODE_LOOPS): a K loop per path (_a_slices).
    # TILE (packed sequences, with GAM_IN): a launch for the chunks of at most TILE rows
    # (half a chunk), on [TILE, TILE] tiles instead of [BT, BT]; its programs return at
    # once for longer chunks, and the launch at BT skips the chunks of at most
    # SKIP_TILED rows. The same values (rows and columns past a chunk's end are zero in
    # either; the A rows' columns past TILE are stored as zeros). PICK_TILE (instead of
    # the two launches): one launch whose programs take their chunk on [PICK_TILE,
    # PICK_TILE] tiles where it has at most PICK_TILE rows, else on [BT, BT]; no program
    # only returns.
    # QG_FIRST / KR_LAST = False (a forward that keeps nothing, where nothing reads them):
    # no Qg for a sequence's first chunk (no initial state: the output skips Qg S0
    # there), no Kr for its last chunk (the scan forms no state leaving it: compact
    # chunk states, no final state).
    # GAM_IN: gam was written by gam_fwd.py (settings.INTRA_GAM_KERNEL): read here,
    # with its middle and last rows as vector loads, and not stored again.
    # gam_fwd.py (GAM_IN) also wrote how far gam strays from the
    # chunk's middle row and from each BC-row block's (spreads, over its NKB K
    # blocks), so the path is chosen before the K loop: the split at the middle row
    # (steep flag 0), with BLOCK_REFS the blocks' middle rows as references (1:
    # _block_ref_a_dots, four dots a slice; the backward takes the chunk as steep),
    # or none here (2: the steep launch forms the A's; no dots here).
    # ROW_SPREADS (with GAM_IN): the log decay is known <= 0 (fla's gate: the softplus
    # form, or lower_bound <= 0), so gam falls down each column and its spread from a
    # row is largest at the first or last row: the spreads are formed here from three
    # rows of gam a block and the chunk's first, middle and last (the same values as
    # gam_fwd's reductions, which are then skipped; fp32 rounding is monotone too),
    # over K slices of BKR.
    # Otherwise one pass over K slices: the A's are accumulated as if the chunk were
    # not steep (its middle row is in every slice) and dropped if it is (2), so gam,
    # Q and K are read once. On a steep chunk the split factors may overflow to inf;
    # those A's are never stored (the steep launch writes them).
    # scale in fp32 whatever the caller's scalar type: inductor's launches of the
    # export op pass a Python float as fp64, which would make Q * scale fp64.
    scale = tl.cast(scale, tl.float32)
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_hv, i_h, bos, T, g_c, s_c = chunk_coords(i_c, i_bh, T, NC, H, HV, cu_seqlens, chunk_index, BT, IS_VARLEN)
    if IS_VARLEN:
        # an unused chunk slot (past the last sequence's chunks): no row to compute; its
        # steep flag, kept for the backward, is 0
        if T <= 0:
            if TILE == 0:
                tl.store(steep + g_c * HV + i_hv, 0)
            return
        if left_to_the_other_launch(T, TILE, SKIP_TILED):
            return
    tl.static_assert((TILE == 0 and PICK_TILE == 0) or (GAM_IN and IS_VARLEN),
                     "tiles of TILE rows: packed sequences, gam read")
    # Each pointer moves to this chunk and head once, in 64-bit (bos: the chunk's
    # first row); offsets inside the chunk are 32-bit at any T.
    q += (bos * H + i_h) * K
    k += (bos * H + i_h) * K
    g += (bos * HV + i_hv) * K
    gam += (bos * HV + i_hv) * K
    akk += (bos * HV + i_hv) * BT
    aqk += (bos * HV + i_hv) * BT
    qg += (bos * HV + i_hv) * K
    kr += (bos * HV + i_hv) * K
    steep += g_c * HV + i_hv
    spreads += (g_c * HV + i_hv) * (NKB * 2)  # gam_fwd's spreads of this chunk (GAM_IN, not ROW_SPREADS)
    if KBG:
        beta += bos * HV + i_hv
        kbg += (bos * HV + i_hv) * K
    store_qg = (chunk_in_sequence(i_c, chunk_index, IS_VARLEN) > 0) | QG_FIRST
    store_kr = (T > BT) | KR_LAST
    if PICK_TILE > 0:
        if T <= PICK_TILE:
            _a_chunk(q, k, g, gam, spreads, akk, aqk, steep, qg, kr, store_qg, store_kr, scale, T, H, HV,
                     K, BT, PICK_TILE, BKA, DOT_PREC, MAX_SPLIT, SPREAD_TILE, GAM_IN, INTERPRET, NKB, BLOCK_REFS, BC,
                     ROW_SPREADS, BKR, FAST_EXP, MODE_LOOPS, beta, kbg, STORE_GAM, KBG)
        else:
            _a_chunk(q, k, g, gam, spreads, akk, aqk, steep, qg, kr, store_qg, store_kr, scale, T, H, HV,
                     K, BT, BT, BKA, DOT_PREC, MAX_SPLIT, SPREAD_TILE, GAM_IN, INTERPRET, NKB, BLOCK_REFS, BC,
                     ROW_SPREADS, BKR, FAST_EXP, MODE_LOOPS, beta, kbg, STORE_GAM, KBG)
    else:
        R: tl.constexpr = BT if TILE == 0 else TILE  # the tile's rows and columns
        _a_chunk(q, k, g, gam, spreads, akk, aqk, steep, qg, kr, store_qg, store_kr, scale, T, H, HV,
                 K, BT, R, BKA, DOT_PREC, MAX_SPLIT, SPREAD_TILE, GAM_IN, INTERPRET, NKB, BLOCK_REFS, BC,
                 ROW_SPREADS, BKR, FAST_EXP, MODE_LOOPS, beta, kbg, STORE_GAM, KBG)


@triton.jit
def _qk_slice_stores(q, k, qg, kr, b_gam, b_glast, store_qg, store_kr, scale, o_t, o_k, m_tk, p_tk, H, HV,
                     K: tl.constexpr, INTERPRET: tl.constexpr, FAST_EXP: tl.constexpr):
    """One K slice's Q * scale and K in fp32, with its Qg and Kr stored where asked."""
    b_q = tl.load(q + (o_t[:, None]) * (H * K) + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32) * scale
    b_k = tl.load(k + (o_t[:, None]) * (H * K) + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    if store_qg:
        tl.store(qg + p_tk, as_stored(b_q * exp(b_gam, FAST_EXP), qg, INTERPRET).to(qg.dtype.element_ty), mask=m_tk)
    if store_kr:
        tl.store(kr + p_tk, as_stored(b_k * exp(b_glast[None, :] - b_gam, FAST_EXP), kr,
                                      INTERPRET).to(kr.dtype.element_ty), mask=m_tk)
    return b_q, b_k


@triton.jit
def _a_slices(q, k, gam, qg, kr, store_qg, store_kr, scale, T, H, HV, o_t, o_gt, m_t, b_akk, b_aqk,
              K: tl.constexpr, BT: tl.constexpr, R: tl.constexpr, BKA: tl.constexpr, DOT_PREC: tl.constexpr,
              BC: tl.constexpr, INTERPRET: tl.constexpr, FAST_EXP: tl.constexpr, mode, MODE: tl.constexpr):
    """_a_chunk's loop over K slices where gam is read (GAM_IN): Qg and Kr stored, and
    both A's accumulated split at the middle row (path ``MODE`` 0), by block references
    (1), or not at all (2: the steep launch forms them): the loop of path ``MODE`` alone
    (settings.INTRA_A_MODE_LOOPS), or with ``MODE`` -1 one loop that branches on the
    runtime path ``mode`` around its dots."""
    for i_s in range(tl.cdiv(K, BKA)):
        o_k = i_s * BKA + tl.arange(0, BKA)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        p_tk = (o_t[:, None]) * (HV * K) + o_k[None, :]
        b_gam = tl.load(gam + (o_gt[:, None]) * (HV * K) + o_k[None, :], mask=m_k[None, :], other=0.0)
        b_glast = tl.load(gam + gam_row(BT - 1, T) * (HV * K) + o_k, mask=m_k, other=0.0)
        if MODE < 0:
            b_dmid = b_gam - tl.load(gam + gam_row(BT // 2, T) * (HV * K) + o_k, mask=m_k, other=0.0)[None, :]
        b_q, b_k = _qk_slice_stores(q, k, qg, kr, b_gam, b_glast, store_qg, store_kr, scale, o_t, o_k, m_tk, p_tk,
                                    H, HV, K, INTERPRET, FAST_EXP)
        if MODE < 0:
            if mode == 0:
                b_akk, b_aqk = _split_a_dots(b_q, b_k, b_dmid, b_akk, b_aqk, DOT_PREC, FAST_EXP)
            elif mode == 1:
                b_akk, b_aqk = _block_ref_a_dots(b_q, b_k, b_gam, gam, o_k, m_k, T, b_akk, b_aqk, HV, K, R, BC,
                                                 DOT_PREC, FAST_EXP)
        elif MODE == 0:
            b_gmid = tl.load(gam + gam_row(BT // 2, T) * (HV * K) + o_k, mask=m_k, other=0.0)
            b_akk, b_aqk = _split_a_dots(b_q, b_k, b_gam - b_gmid[None, :], b_akk, b_aqk, DOT_PREC, FAST_EXP)
        elif MODE == 1:
            b_akk, b_aqk = _block_ref_a_dots(b_q, b_k, b_gam, gam, o_k, m_k, T, b_akk, b_aqk, HV, K, R, BC,
                                             DOT_PREC, FAST_EXP)
    return b_akk, b_aqk


@triton.jit
def _a_chunk(
    q, k, g, gam, spreads, akk, aqk, steep, qg, kr, store_qg, store_kr, scale, T, H, HV,
    K: tl.constexpr, BT: tl.constexpr, R: tl.constexpr, BKA: tl.constexpr,
    DOT_PREC: tl.constexpr, MAX_SPLIT: tl.constexpr, SPREAD_TILE: tl.constexpr,
    GAM_IN: tl.constexpr, INTERPRET: tl.constexpr, NKB: tl.constexpr,
    BLOCK_REFS: tl.constexpr, BC: tl.constexpr, ROW_SPREADS: tl.constexpr, BKR: tl.constexpr,
    FAST_EXP: tl.constexpr, MODE_LOOPS: tl.constexpr = False, beta=None, kbg=None,
    STORE_GAM: tl.constexpr = True, KBG: tl.constexpr = False,
):
    """One chunk's gam (without GAM_IN), A's, steep flag, Qg and Kr on [R, R] tiles
    (R = BT, or a short chunk's tile). The pointers are at the chunk's first row and
    this head (spreads and steep at the chunk's entries), T its rows; Qg and Kr
    stored where ``store_qg`` / ``store_kr``."""
    o_r = tl.arange(0, R)
    o_t = o_r
    m_t = o_t < T
    o_gt = gam_row(o_t, T)  # the rows of gam read: past the end, the last
    is_last = (o_r == BT - 1)[:, None]
    is_mid = (o_r == BT // 2)[:, None]

    # Over K slices (columns are independent here): gam = cumsum(g) in fp32 (rows
    # past the end load g = 0, so they repeat the last gam), Qg and Kr, how far gam
    # strays from the chunk's middle row, and the slices' shares of both A's.
    spread = tl.full([], 0.0, tl.float32)
    b_spread = tl.zeros([R, BKA], dtype=tl.float32)
    b_rspread = tl.zeros([R], dtype=tl.float32)
    b_akk = tl.zeros([R, R], dtype=tl.float32)
    b_aqk = tl.zeros([R, R], dtype=tl.float32)
    mode = 0
    if GAM_IN and ROW_SPREADS:
        NB: tl.constexpr = R // BC
        o_b = tl.arange(0, NB) * BC  # each block's first row
        # elementwise over the K slices, one reduction each after them
        b_bspread = tl.zeros([NB, BKR], dtype=tl.float32)
        b_cspread = tl.zeros([BKR], dtype=tl.float32)
        for i_s in range(tl.cdiv(K, BKR)):
            o_k = i_s * BKR + tl.arange(0, BKR)
            m_k = (o_k < K)[None, :]
            p_k = gam + o_k[None, :]
            b_first = tl.load(p_k + gam_row(o_b, T)[:, None] * (HV * K), mask=m_k, other=0.0)  # [NB, BKR]
            b_bmid = tl.load(p_k + gam_row(o_b + BC // 2, T)[:, None] * (HV * K), mask=m_k, other=0.0)
            b_blast = tl.load(p_k + gam_row(o_b + BC - 1, T)[:, None] * (HV * K), mask=m_k, other=0.0)
            b_bspread = tl.maximum(b_bspread, tl.maximum(b_first - b_bmid, b_bmid - b_blast))
            # the chunk's rows again as vector loads (L1 hits): cutting them out of the
            # block rows above would take a cross-thread reduction each
            b_cfirst = tl.load(gam + o_k, mask=o_k < K, other=0.0)
            b_cmid = tl.load(gam + gam_row(BT // 2, T) * (HV * K) + o_k, mask=o_k < K, other=0.0)
            b_clast = tl.load(gam + gam_row(BT - 1, T) * (HV * K) + o_k, mask=o_k < K, other=0.0)
            b_cspread = tl.maximum(b_cspread, tl.maximum(b_cfirst - b_cmid, b_cmid - b_clast))
        block_spread = tl.max(tl.reshape(b_bspread, (NB * BKR,)), 0)
        chunk_spread = tl.max(b_cspread, 0)
    elif GAM_IN:
        p_sp = spreads
        chunk_spread = tl.load(p_sp)
        block_spread = tl.load(p_sp + 1)
        for i_kb in tl.static_range(1, NKB):
            chunk_spread = tl.maximum(chunk_spread, tl.load(p_sp + 2 * i_kb))
            block_spread = tl.maximum(block_spread, tl.load(p_sp + 2 * i_kb + 1))
    if GAM_IN:
        if BLOCK_REFS:
            mode = tl.where(chunk_spread <= MAX_SPLIT, 0, tl.where(block_spread <= MAX_SPLIT, 1, 2))
        else:
            mode = tl.where(chunk_spread <= MAX_SPLIT, 0, 2)
        if MODE_LOOPS:
            # the path is known before the K loop: a loop of its own each (the path a
            # constexpr there), so that the common split path carries none of the block
            # references' registers nor a branch around its dots
            if mode == 0:
                b_akk, b_aqk = _a_slices(q, k, gam, qg, kr, store_qg, store_kr, scale, T, H, HV, o_t, o_gt, m_t,
                                         b_akk, b_aqk, K, BT, R, BKA, DOT_PREC, BC, INTERPRET, FAST_EXP, mode, 0)
            elif mode == 1:
                b_akk, b_aqk = _a_slices(q, k, gam, qg, kr, store_qg, store_kr, scale, T, H, HV, o_t, o_gt, m_t,
                                         b_akk, b_aqk, K, BT, R, BKA, DOT_PREC, BC, INTERPRET, FAST_EXP, mode, 1)
            else:
                b_akk, b_aqk = _a_slices(q, k, gam, qg, kr, store_qg, store_kr, scale, T, H, HV, o_t, o_gt, m_t,
                                         b_akk, b_aqk, K, BT, R, BKA, DOT_PREC, BC, INTERPRET, FAST_EXP, mode, 2)
        else:
            b_akk, b_aqk = _a_slices(q, k, gam, qg, kr, store_qg, store_kr, scale, T, H, HV, o_t, o_gt, m_t,
                                     b_akk, b_aqk, K, BT, R, BKA, DOT_PREC, BC, INTERPRET, FAST_EXP, mode, -1)
    else:
        tl.static_assert(not KBG or R == BT, "Kb: chunks on [BT, BT] tiles")
        if KBG:
            b_beta = tl.load(beta + o_t * HV, mask=m_t, other=0.0).to(tl.float32)
        for i_s in range(tl.cdiv(K, BKA)):
            o_k = i_s * BKA + tl.arange(0, BKA)
            m_k = o_k < K
            m_tk = m_t[:, None] & m_k[None, :]
            p_tk = (o_t[:, None]) * (HV * K) + o_k[None, :]
            b_gam = _chunk_gam(g, p_tk, m_tk)
            b_glast = tl.sum(tl.where(is_last, b_gam, 0.0), 0)
            if STORE_GAM:
                tl.store(gam + p_tk, b_gam, mask=m_tk)
            else:  # the last row, which the scans read (past the end the rows repeat it)
                tl.store(gam + gam_row(BT - 1, T) * (HV * K) + o_k, b_glast, mask=m_k)
            b_gmid = tl.sum(tl.where(is_mid, b_gam, 0.0), 0)
            b_dmid = b_gam - b_gmid[None, :]
            if SPREAD_TILE == 2:
                # each row's largest over the slice (a reduction inside each warp), one
                # cross-warp reduction after the loop: 16 registers fewer live through the
                # loop than the tile (sm_90a, on chip: spills 136/152 -> 20/24 B)
                b_rspread = tl.maximum(b_rspread, tl.max(tl.abs(b_dmid), 1))
            elif SPREAD_TILE:
                # elementwise here, one cross-warp reduction after the loop
                b_spread = tl.maximum(b_spread, tl.abs(b_dmid))
            else:
                spread = tl.maximum(spread, tl.max(tl.max(tl.abs(b_dmid), 1), 0))
            b_q, b_k = _qk_slice_stores(q, k, qg, kr, b_gam, b_glast, store_qg, store_kr, scale, o_t, o_k, m_tk,
                                        p_tk, H, HV, K, INTERPRET, FAST_EXP)
            if KBG:
                b_kb = b_beta[:, None] * b_k * exp(b_gam, FAST_EXP)
                tl.store(kbg + p_tk, as_stored(b_kb, kbg, INTERPRET).to(kbg.dtype.element_ty), mask=m_tk)
            b_akk, b_aqk = _split_a_dots(b_q, b_k, b_dmid, b_akk, b_aqk, DOT_PREC, FAST_EXP)
    if not GAM_IN:
        if SPREAD_TILE == 2:
            spread = tl.max(b_rspread, 0)
        elif SPREAD_TILE:
            spread = tl.max(tl.max(b_spread, 1), 0)
        mode = tl.where(spread > MAX_SPLIT, 2, 0)
        if not STORE_GAM:
            if mode == 2:  # the steep launch reads the chunk's every row of gam
                for i_s in range(tl.cdiv(K, BKA)):
                    o_k = i_s * BKA + tl.arange(0, BKA)
                    m_tk = m_t[:, None] & (o_k < K)[None, :]
                    p_tk = (o_t[:, None]) * (HV * K) + o_k[None, :]
                    tl.store(gam + p_tk, _chunk_gam(g, p_tk, m_tk), mask=m_tk)

    # 0 or 1: the A's are formed here; 2: by the steep launch (any nonzero: the backward's steep path)
    tl.store(steep, mode.to(tl.int32))
    if mode < 2:
        p_a = (o_t[:, None]) * (HV * BT) + o_r[None, :]
        tl.store(akk + p_a, as_stored(tl.where(o_r[:, None] > o_r[None, :], b_akk, 0.0), akk,
                                      INTERPRET).to(akk.dtype.element_ty), mask=m_t[:, None])
        tl.store(aqk + p_a, as_stored(tl.where(o_r[:, None] >= o_r[None, :], b_aqk, 0.0), aqk,
                                      INTERPRET).to(aqk.dtype.element_ty), mask=m_t[:, None])
        if R < BT:  # the columns past the tile: zero (above the diagonal of every row here)
            o_z = R + tl.arange(0, BT - R)
            p_z = (o_t[:, None]) * (HV * BT) + o_z[None, :]
            b_z = tl.zeros([R, BT - R], dtype=tl.float32)
            tl.store(akk + p_z, b_z.to(akk.dtype.element_ty), mask=m_t[:, None])
            tl.store(aqk + p_z, b_z.to(aqk.dtype.element_ty), mask=m_t[:, None])


@triton.jit
def kda_intra_a_fwd_steep_kernel(
    q, k, gam, akk, aqk, steep,
    cu_seqlens, chunk_index,  # varlen (IS_VARLEN): _indexing.py
    scale, T, NC,
    H, HV,  # runtime: one compiled kernel serves every head count
    n_flags,  # WORK_LIST: how many steep flags there are (B * NC * HV)
    K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BKS: tl.constexpr,
    DOT_PREC: tl.constexpr, MAX_SPLIT: tl.constexpr, INTERPRET: tl.constexpr = False,
    IS_VARLEN: tl.constexpr = False, ROW_PROGRAMS: tl.constexpr = False, BLOCK_REFS: tl.constexpr = False,
    WORK_LIST: tl.constexpr = False, WL_BLOCK: tl.constexpr = 64,
):
    """The A's of the chunks kda_intra_a_fwd_kernel left to it (steep flag 2); the
    others return at once. Row block by row block (BC rows), over K slices (BKS wide): the
    columns before the block through one dot with the block's first row as
    reference; the diagonal block split at its middle row where the slice allows,
    else exactly, pair by pair. ROW_PROGRAMS: one program per row block (grid
    axis 2, BT // BC of them) instead of one looping over the chunk's blocks.
    BLOCK_REFS: first one pass with the block's middle row as the reference of
    every column up to the block's end; kept where the block's gam strays at most
    MAX_SPLIT from that row (settings.STEEP_BLOCK_REFS). WORK_LIST
    (settings.STEEP_WORK_LIST): a 1-D grid of a few programs per SM, each reading
    the flags of its share of the (chunk, head[, row block]) items WL_BLOCK at a time
    and forming the flagged ones (_indexing.work_list_range, _block, _item), instead of one program
    per item that mostly only reads its flag."""
    scale = tl.cast(scale, tl.float32)  # fp64 where inductor launches it (see above)
    SUB: tl.constexpr = BT // BC if ROW_PROGRAMS else 1  # items per flag
    N_BLOCKS: tl.constexpr = 1 if ROW_PROGRAMS else BT // BC  # row blocks per item
    if WORK_LIST:
        start, end = work_list_range(n_flags, SUB)
        for base in range(start, end, WL_BLOCK):
            o_w, pending, n_todo = work_list_block(steep, base, end, SUB, 2, WL_BLOCK)
            for _ in range(n_todo):
                item = tl.min(pending, 0)
                pending = tl.where(o_w == item, end, pending)
                i_c, i_bh, i_sub = work_list_item(item, NC, HV, SUB)
                _steep_a_item(q, k, gam, akk, aqk, steep, cu_seqlens, chunk_index, scale, T, NC, H, HV,
                              i_c, i_bh, i_sub * N_BLOCKS, K, BT, BC, BKS, DOT_PREC, MAX_SPLIT, INTERPRET,
                              IS_VARLEN, BLOCK_REFS, N_BLOCKS)
    else:
        if ROW_PROGRAMS:
            i_first = tl.program_id(2)
        else:
            i_first = 0
        _steep_a_item(q, k, gam, akk, aqk, steep, cu_seqlens, chunk_index, scale, T, NC, H, HV,
                      tl.program_id(0), tl.program_id(1).to(tl.int64), i_first, K, BT, BC, BKS, DOT_PREC, MAX_SPLIT,
                      INTERPRET, IS_VARLEN, BLOCK_REFS, N_BLOCKS)


@triton.jit
def _steep_a_item(q, k, gam, akk, aqk, steep, cu_seqlens, chunk_index, scale, T, NC, H, HV, i_c, i_bh, i_first,
                  K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BKS: tl.constexpr,
                  DOT_PREC: tl.constexpr, MAX_SPLIT: tl.constexpr, INTERPRET: tl.constexpr,
                  IS_VARLEN: tl.constexpr, BLOCK_REFS: tl.constexpr, N_BLOCKS: tl.constexpr):
    """kda_intra_a_fwd_steep_kernel's work on chunk slot ``i_c`` of (batch *) value
    head ``i_bh`` (64-bit): N_BLOCKS row blocks from block ``i_first``, if the
    chunk's flag is 2."""
    i_b, i_hv, i_h, bos, T, g_c, s_c = chunk_coords(i_c, i_bh, T, NC, H, HV, cu_seqlens, chunk_index, BT, IS_VARLEN)
    if tl.load(steep + g_c * HV + i_hv) == 2:  # (1: the common kernel formed them with block references)
        q += (bos * H + i_h) * K
        k += (bos * H + i_h) * K
        gam += (bos * HV + i_hv) * K
        akk += (bos * HV + i_hv) * BT
        aqk += (bos * HV + i_hv) * BT
        o_r = tl.arange(0, BT)
        o_t = o_r
        m_t = o_t < T
        o_gt = gam_row(o_t, T)  # the rows of gam read: past the end, the last
        o_c = tl.arange(0, BC)
        # row blocks past the sequence's end (short or last chunks) hold no row: skipped
        for i_i in range(i_first, tl.minimum(i_first + N_BLOCKS, tl.cdiv(T, BC))):
            o_i = i_i * BC + o_c
            m_i = o_i < T
            before = o_r < i_i * BC  # the columns left of the diagonal block
            row_off = (o_i[:, None]) * (HV * BT)
            b_akk = tl.zeros([BC, BT], dtype=tl.float32)
            b_aqk = tl.zeros([BC, BT], dtype=tl.float32)
            spread = tl.full([], 2 * MAX_SPLIT, tl.float32)  # without BLOCK_REFS: the former way
            if BLOCK_REFS:
                # One pass with the block's middle row m as the reference of every column
                # up to the block's end: exp(gam_i - gam_m), and exp(gam_m - gam_j) inside
                # the block, stay within exp(MAX_SPLIT) where the block's spread allows;
                # before it exp(gam_m - gam_j) <= 1 for a decaying gate.
                upto = o_r < (i_i + 1) * BC
                spread = tl.full([], 0.0, tl.float32)
                for i_s in range(tl.cdiv(K, BKS)):
                    o_s, m_s, b_qi, b_ki, b_gi = row_block_slice(q, k, gam, o_i, m_i, i_s, scale, T, H, HV, K, BKS)
                    b_gm = tl.load(gam + gam_row(i_i * BC + BC // 2, T) * (HV * K) + o_s, mask=m_s, other=0.0)
                    b_dm = b_gi - b_gm[None, :]
                    spread = tl.maximum(spread, tl.max(tl.max(tl.abs(b_dm), 1), 0))
                    b_kc = tl.load(k + (o_t[:, None]) * (H * K) + o_s[None, :],
                                   mask=(m_t & upto)[:, None] & m_s[None, :], other=0.0).to(tl.float32)
                    b_gc = tl.load(gam + (o_gt[:, None]) * (HV * K) + o_s[None, :], mask=m_s[None, :], other=0.0)
                    b_kcb = tl.trans(b_kc * tl.exp(tl.where(upto[:, None], b_gm[None, :] - b_gc, float("-inf"))))
                    b_em = tl.exp(b_dm)
                    b_akk += tl.dot(b_ki * b_em, b_kcb, input_precision=DOT_PREC)
                    b_aqk += tl.dot(b_qi * b_em, b_kcb, input_precision=DOT_PREC)
            if spread <= MAX_SPLIT:
                # the whole row, zero above the diagonal (kept intermediates: every byte written)
                tl.store(akk + row_off + o_r[None, :],
                         as_stored(tl.where(o_r[None, :] < o_i[:, None], b_akk, 0.0), akk,
                                   INTERPRET).to(akk.dtype.element_ty), mask=m_i[:, None])
                tl.store(aqk + row_off + o_r[None, :],
                         as_stored(tl.where(o_r[None, :] <= o_i[:, None], b_aqk, 0.0), aqk,
                                   INTERPRET).to(aqk.dtype.element_ty), mask=m_i[:, None])
            else:
                before = o_r < i_i * BC  # the columns left of the diagonal block
                b_akk = tl.zeros([BC, BT], dtype=tl.float32)
                b_aqk = tl.zeros([BC, BT], dtype=tl.float32)
                b_akk_d = tl.zeros([BC, BC], dtype=tl.float32)
                b_aqk_d = tl.zeros([BC, BC], dtype=tl.float32)
                for i_s in range(tl.cdiv(K, BKS)):
                    o_s, m_s, b_qi, b_ki, b_gi = row_block_slice(q, k, gam, o_i, m_i, i_s, scale, T, H, HV, K, BKS)
                    # columns j before the block, reference r = the block's first row: both
                    # exp(gam_i - gam_r) and exp(gam_r - gam_j) are <= 1 for a decaying gate
                    b_gr = tl.load(gam + gam_row(i_i * BC, T) * (HV * K) + o_s, mask=m_s, other=0.0)
                    b_kc = tl.load(k + (o_t[:, None]) * (H * K) + o_s[None, :],
                                   mask=(m_t & before)[:, None] & m_s[None, :], other=0.0).to(tl.float32)
                    b_gc = tl.load(gam + (o_gt[:, None]) * (HV * K) + o_s[None, :], mask=m_s[None, :], other=0.0)
                    b_kcb = tl.trans(b_kc * tl.exp(tl.where(before[:, None], b_gr[None, :] - b_gc, 0.0)))
                    b_ei = tl.exp(b_gi - b_gr[None, :])
                    b_akk += tl.dot(b_ki * b_ei, b_kcb, input_precision=DOT_PREC)
                    b_aqk += tl.dot(b_qi * b_ei, b_kcb, input_precision=DOT_PREC)
                    # the diagonal block: split at its middle row m where this slice allows
                    b_gm = tl.load(gam + gam_row(i_i * BC + BC // 2, T) * (HV * K) + o_s, mask=m_s, other=0.0)
                    b_dm = b_gi - b_gm[None, :]
                    if tl.max(tl.max(tl.abs(b_dm), 1), 0) <= MAX_SPLIT:
                        b_kn = tl.trans(b_ki * tl.exp(-b_dm))
                        b_em = tl.exp(b_dm)
                        # entries above the diagonal may overflow: dropped by the where below
                        b_akk_d += tl.dot(b_ki * b_em, b_kn, input_precision=DOT_PREC)
                        b_aqk_d += tl.dot(b_qi * b_em, b_kn, input_precision=DOT_PREC)
                    else:  # exact exp(gam_i - gam_j), one column j at a time
                        for j in range(BC):  # a runtime loop: unrolled, it multiplies compile time
                            t_j = i_i * BC + j
                            # the row test as a block, not a scalar: Triton >= 3.7's interpreter
                            # refuses a block & scalar mask ('mask has unsupported dtype')
                            b_krow = tl.load(k + t_j * (H * K) + o_s[None, :],
                                             mask=(m_s & (t_j + 0 * o_s < T))[None, :], other=0.0).to(tl.float32)
                            b_grow = tl.load(gam + gam_row(t_j, T) * (HV * K) + o_s[None, :], mask=m_s[None, :], other=0.0)
                            b_kje = b_krow * tl.exp(tl.where(o_c[:, None] >= j, b_gi - b_grow, float("-inf")))
                            is_j = o_c[None, :] == j
                            b_akk_d = tl.where(is_j, b_akk_d + tl.sum(b_ki * b_kje, 1)[:, None], b_akk_d)
                            b_aqk_d = tl.where(is_j, b_aqk_d + tl.sum(b_qi * b_kje, 1)[:, None], b_aqk_d)
                # every column but the diagonal block's (stored below): those after it
                # are above the diagonal, zero (the A's are returned as kept intermediates,
                # whose every byte is written)
                outside = (before | (o_r >= (i_i + 1) * BC))[None, :]
                tl.store(akk + row_off + o_r[None, :],
                         as_stored(tl.where(before[None, :], b_akk, 0.0), akk, INTERPRET).to(akk.dtype.element_ty),
                         mask=m_i[:, None] & outside)
                tl.store(aqk + row_off + o_r[None, :],
                         as_stored(tl.where(before[None, :], b_aqk, 0.0), aqk, INTERPRET).to(aqk.dtype.element_ty),
                         mask=m_i[:, None] & outside)
                col = i_i * BC + o_c[None, :]
                tl.store(akk + row_off + col, as_stored(tl.where(o_c[:, None] > o_c[None, :], b_akk_d, 0.0), akk,
                                                        INTERPRET).to(akk.dtype.element_ty), mask=m_i[:, None])
                tl.store(aqk + row_off + col, as_stored(tl.where(o_c[:, None] >= o_c[None, :], b_aqk_d, 0.0), aqk,
                                                        INTERPRET).to(aqk.dtype.element_ty), mask=m_i[:, None])
