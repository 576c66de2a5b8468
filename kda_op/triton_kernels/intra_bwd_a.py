"""Stage 2 of the backward, second half: back through A_kk and A_qk, then dg.

One program per (chunk, batch * value head, slice of K): the slices are
independent here (every product runs along the chunk, not along K), so this is
the widest grid of the backward. It takes dA_kk, dA_qk (intra_bwd.py) back
through A_kk[i, j] = sum_k K_ik K_jk exp(gam_ik - gam_jk) and A_qk alike, adds
the partial dq, dk, d(gam) of intra_bwd.py and turns d(gam) into dg with a
reverse cumulative sum over the chunk (the chunk's d(Gam) goes to every row).

The chunks the forward split at their middle row (steep = 0, intra_a_fwd.py) go
the same way back: four [BT, BT] x [BT, BKD] dots (STEEP = False). The steep ones
go back by sub-blocks of BC rows, in a separate launch of the kernel compiled
with STEEP = True, so that the common variant stays small: per block, the
columns before it in one dot (reference: its first row) and the rows after it in
one more (reference: the first row after it), so every factor is <= 1 for a
decaying gate; the diagonal block as the forward's steep kernel forms it.

With fla's in-kernel gate (GATE > 0, _gate.py) dg goes on through the gate: the
kernel writes d(raw g) and, per (chunk, head, column), the partial sums over the
chunk's rows of d(dt_bias) and d(A_log) (ddt_part, dla_part [B, NC, HV, K]),
which the host sums.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._gate import gate_bwd, gate_params
from ._indexing import chunk_coords, gam_row, work_list_block, work_list_item, work_list_range
from ._math import exp


@triton.jit
def store_dq_dk(dq, dk, dq_out, dk_out, out_scale, offsets, mask, b_dq, b_dk, DIRECT_OUT: tl.constexpr):
    """The last stage's dq and dk of a tile: into the fp32 per value head buffers they
    were read from (``dq``, ``dk``), or with DIRECT_OUT, where gva_reduce has nothing to
    sum (G = 1, settings.DIRECT_DQ_DK), into the op's dq and dk in the inputs' dtype
    (``dq_out``, ``dk_out``), dq scaled by ``out_scale``, as gva_reduce would write them."""
    if DIRECT_OUT:
        tl.store(dq_out + offsets, (b_dq * out_scale).to(dq_out.dtype.element_ty), mask=mask)
        tl.store(dk_out + offsets, b_dk.to(dk_out.dtype.element_ty), mask=mask)
    else:
        tl.store(dq + offsets, b_dq, mask=mask)
        tl.store(dk + offsets, b_dk, mask=mask)


@triton.jit
def _finish_chunk(dq, dk, dgam, dg, dq_out, dk_out, out_scale, dgam_last, g, ddt_part, dla_part, row_ts, m_ts, o_s, m_s,
                  b_q, b_k, b_tq, b_tk, b_tkj, b_ga, b_gbias, lower_bound, GATE: tl.constexpr,
                  DIRECT_OUT: tl.constexpr = False):
    """A chunk's slice from its terms through the A's (rows, and columns ``b_tkj``):
    dq, dk, and dg (``_dg_of_chunk``)."""
    b_dq = tl.load(dq + row_ts, mask=m_ts, other=0.0) + b_tq
    b_dk = tl.load(dk + row_ts, mask=m_ts, other=0.0) + b_tk + b_tkj
    b_dgam = tl.load(dgam + row_ts, mask=m_ts, other=0.0) + b_q * b_tq + b_k * (b_tk - b_tkj)
    _dg_of_chunk(dg, dgam_last, g, ddt_part, dla_part, row_ts, m_ts, o_s, m_s, b_dgam, b_ga, b_gbias, lower_bound,
                 GATE)
    store_dq_dk(dq, dk, dq_out, dk_out, out_scale, row_ts, m_ts, b_dq, b_dk, DIRECT_OUT)


@triton.jit
def _dg_of_chunk(dg, dgam_last, g, ddt_part, dla_part, row_ts, m_ts, o_s, m_s, b_dgam, b_ga, b_gbias, lower_bound,
                 GATE: tl.constexpr):
    """dg of a chunk's slice from its d(gam) ``b_dgam`` [BT, BKD] (rows past the end 0):
    the reverse cumulative sum over the chunk plus dGam; with the gate, on through it,
    with the chunk's partial sums for dA_log and d dt_bias."""
    # dg_t = sum of d(gam) over rows s >= t of the chunk, plus dGam
    b_dg = tl.cumsum(b_dgam, 0, reverse=True) + tl.load(dgam_last + o_s, mask=m_s, other=0.0)[None, :]
    if GATE:
        b_graw = tl.load(g + row_ts, mask=m_ts, other=0.0).to(tl.float32)
        b_dg, b_dla = gate_bwd(b_dg, b_graw, b_ga, b_gbias, lower_bound, GATE)
        tl.store(ddt_part + o_s, tl.sum(tl.where(m_ts, b_dg, 0.0), 0), mask=m_s)
        tl.store(dla_part + o_s, tl.sum(tl.where(m_ts, b_dla, 0.0), 0), mask=m_s)
    tl.store(dg + row_ts, b_dg.to(dg.dtype.element_ty), mask=m_ts)


