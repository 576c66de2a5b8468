"""Stage 1b (forward, and recomputed in the backward): Tm, W and U of each chunk.

One program per (chunk, batch * value head). From A_kk and gam (intra_a_fwd.py):
  Tm = (I + diag(beta) A_kk)^-1                (stored when STORE_TM: the backward needs it)
  W  = Tm diag(beta) (K * exp(gam))            [B, T, HV, K]  (the scans' operand dtype; with KBG_IN
                                               its right-hand side Kb read as intra_a_fwd.py stored it)
  U  = Tm diag(beta) V                         [B, T, HV, V]  (fp32)
With TM_ONLY (settings.FUSED_OUTPUT_SOLVE_U) Tm alone, in tm's dtype (bf16): the scan that
writes the output then forms U' from it (state_output_fwd.py's SOLVE_U).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._dot import as_stored, dot
from ._math import exp
from ._indexing import chunk_coords, chunk_in_sequence, gam_row, left_to_the_other_launch


@triton.jit
def kda_intra_wu_fwd_kernel(
    k, v, beta, gam, akk, dinv,
    w, u, tm,
    cu_seqlens, chunk_index,  # varlen (IS_VARLEN): _indexing.py
    T, NC,
    H, HV,  # runtime: one compiled kernel serves every head count
    K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    STORE_TM: tl.constexpr, DOT_PREC: tl.constexpr, TM_ROW_LOADS: tl.constexpr,
    BF16_DOTS: tl.constexpr = False, INTERPRET: tl.constexpr = False,
    IS_VARLEN: tl.constexpr = False, TILE: tl.constexpr = 0, SKIP_TILED: tl.constexpr = 0,
    PICK_TILE: tl.constexpr = 0, W_FIRST: tl.constexpr = True, DINV_IN: tl.constexpr = False,
    FAST_EXP: tl.constexpr = False, steep=None, ONLY_STEEP: tl.constexpr = False,
    kbg=None, KBG_IN: tl.constexpr = False, TM_ONLY: tl.constexpr = False,
):
    # TM_ONLY (settings.FUSED_OUTPUT_SOLVE_U): Tm alone, stored in tm's dtype (bf16), neither
    # W nor U: the scan that writes the output forms U' = Tm (diag(beta) V - Kb S) itself.
    # FAST_EXP: _math.exp without subnormals.
    # TILE / SKIP_TILED / PICK_TILE: as in intra_a_fwd.py (the chunks of at most TILE
    # rows on [TILE, TILE] tiles, in a launch of their own or, PICK_TILE, in this one);
    # Tm's columns past the tile are stored as zeros.
    # W_FIRST = False (a forward that keeps nothing, no initial state): no W for a
    # sequence's first chunk, which the scan does not read (U' = U there).
    # DINV_IN (settings.INTRA_DIAG_INV_KERNEL): the inverses of the diagonal blocks from
    # diag_inv.py (``dinv`` [B, T, HV, BC]) instead of this kernel's forward substitution.
    # BF16_DOTS (bf16 inputs): W and U from Tm and their right-hand sides rounded to
    # bf16 (fp32 accumulation); Tm itself, and what is stored of it, stays fp32.
    # KBG_IN (settings.INTRA_A_GAM_ON_CHIP): W = Tm Kb from ``kbg``, Kb = diag(beta) K exp(gam)
    # as intra_a_fwd.py stored it (its KBG), so neither K nor gam is read here.
    # ONLY_STEEP (after intra_fused_fwd.py, settings.INTRA_FUSED_FWD): only the chunks
    # whose steep flag (``steep`` [B * NC or NCB, HV]) is 2, which that kernel left to
    # the steep launch and this one; the others return after reading their flag.
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_hv, i_h, bos, T, g_c, s_c = chunk_coords(i_c, i_bh, T, NC, H, HV, cu_seqlens, chunk_index, BT, IS_VARLEN)
    if IS_VARLEN:
        if T <= 0:  # an unused chunk slot (past the last sequence's chunks): nothing to compute
            return
        if left_to_the_other_launch(T, TILE, SKIP_TILED):
            return
    tl.static_assert((TILE == 0 and PICK_TILE == 0) or IS_VARLEN, "tiles of TILE rows: packed sequences")
    if ONLY_STEEP:
        if tl.load(steep + g_c * HV + i_hv) != 2:
            return
    # Each pointer moves to this chunk and head once, in 64-bit (bos: the chunk's
    # first row); offsets inside the chunk are 32-bit at any T.
    k += (bos * H + i_h) * K
    v += (bos * HV + i_hv) * V
    u += (bos * HV + i_hv) * V
    w += (bos * HV + i_hv) * K
    beta += bos * HV + i_hv
    gam += (bos * HV + i_hv) * K
    akk += (bos * HV + i_hv) * BT
    tm += (bos * HV + i_hv) * BT
    dinv += (bos * HV + i_hv) * BC
    if KBG_IN:
        kbg += (bos * HV + i_hv) * K
    store_w = (chunk_in_sequence(i_c, chunk_index, IS_VARLEN) > 0) | W_FIRST
    if PICK_TILE > 0:
        if T <= PICK_TILE:
            _wu_chunk(k, v, beta, gam, akk, w, u, tm, store_w, T, H, HV, K, V, BT, BC, BK, BV, PICK_TILE,
                      STORE_TM, DOT_PREC, TM_ROW_LOADS, BF16_DOTS, INTERPRET, dinv, DINV_IN, FAST_EXP,
                      kbg, KBG_IN, TM_ONLY)
        else:
            _wu_chunk(k, v, beta, gam, akk, w, u, tm, store_w, T, H, HV, K, V, BT, BC, BK, BV, BT,
                      STORE_TM, DOT_PREC, TM_ROW_LOADS, BF16_DOTS, INTERPRET, dinv, DINV_IN, FAST_EXP,
                      kbg, KBG_IN, TM_ONLY)
    else:
        R: tl.constexpr = BT if TILE == 0 else TILE  # the tile's rows and columns
        _wu_chunk(k, v, beta, gam, akk, w, u, tm, store_w, T, H, HV, K, V, BT, BC, BK, BV, R,
                  STORE_TM, DOT_PREC, TM_ROW_LOADS, BF16_DOTS, INTERPRET, dinv, DINV_IN, FAST_EXP,
                  kbg, KBG_IN, TM_ONLY)


@triton.jit
def _wu_chunk(
    k, v, beta, gam, akk, w, u, tm, store_w, T, H, HV,
    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    R: tl.constexpr, STORE_TM: tl.constexpr, DOT_PREC: tl.constexpr, TM_ROW_LOADS: tl.constexpr,
    BF16_DOTS: tl.constexpr, INTERPRET: tl.constexpr, dinv, DINV_IN: tl.constexpr, FAST_EXP: tl.constexpr,
    kbg=None, KBG_IN: tl.constexpr = False, TM_ONLY: tl.constexpr = False,
):
    """One chunk's Tm, W and U on [R, R] tiles (R = BT, or a short chunk's tile);
    the pointers are at the chunk's first row and this head, T its rows; W stored
    where ``store_w``."""
    o_r = tl.arange(0, R)
    o_t = o_r
    m_t = o_t < T
    o_c = tl.arange(0, BC)

    # Tm = (I + M)^-1, M = diag(beta) A_kk strictly lower. With D the BC x BC
    # diagonal blocks of M and N the rest, I + M = (I + D)(I + P), P = (I + D)^-1 N.
    # The NB (I + D) blocks are inverted together by forward substitution (BC - 1
    # steps on [NB, BC, BC]); P is strictly block-lower, so P^NB = 0 and
    # (I + P)^-1 = (I - P)(I + P^2) for NB = 4 (I - P for NB = 2, a tile of 32
    # rows): three dots instead of BT - 1 sequential row updates.
    b_beta = tl.load(beta + o_t * HV, mask=m_t, other=0.0).to(tl.float32)
    b_a = tl.load(akk + (o_t[:, None]) * (HV * BT) + o_r[None, :],
                  mask=m_t[:, None] & (o_r[:, None] > o_r[None, :]), other=0.0)
    b_m = b_beta[:, None] * b_a
    NB: tl.constexpr = R // BC
    if DINV_IN:
        # the diagonal blocks' inverses from diag_inv.py; rows past T: rows of I
        same = (o_r[:, None] // BC) == (o_r[None, :] // BC)
        b_dinv = tl.load(dinv + o_t[:, None] * (HV * BC) + (o_r % BC)[None, :], mask=m_t[:, None] & same,
                         other=0.0)
        b_dinv = tl.where(~m_t[:, None] & (o_t[:, None] == o_r[None, :]), 1.0, b_dinv)
    elif TM_ROW_LOADS:
        # the substitution of diag_block_inverses with row i of every block loaded again
        # (A_kk was just read: cache hits) rather than cut out of M by a cross-warp reduction
        o_b = tl.arange(0, NB)
        same_block = (o_b[:, None, None, None] == o_b[None, None, :, None])  # [NB, 1, NB, 1]
        b_x = tl.where((o_c[:, None] == o_c[None, :])[None, :, :], 1.0, 0.0) + tl.zeros([NB, BC, BC], dtype=tl.float32)
        for i in range(1, BC):
            row = (o_c == i)
            t_i = o_b * BC + i
            m_i = t_i < T
            b_bi = tl.load(beta + t_i * HV, mask=m_i, other=0.0).to(tl.float32)
            b_di = b_bi[:, None] * tl.load(akk + t_i[:, None] * (HV * BT) + (o_b * BC)[:, None] + o_c[None, :],
                                           mask=m_i[:, None] & (o_c[None, :] < i), other=0.0)
            b_row = tl.where(row[None, :], 1.0, 0.0) - tl.sum(b_di[:, :, None] * b_x, 1)
            b_x = tl.where(row[None, :, None], b_row[:, None, :], b_x)
        b_dinv = tl.reshape(tl.where(same_block, b_x[:, :, None, :], 0.0), (R, R))
    else:
        b_dinv = diag_block_inverses(b_m, R, BC, 0)
    b_tm = tm_from_block_inverses(b_m, b_dinv, R, BC, DOT_PREC)
    if STORE_TM or TM_ONLY:
        tl.store(tm + (o_t[:, None]) * (HV * BT) + o_r[None, :],
                 as_stored(b_tm, tm, INTERPRET).to(tm.dtype.element_ty), mask=m_t[:, None])
        if R < BT:  # the columns past the tile: zero
            o_z = R + tl.arange(0, BT - R)
            tl.store(tm + (o_t[:, None]) * (HV * BT) + o_z[None, :],
                     tl.zeros([R, BT - R], dtype=tl.float32).to(tm.dtype.element_ty), mask=m_t[:, None])
    if not TM_ONLY:
        _w_and_u(k, v, beta, gam, w, u, kbg, b_tm, b_beta, o_t, m_t, store_w, T, H, HV, K, V, BK, BV,
                 BF16_DOTS, DOT_PREC, INTERPRET, FAST_EXP, KBG_IN)


@triton.jit
def _w_and_u(k, v, beta, gam, w, u, kbg, b_tm, b_beta, o_t, m_t, store_w, T, H, HV,
             K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BF16_DOTS: tl.constexpr,
             DOT_PREC: tl.constexpr, INTERPRET: tl.constexpr, FAST_EXP: tl.constexpr, KBG_IN: tl.constexpr):
    """W = Tm Kb and U = Tm diag(beta) V of one chunk (_wu_chunk's), W where ``store_w``."""
    # W masked off where it is not stored (store_w): neither K nor gam is read there
    # (masks rather than a branch around W: the branch doubled the spills, sm_90a)
    m_sw = (o_t * 0 + store_w.to(tl.int32)) > 0
    # W's columns in K slices of BK (settings.INTRA_WU_BK), as U's in V blocks: the
    # columns are independent, and a slice's [R, BK] operands live shorter than the
    # whole K's (faster on the H200 at the same register count)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        if KBG_IN:
            b_kb = tl.load(kbg + (o_t[:, None]) * (HV * K) + o_k[None, :],
                           mask=(m_t & m_sw)[:, None] & m_k[None, :], other=0.0).to(tl.float32)
        else:
            b_k = tl.load(k + (o_t[:, None]) * (H * K) + o_k[None, :],
                          mask=(m_t & m_sw)[:, None] & m_k[None, :], other=0.0).to(tl.float32)
            # gam is reloaded rather than kept live through the inverse (register pressure).
            b_gam = tl.load(gam + (gam_row(o_t, T)[:, None]) * (HV * K) + o_k[None, :],
                            mask=m_sw[:, None] & m_k[None, :], other=0.0)
            b_kb = b_beta[:, None] * b_k * exp(b_gam, FAST_EXP)
        b_w = dot(b_tm, b_kb, BF16_DOTS, DOT_PREC, INTERPRET)
        tl.store(w + (o_t[:, None]) * (HV * K) + o_k[None, :], as_stored(b_w, w, INTERPRET).to(w.dtype.element_ty),
                 mask=(m_t & m_sw)[:, None] & m_k[None, :])
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        p_v = (o_t[:, None]) * (HV * V) + o_v[None, :]
        b_v = tl.load(v + p_v, mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)
        b_u = dot(b_tm, b_beta[:, None] * b_v, BF16_DOTS, DOT_PREC, INTERPRET)
        tl.store(u + p_v, as_stored(b_u, u, INTERPRET), mask=m_t[:, None] & m_v[None, :])


@triton.jit
def tm_from_block_inverses(b_m, b_dinv, R: tl.constexpr, BC: tl.constexpr, DOT_PREC: tl.constexpr):
    """Tm = (I + M)^-1 [R, R] from M (strictly lower) and ``b_dinv``, the inverses of
    I + D for M's BC x BC diagonal blocks D (zero off them): I + M = (I + D)(I + P)
    with P = (I + D)^-1 N, N the rest of M, strictly block-lower, so P^NB = 0 and
    (I + P)^-1 = (I - P)(I + P^2) for NB = 4 blocks (I - P for 2)."""
    NB: tl.constexpr = R // BC
    tl.static_assert(NB == 4 or NB == 2, "(I + P)^-1 = (I - P)(I + P^2) needs 4 sub-blocks (I - P: 2)")
    o_r = tl.arange(0, R)
    b_n = tl.where(o_r[:, None] // BC > o_r[None, :] // BC, b_m, 0.0)
    b_eye = tl.where(o_r[:, None] == o_r[None, :], 1.0, 0.0)
    b_p = tl.dot(b_dinv, b_n, input_precision=DOT_PREC)
    if NB == 4:
        b_p2 = tl.dot(b_p, b_p, input_precision=DOT_PREC)
        b_tm = tl.dot(tl.dot(b_eye - b_p, b_eye + b_p2, input_precision=DOT_PREC), b_dinv, input_precision=DOT_PREC)
    else:
        b_tm = tl.dot(b_eye - b_p, b_dinv, input_precision=DOT_PREC)
    return b_tm


@triton.jit
def diag_block_inverses(b_m, R: tl.constexpr, BC: tl.constexpr, METHOD: tl.constexpr):
    """[R, R]: the inverses of I + D for the BC x BC diagonal blocks D of ``b_m``
    (strictly lower, in registers), zero off those blocks, the NB blocks side by side
    on [NB, BC, BC]. METHOD 0: forward substitution, BC - 1 dependent steps, each row
    cut out of D by a reduction. 1: the product (I - D)(I + D^2)(I + D^4)(I + D^8),
    exact for a strictly lower 16 x 16 D (D^16 = 0): six batched fp32 (ieee) dots, no
    dependent row steps; its terms cancel where the keys are nearly parallel (fp32
    inputs lose two digits: intra_fused_fwd.py takes it for 16-bit inputs only)."""
    NB: tl.constexpr = R // BC
    o_b = tl.arange(0, NB)
    o_c = tl.arange(0, BC)
    same_block = (o_b[:, None, None, None] == o_b[None, None, :, None])  # [NB, 1, NB, 1]
    b_d = tl.sum(tl.where(same_block, tl.reshape(b_m, (NB, BC, NB, BC)), 0.0), 2)  # [NB, BC, BC]
    b_eye = tl.where((o_c[:, None] == o_c[None, :])[None, :, :], 1.0, 0.0) + tl.zeros([NB, BC, BC], dtype=tl.float32)
    if METHOD == 1:
        b_x = b_eye - b_d
        b_dp = tl.dot(b_d, b_d, input_precision="ieee")  # D^2
        b_x = tl.dot(b_x, b_eye + b_dp, input_precision="ieee")
        b_dp = tl.dot(b_dp, b_dp, input_precision="ieee")  # D^4
        b_x = tl.dot(b_x, b_eye + b_dp, input_precision="ieee")
        b_dp = tl.dot(b_dp, b_dp, input_precision="ieee")  # D^8
        b_x = tl.dot(b_x, b_eye + b_dp, input_precision="ieee")
    else:
        b_x = b_eye
        for i in range(1, BC):
            row = (o_c == i)
            b_di = tl.sum(tl.where(row[None, :, None], b_d, 0.0), 1)  # row i of every block, [NB, BC]
            b_row = tl.where(row[None, :], 1.0, 0.0) - tl.sum(b_di[:, :, None] * b_x, 1)
            b_x = tl.where(row[None, :, None], b_row[:, None, :], b_x)
    return tl.reshape(tl.where(same_block, b_x[:, :, None, :], 0.0), (R, R))