@triton.jit
def kda_intra_bwd_a_kernel(
    q, k, gam, dakk, daqk, dgam_last, steep,
    dq, dk, dgam, dg, dq_out, dk_out, out_scale,
    g, A_log, dt_bias, lower_bound, ddt_part, dla_part,
    cu_seqlens, chunk_index,  # varlen (IS_VARLEN): _indexing.py
    scale, T, NC,
    H, HV,  # runtime: one compiled kernel serves every head count
    K: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BKD: tl.constexpr,
    STEEP: tl.constexpr, DOT_PREC: tl.constexpr, MAX_SPLIT: tl.constexpr,
    GATE: tl.constexpr = 0, HAS_A: tl.constexpr = False, HAS_BIAS: tl.constexpr = False,
    IS_VARLEN: tl.constexpr = False, BLOCK_REFS: tl.constexpr = False,
    ONE_LAUNCH: tl.constexpr = False, STEEP_DOT_PREC: tl.constexpr = "ieee",
    ROW_BLOCK_DOTS: tl.constexpr = False, FAST_EXP: tl.constexpr = False,
    n_flags=0,  # WORK_LIST: how many steep flags there are (B * NC * HV)
    WORK_LIST: tl.constexpr = False, WL_BLOCK: tl.constexpr = 64, DIRECT_OUT: tl.constexpr = False,
):
    """STEEP = False: the chunks the forward split at their middle row (the others
    return at once); STEEP = True: the steep ones, with sub-blocks. BLOCK_REFS
    (STEEP): a slice whose gam strays at most MAX_SPLIT from the middle row of
    each BC-row block goes back with those rows as references, in the common
    path's [BT, BT] x [BT, BKD] dots (four per block, the other blocks' rows of
    dA masked), instead of block by block. ONE_LAUNCH (settings.INTRA_BWD_A_ONE_LAUNCH):
    both kinds of chunk in one launch, each program on its chunk's path (no program
    only reads its flag and returns). The steep path's dots run at STEEP_DOT_PREC.
    ROW_BLOCK_DOTS (settings.INTRA_BWD_A_ROW_BLOCK_DOTS): the block references' dots
    on each block's own rows of dA, not on all of them with the others zeroed. FAST_EXP:
    _math.exp without subnormals in the split chunks (the steep path keeps tl.exp).
    WORK_LIST (STEEP only; settings.STEEP_WORK_LIST): a 1-D grid of a few programs per
    SM, each reading the flags of its share of the (chunk, head, K slice) items WL_BLOCK
    at a time and taking the steep ones (_indexing.work_list_range, _block, _item), instead of one
    program per item that mostly only reads its flag."""
    if WORK_LIST:
        tl.static_assert(STEEP and not ONE_LAUNCH, "a work list serves the steep launch only")
        NKS: tl.constexpr = (K + BKD - 1) // BKD  # items per flag: the K slices
        start, end = work_list_range(n_flags, NKS)
        for base in range(start, end, WL_BLOCK):
            o_w, pending, n_todo = work_list_block(steep, base, end, NKS, -1, WL_BLOCK)
            for _ in range(n_todo):
                item = tl.min(pending, 0)
                pending = tl.where(o_w == item, end, pending)
                i_c, i_bh, i_s = work_list_item(item, NC, HV, NKS)
                _through_a_item(q, k, gam, dakk, daqk, dgam_last, steep, dq, dk, dgam, dg, dq_out, dk_out, out_scale,
                                g, A_log, dt_bias,
                                lower_bound, ddt_part, dla_part, cu_seqlens, chunk_index, scale, T, NC, H, HV,
                                i_s, i_c, i_bh, K, BT, BC, BKD, STEEP, DOT_PREC, MAX_SPLIT, GATE, HAS_A, HAS_BIAS,
                                IS_VARLEN, BLOCK_REFS, ONE_LAUNCH, STEEP_DOT_PREC, ROW_BLOCK_DOTS, FAST_EXP, DIRECT_OUT)
    else:
        # The K slice varies fastest over the grid: the slices of one chunk run side by
        # side and share their loads of dA_kk, dA_qk through L2.
        _through_a_item(q, k, gam, dakk, daqk, dgam_last, steep, dq, dk, dgam, dg, dq_out, dk_out, out_scale,
                        g, A_log, dt_bias,
                        lower_bound, ddt_part, dla_part, cu_seqlens, chunk_index, scale, T, NC, H, HV,
                        tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64),
                        K, BT, BC, BKD, STEEP, DOT_PREC, MAX_SPLIT, GATE, HAS_A, HAS_BIAS,
                        IS_VARLEN, BLOCK_REFS, ONE_LAUNCH, STEEP_DOT_PREC, ROW_BLOCK_DOTS, FAST_EXP, DIRECT_OUT)


@triton.jit
def _through_a_item(q, k, gam, dakk, daqk, dgam_last, steep, dq, dk, dgam, dg, dq_out, dk_out, out_scale,
                    g, A_log, dt_bias,
                    lower_bound, ddt_part, dla_part, cu_seqlens, chunk_index, scale, T, NC, H, HV,
                    i_s, i_c, i_bh,
                    K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BKD: tl.constexpr,
                    STEEP: tl.constexpr, DOT_PREC: tl.constexpr, MAX_SPLIT: tl.constexpr,
                    GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr,
                    IS_VARLEN: tl.constexpr, BLOCK_REFS: tl.constexpr, ONE_LAUNCH: tl.constexpr,
                    STEEP_DOT_PREC: tl.constexpr, ROW_BLOCK_DOTS: tl.constexpr, FAST_EXP: tl.constexpr,
                    DIRECT_OUT: tl.constexpr):
    """kda_intra_bwd_a_kernel's work on K slice ``i_s`` of chunk slot ``i_c`` of
    (batch *) value head ``i_bh`` (64-bit)."""
    i_b, i_hv, i_h, bos, T, g_c, s_c = chunk_coords(i_c, i_bh, T, NC, H, HV, cu_seqlens, chunk_index, BT, IS_VARLEN)
    # Each pointer moves to this chunk and head once, in 64-bit (bos: the chunk's
    # first row); offsets inside the chunk are 32-bit at any T.
    q += (bos * H + i_h) * K
    k += (bos * H + i_h) * K
    gam += (bos * HV + i_hv) * K
    dakk += (bos * HV + i_hv) * BT
    daqk += (bos * HV + i_hv) * BT
    dq += (bos * HV + i_hv) * K
    dk += (bos * HV + i_hv) * K
    if DIRECT_OUT:  # the op's [B, T, H, K] dq, dk (G = 1: H = HV)
        dq_out += (bos * HV + i_hv) * K
        dk_out += (bos * HV + i_hv) * K
    dg += (bos * HV + i_hv) * K
    dgam += (bos * HV + i_hv) * K
    dgam_last += (g_c * HV + i_hv) * K

    o_s = i_s * BKD + tl.arange(0, BKD)
    m_s = o_s < K
    if GATE:
        g += (bos * HV + i_hv) * K  # the raw gate: dg's layout
        ddt_part += (g_c * HV + i_hv) * K
        dla_part += (g_c * HV + i_hv) * K
        b_ga, b_gbias = gate_params(A_log, dt_bias, i_hv, o_s, m_s, K, HAS_A, HAS_BIAS)
    else:  # unread without the gate
        b_ga = 0.0
        b_gbias = 0.0
    if IS_VARLEN:
        if T <= 0:  # an unused chunk slot: nothing to compute; zero gate partial sums (the host sums every slot)
            if GATE:
                if ONE_LAUNCH or not STEEP:
                    tl.store(ddt_part + o_s, tl.zeros([BKD], dtype=tl.float32), mask=m_s)
                    tl.store(dla_part + o_s, tl.zeros([BKD], dtype=tl.float32), mask=m_s)
            return
    flag = tl.load(steep + g_c * HV + i_hv)
    if ONE_LAUNCH:
        if flag == 0:
            _through_a_split(q, k, gam, dakk, daqk, dgam_last, dq, dk, dgam, dg, dq_out, dk_out, out_scale,
                             g, ddt_part, dla_part, scale, T, H, HV,
                             o_s, m_s, b_ga, b_gbias, lower_bound, K, BT, DOT_PREC, GATE, FAST_EXP,
                             DIRECT_OUT=DIRECT_OUT)
        else:
            _through_a_steep(q, k, gam, dakk, daqk, dgam_last, dq, dk, dgam, dg, dq_out, dk_out, out_scale,
                             g, ddt_part, dla_part, scale, T, H, HV,
                             o_s, m_s, b_ga, b_gbias, lower_bound, K, BT, BC, BKD, STEEP_DOT_PREC, MAX_SPLIT, GATE,
                             BLOCK_REFS, ROW_BLOCK_DOTS, DIRECT_OUT=DIRECT_OUT)
    elif not STEEP:
        if flag == 0:
            _through_a_split(q, k, gam, dakk, daqk, dgam_last, dq, dk, dgam, dg, dq_out, dk_out, out_scale,
                             g, ddt_part, dla_part, scale, T, H, HV,
                             o_s, m_s, b_ga, b_gbias, lower_bound, K, BT, DOT_PREC, GATE, FAST_EXP,
                             DIRECT_OUT=DIRECT_OUT)
    else:
        if flag != 0:
            _through_a_steep(q, k, gam, dakk, daqk, dgam_last, dq, dk, dgam, dg, dq_out, dk_out, out_scale,
                             g, ddt_part, dla_part, scale, T, H, HV,
                             o_s, m_s, b_ga, b_gbias, lower_bound, K, BT, BC, BKD, STEEP_DOT_PREC, MAX_SPLIT, GATE,
                             BLOCK_REFS, ROW_BLOCK_DOTS, DIRECT_OUT=DIRECT_OUT)


@triton.jit
def _through_a_split(q, k, gam, dakk, daqk, dgam_last, dq, dk, dgam, dg, dq_out, dk_out, out_scale,
                     g, ddt_part, dla_part, scale, T, H, HV,
                     o_s, m_s, b_ga, b_gbias, lower_bound,
                     K: tl.constexpr, BT: tl.constexpr, DOT_PREC: tl.constexpr, GATE: tl.constexpr,
                     FAST_EXP: tl.constexpr, DIRECT_OUT: tl.constexpr = False):
    """A chunk the forward split at its middle row (steep flag 0), one K slice."""
    # Split at the middle row m as the forward did: every factor lies within
    # exp(+-MAX_SPLIT); dA_kk and dA_qk are zero above their diagonals, so no
    # overflowing product enters.
    o_r = tl.arange(0, BT)
    o_t = o_r
    m_t = o_t < T
    m_ts = m_t[:, None] & m_s[None, :]
    b_g = tl.load(gam + (gam_row(o_t, T)[:, None]) * (HV * K) + o_s[None, :], mask=m_s[None, :], other=0.0)
    b_gmid = tl.load(gam + gam_row(BT // 2, T) * (HV * K) + o_s, mask=m_s, other=0.0)
    b_dmid = b_g - b_gmid[None, :]
    b_q = tl.load(q + (o_t[:, None]) * (H * K) + o_s[None, :], mask=m_ts, other=0.0).to(tl.float32) * scale
    b_k = tl.load(k + (o_t[:, None]) * (H * K) + o_s[None, :], mask=m_ts, other=0.0).to(tl.float32)
    p_a = (o_t[:, None]) * (HV * BT) + o_r[None, :]
    b_dqk = tl.load(daqk + p_a, mask=m_t[:, None], other=0.0)
    b_dkk = tl.load(dakk + p_a, mask=m_t[:, None], other=0.0)
    b_ep = exp(b_dmid, FAST_EXP)
    b_en = exp(-b_dmid, FAST_EXP)
    b_kn = b_k * b_en
    b_tq = b_ep * tl.dot(b_dqk, b_kn, input_precision=DOT_PREC)
    b_tk = b_ep * tl.dot(b_dkk, b_kn, input_precision=DOT_PREC)
    b_tkj = b_en * (tl.dot(tl.trans(b_dqk), b_q * b_ep, input_precision=DOT_PREC)
                    + tl.dot(tl.trans(b_dkk), b_k * b_ep, input_precision=DOT_PREC))
    row_ts = (o_t[:, None]) * (HV * K) + o_s[None, :]
    _finish_chunk(dq, dk, dgam, dg, dq_out, dk_out, out_scale, dgam_last, g, ddt_part, dla_part, row_ts, m_ts, o_s, m_s,
                  b_q, b_k, b_tq, b_tk, b_tkj, b_ga, b_gbias, lower_bound, GATE, DIRECT_OUT=DIRECT_OUT)


@triton.jit
def _through_a_row_blocks(q, k, gam, dakk, daqk, dgam_last, dq, dk, dgam, dg, dq_out, dk_out, out_scale,
                          g, ddt_part, dla_part, scale, T, H, HV,
                          o_s, m_s, b_ga, b_gbias, lower_bound, b_q, b_k, b_g,
                          K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BKD: tl.constexpr,
                          DOT_PREC: tl.constexpr, GATE: tl.constexpr, DIRECT_OUT: tl.constexpr = False):
    """The block-reference path (each BC-row block's middle row m(i) the reference of
    its rows) with each block's dots on its own rows of dA: [BC, BT] x [BT, BKD] for its
    rows' terms and [BT, BC] x [BC, BKD] for what its rows give the columns before them,
    one [BT, BT] x [BT, BKD] dot's work a block where the dots on every row (the other
    blocks' rows zeroed) take four. ``b_q`` (scaled), ``b_k``, ``b_g``: the chunk's
    slice, [BT, BKD]."""
    NB: tl.constexpr = BT // BC
    o_r = tl.arange(0, BT)
    o_c = tl.arange(0, BC)
    o_b = tl.arange(0, NB)
    m_ts = (o_r < T)[:, None] & m_s[None, :]
    # the rows' terms of each block, [NB, BC, BKD], made [BT, BKD] at the end
    b_tq3 = tl.zeros([NB, BC, BKD], dtype=tl.float32)
    b_tk3 = tl.zeros([NB, BC, BKD], dtype=tl.float32)
    b_tkj = tl.zeros([BT, BKD], dtype=tl.float32)
    for i_i in tl.static_range(NB):
        # a block past the sequence's end (short or last chunks) has dA = 0: skipped
        if i_i * BC < T:
            o_i = i_i * BC + o_c
            m_i = o_i < T
            m_is = m_i[:, None] & m_s[None, :]
            # the block's rows again (L1 / L2), as [BC, BKD]
            b_qi = tl.load(q + (o_i[:, None]) * (H * K) + o_s[None, :], mask=m_is, other=0.0).to(tl.float32) * scale
            b_ki = tl.load(k + (o_i[:, None]) * (H * K) + o_s[None, :], mask=m_is, other=0.0).to(tl.float32)
            b_gi = tl.load(gam + (gam_row(o_i, T)[:, None]) * (HV * K) + o_s[None, :], mask=m_s[None, :], other=0.0)
            b_gm = tl.load(gam + gam_row(i_i * BC + BC // 2, T) * (HV * K) + o_s, mask=m_s, other=0.0)
            b_eri = tl.exp(b_gi - b_gm[None, :])  # exp(gam_i - gam_m(i)), within exp(MAX_SPLIT)
            p_a = (o_i[:, None]) * (HV * BT) + o_r[None, :]
            b_dqk_i = tl.load(daqk + p_a, mask=m_i[:, None], other=0.0)
            b_dkk_i = tl.load(dakk + p_a, mask=m_i[:, None], other=0.0)
            # columns up to the block's end: exp(gam_m - gam_j) within exp(MAX_SPLIT) in the
            # block, <= 1 before it for a decaying gate; after it dA is zero, the factor dropped
            b_ec = tl.exp(tl.where((o_r < (i_i + 1) * BC)[:, None], b_gm[None, :] - b_g, float("-inf")))
            b_kc = b_k * b_ec
            b_tq_i = b_eri * tl.dot(b_dqk_i, b_kc, input_precision=DOT_PREC)
            b_tk_i = b_eri * tl.dot(b_dkk_i, b_kc, input_precision=DOT_PREC)
            b_tkj += b_ec * (tl.dot(tl.trans(b_dqk_i), b_qi * b_eri, input_precision=DOT_PREC)
                             + tl.dot(tl.trans(b_dkk_i), b_ki * b_eri, input_precision=DOT_PREC))
            here = (o_b == i_i)[:, None, None]
            b_tq3 = tl.where(here, b_tq_i[None, :, :], b_tq3)
            b_tk3 = tl.where(here, b_tk_i[None, :, :], b_tk3)
    row_ts = (o_r[:, None]) * (HV * K) + o_s[None, :]
    _finish_chunk(dq, dk, dgam, dg, dq_out, dk_out, out_scale, dgam_last, g, ddt_part, dla_part, row_ts, m_ts, o_s, m_s,
                  b_q, b_k, tl.reshape(b_tq3, [BT, BKD]), tl.reshape(b_tk3, [BT, BKD]), b_tkj,
                  b_ga, b_gbias, lower_bound, GATE, DIRECT_OUT=DIRECT_OUT)


@triton.jit
def _through_a_steep(q, k, gam, dakk, daqk, dgam_last, dq, dk, dgam, dg, dq_out, dk_out, out_scale,
                     g, ddt_part, dla_part, scale, T, H, HV,
                     o_s, m_s, b_ga, b_gbias, lower_bound,
                     K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BKD: tl.constexpr, DOT_PREC: tl.constexpr,
                     MAX_SPLIT: tl.constexpr, GATE: tl.constexpr, BLOCK_REFS: tl.constexpr,
                     ROW_BLOCK_DOTS: tl.constexpr = False, DIRECT_OUT: tl.constexpr = False):
    """A steep chunk (steep flag 1 or 2), one K slice, by sub-blocks of BC rows."""
    o_c = tl.arange(0, BC)
    causal = (o_c[:, None] >= o_c[None, :])[:, :, None]
    # The chunk's whole slice, read once: each row block takes the columns
    # before it in one [BC, BT] x [BT, BKD] dot, and each column block the
    # rows after it in one more, instead of a small dot per pair of blocks.
    o_r = tl.arange(0, BT)
    o_t = o_r
    m_t = o_t < T
    m_ts = m_t[:, None] & m_s[None, :]
    b_q = tl.load(q + (o_t[:, None]) * (H * K) + o_s[None, :], mask=m_ts, other=0.0).to(tl.float32) * scale
    b_k = tl.load(k + (o_t[:, None]) * (H * K) + o_s[None, :], mask=m_ts, other=0.0).to(tl.float32)
    b_g = tl.load(gam + (gam_row(o_t, T)[:, None]) * (HV * K) + o_s[None, :], mask=m_s[None, :], other=0.0)
    # each row's block's middle row: the references of the block path
    b_gmb = tl.load(gam + gam_row((o_r // BC) * BC + BC // 2, T)[:, None] * (HV * K) + o_s[None, :],
                    mask=m_s[None, :], other=0.0)
    b_dblk = b_g - b_gmb
    if BLOCK_REFS and ROW_BLOCK_DOTS and tl.max(tl.max(tl.abs(b_dblk), 1), 0) <= MAX_SPLIT:
        _through_a_row_blocks(q, k, gam, dakk, daqk, dgam_last, dq, dk, dgam, dg, dq_out, dk_out, out_scale,
                              g, ddt_part, dla_part, scale, T, H, HV,
                              o_s, m_s, b_ga, b_gbias, lower_bound, b_q, b_k, b_g, K, BT, BC, BKD, DOT_PREC, GATE,
                              DIRECT_OUT=DIRECT_OUT)
    elif BLOCK_REFS and tl.max(tl.max(tl.abs(b_dblk), 1), 0) <= MAX_SPLIT:
        p_a = (o_t[:, None]) * (HV * BT) + o_r[None, :]
        b_dqk = tl.load(daqk + p_a, mask=m_t[:, None], other=0.0)
        b_dkk = tl.load(dakk + p_a, mask=m_t[:, None], other=0.0)
        b_er = tl.exp(b_dblk)  # exp(gam_i - gam_m(i)), m(i) the middle row of i's block
        b_qr = b_q * b_er
        b_kr = b_k * b_er
        b_tq = tl.zeros([BT, BKD], dtype=tl.float32)
        b_tk = tl.zeros([BT, BKD], dtype=tl.float32)
        b_tkj = tl.zeros([BT, BKD], dtype=tl.float32)
        for i_i in tl.static_range(BT // BC):
            # a block past the sequence's end (short or last chunks) has dA = 0: skipped
            if i_i * BC < T:
                rows = (o_r // BC == i_i)[:, None]
                b_gm = tl.load(gam + gam_row(i_i * BC + BC // 2, T) * (HV * K) + o_s, mask=m_s, other=0.0)
                # columns up to the block's end: exp(gam_m - gam_j) within exp(MAX_SPLIT) in the
                # block, <= 1 before it for a decaying gate; after it dA is zero, the factor dropped
                b_ec = tl.exp(tl.where((o_r < (i_i + 1) * BC)[:, None], b_gm[None, :] - b_g, float("-inf")))
                b_dqk_i = tl.where(rows, b_dqk, 0.0)
                b_dkk_i = tl.where(rows, b_dkk, 0.0)
                b_kc = b_k * b_ec
                b_tq += tl.dot(b_dqk_i, b_kc, input_precision=DOT_PREC)
                b_tk += tl.dot(b_dkk_i, b_kc, input_precision=DOT_PREC)
                b_tkj += b_ec * (tl.dot(tl.trans(b_dqk_i), b_qr, input_precision=DOT_PREC)
                                 + tl.dot(tl.trans(b_dkk_i), b_kr, input_precision=DOT_PREC))
        row_ts = (o_t[:, None]) * (HV * K) + o_s[None, :]
        _finish_chunk(dq, dk, dgam, dg, dq_out, dk_out, out_scale,
                      dgam_last, g, ddt_part, dla_part, row_ts, m_ts, o_s, m_s,
                      b_q, b_k, b_er * b_tq, b_er * b_tk, b_tkj, b_ga, b_gbias,
                      lower_bound, GATE, DIRECT_OUT=DIRECT_OUT)
    else:
        b_carry = tl.load(dgam_last + o_s, mask=m_s, other=0.0)
        b_ddt = tl.zeros([BKD], dtype=tl.float32)  # the gate's partial sums (GATE)
        b_dla_sum = tl.zeros([BKD], dtype=tl.float32)
        for i_i in tl.static_range(BT // BC - 1, -1, -1):  # last block first, for the reverse cumsum
            if i_i * BC < T:  # a block past the sequence's end holds no row: skipped
                o_i = i_i * BC + o_c
                m_i = o_i < T
                m_is = m_i[:, None] & m_s[None, :]
                row_is = (o_i[:, None]) * (HV * K) + o_s[None, :]
                b_qi = tl.load(q + (o_i[:, None]) * (H * K) + o_s[None, :], mask=m_is, other=0.0).to(tl.float32) * scale
                b_ki = tl.load(k + (o_i[:, None]) * (H * K) + o_s[None, :], mask=m_is, other=0.0).to(tl.float32)
                b_gi = tl.load(gam + (gam_row(o_i, T)[:, None]) * (HV * K) + o_s[None, :], mask=m_s[None, :], other=0.0)
                b_dqi = tl.load(dq + row_is, mask=m_is, other=0.0)
                b_dki = tl.load(dk + row_is, mask=m_is, other=0.0)
                b_dgi = tl.load(dgam + row_is, mask=m_is, other=0.0)
                da_row = (o_i[:, None]) * (HV * BT)

                if i_i > 0:
                    # block i_i's rows, the columns j before it; reference r = its first
                    # row: exp(gam_i - gam_r) and exp(gam_r - gam_j) are <= 1 for a
                    # decaying gate
                    b_gr = tl.load(gam + gam_row(i_i * BC, T) * (HV * K) + o_s, mask=m_s, other=0.0)
                    before = o_r < i_i * BC
                    b_kb = b_k * tl.exp(tl.where(before[:, None], b_gr[None, :] - b_g, float("-inf")))
                    m_before = m_i[:, None] & before[None, :]
                    b_dqk = tl.load(daqk + da_row + o_r[None, :], mask=m_before, other=0.0)
                    b_dkk = tl.load(dakk + da_row + o_r[None, :], mask=m_before, other=0.0)
                    b_ai = tl.exp(b_gi - b_gr[None, :])
                    b_tq = b_ai * tl.dot(b_dqk, b_kb, input_precision=DOT_PREC)
                    b_tk = b_ai * tl.dot(b_dkk, b_kb, input_precision=DOT_PREC)
                    b_dqi += b_tq
                    b_dki += b_tk
                    b_dgi += b_qi * b_tq + b_ki * b_tk

                if i_i < BT // BC - 1:
                    # block i_i as the columns of the rows l after it; reference c = the
                    # first row after the block: exp(gam_l - gam_c), exp(gam_c - gam_j) <= 1
                    b_gc = tl.load(gam + gam_row((i_i + 1) * BC, T) * (HV * K) + o_s, mask=m_s, other=0.0)
                    after = o_r >= (i_i + 1) * BC
                    b_ea = tl.exp(tl.where(after[:, None], b_g - b_gc[None, :], float("-inf")))
                    p_col = (o_t[:, None]) * (HV * BT) + i_i * BC + o_c[None, :]
                    m_after = (m_t & after)[:, None]
                    b_dqk = tl.load(daqk + p_col, mask=m_after, other=0.0)
                    b_dkk = tl.load(dakk + p_col, mask=m_after, other=0.0)
                    b_tk = tl.dot(tl.trans(b_dqk), b_q * b_ea, input_precision=DOT_PREC)
                    b_tk += tl.dot(tl.trans(b_dkk), b_k * b_ea, input_precision=DOT_PREC)
                    b_tk = tl.exp(b_gc[None, :] - b_gi) * b_tk
                    b_dki += b_tk
                    b_dgi -= b_ki * b_tk

                # diagonal block: split at its middle row m when the gates allow (as in
                # intra_a_fwd.py): exp(gam_i - gam_j) = exp(gam_i - gam_m) exp(gam_m - gam_j)
                col = i_i * BC + o_c[None, :]
                b_dqk = tl.load(daqk + da_row + col, mask=m_i[:, None], other=0.0)
                b_dkk = tl.load(dakk + da_row + col, mask=m_i[:, None], other=0.0)
                b_gm = tl.load(gam + gam_row(i_i * BC + BC // 2, T) * (HV * K) + o_s, mask=m_s, other=0.0)
                b_gd = b_gi - b_gm[None, :]
                if tl.max(tl.max(tl.abs(b_gd), 1), 0) <= MAX_SPLIT:
                    b_em = tl.exp(b_gd)
                    b_en = tl.exp(-b_gd)
                    b_kn = b_ki * b_en
                    b_tq = b_em * tl.dot(b_dqk, b_kn, input_precision=DOT_PREC)
                    b_tk = b_em * tl.dot(b_dkk, b_kn, input_precision=DOT_PREC)
                    b_tkj = b_en * (tl.dot(tl.trans(b_dqk), b_qi * b_em, input_precision=DOT_PREC)
                                    + tl.dot(tl.trans(b_dkk), b_ki * b_em, input_precision=DOT_PREC))
                else:  # steep gates: exact exp(gam_i - gam_j) per pair
                    b_e = tl.exp(tl.where(causal, b_gi[:, None, :] - b_gi[None, :, :], float("-inf")))
                    b_tq = tl.sum(b_dqk[:, :, None] * b_ki[None, :, :] * b_e, 1)
                    b_tk = tl.sum(b_dkk[:, :, None] * b_ki[None, :, :] * b_e, 1)
                    b_tkj = tl.sum((b_dqk[:, :, None] * b_qi[:, None, :] + b_dkk[:, :, None] * b_ki[:, None, :]) * b_e, 0)
                b_dqi += b_tq
                b_dki += b_tk + b_tkj
                b_dgi += b_qi * b_tq + b_ki * b_tk - b_ki * b_tkj

                # dg_t = sum of d(gam) over rows s >= t of the chunk, plus dGam
                b_dgt = tl.cumsum(b_dgi, 0, reverse=True) + b_carry[None, :]
                b_carry += tl.sum(b_dgi, 0)
                if GATE:
                    b_graw = tl.load(g + row_is, mask=m_is, other=0.0).to(tl.float32)
                    b_dgt, b_dla = gate_bwd(b_dgt, b_graw, b_ga, b_gbias, lower_bound, GATE)
                    b_ddt += tl.sum(tl.where(m_is, b_dgt, 0.0), 0)
                    b_dla_sum += tl.sum(tl.where(m_is, b_dla, 0.0), 0)
                store_dq_dk(dq, dk, dq_out, dk_out, out_scale, row_is, m_is, b_dqi, b_dki,
                            DIRECT_OUT)
                tl.store(dg + row_is, b_dgt.to(dg.dtype.element_ty), mask=m_is)
        if GATE:
            tl.store(ddt_part + o_s, b_ddt, mask=m_s)
            tl.store(dla_part + o_s, b_dla_sum, mask=m_s)
