"""Stage 1 of the forward in one launch (settings.INTRA_FUSED_FWD): gam, the A's,
Tm, W and U of each chunk without A_kk, gam or the diagonal inverses passing
through memory.

The default forward forms them in four launches (gam_fwd.py, intra_a_fwd.py,
diag_inv.py, intra_wu_fwd.py) that hand over gam (fp32), A_kk (fp32) and the
diagonal blocks' inverses through memory and read K twice: at K = V = 128, bf16,
about 5.3 KB a token and head. Here one program per (chunk, batch * value head)
reads g, Q, K, V and beta and writes what the scan and the output read (A_qk, Qg,
Kr, W, U, and gam's last row of the chunk, the scan's decay): about 2.4 KB; with
STORE_TM (kept intermediates) also gam, A_kk and Tm, 1 KB more.

  pass 1, over K slices of BKA: gam = cumsum(g) in fp32, Qg and Kr stored, how far
          gam strays from the chunk's middle row, and both A's split at that row
          (intra_a_fwd.py's _split_a_dots; kept entries exact, the ones above the
          diagonal may overflow and are dropped);
  then    A_qk stored; Tm = (I + diag(beta) A_kk)^-1 from the A_kk held here
          (the diagonal blocks' inverses by DIAG_INV_METHOD, then
          intra_wu_fwd.tm_from_block_inverses);
  pass 2, over K slices of BK: gam again from g (a cumsum of what pass 1 read, in
          cache), W = Tm diag(beta) (K exp(gam)); over V blocks of BV, U = Tm
          diag(beta) V.
TM_ONLY (settings.INTRA_FUSED_TM_ONLY): for the scan that forms U' = Tm (diag(beta) V -
Kb S) itself (settings.FUSED_OUTPUT_SOLVE_U), pass 1 also stores Kb = diag(beta) K
exp(gam) in W's place and Tm is stored in bf16; no pass 2. What the four launches'
form of that (intra_a_fwd, diag_inv, intra_wu_fwd's TM_ONLY) passes through memory,
A_kk in fp32 and the diagonal inverses, stays on chip.

A chunk whose gam strays more than MAX_SPLIT from its middle row takes each
16-row block's middle row as the reference of the block's rows (steep flag 1,
BLOCK_REFS) where every block stays within MAX_SPLIT of it and the log decays are
<= 0, in a second pass over K; otherwise (steep flag 2) it stores its whole gam
and leaves its A's to intra_a_fwd.py's steep launch and its Tm, W and U to
intra_wu_fwd.py's ONLY_STEEP launch, which the host runs after this one
(fwd._intra_fused_fwd). fla's in-kernel gate (GATE) is applied to g as it is read.

DIAG_INV_METHOD: how the inverses of I + D for the four 16 x 16 diagonal blocks D of
M = diag(beta) A_kk are formed in registers (intra_wu_fwd.diag_block_inverses: 0
forward substitution, 1 a product of batched dots).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._dot import as_stored, dot
from ._gate import gate_fwd, gate_params
from ._indexing import chunk_coords, chunk_in_sequence
from ._math import exp
from .intra_a_fwd import _split_a_dots
from .intra_wu_fwd import diag_block_inverses, tm_from_block_inverses


@triton.jit
def _log_decay(g, p_tk, m_tk, A_log, dt_bias, lower_bound, i_hv, o_k, m_k, K: tl.constexpr, GATE: tl.constexpr,
               HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A [BT, BK] tile of the log decay in fp32: g as given, or from fla's raw gate
    (GATE, _gate.py); 0 on rows past the end (the gate of 0 is not 0) and columns past K."""
    b_g = tl.load(g + p_tk, mask=m_tk, other=0.0).to(tl.float32)
    if GATE:
        b_a, b_bias = gate_params(A_log, dt_bias, i_hv, o_k, m_k, K, HAS_A, HAS_BIAS)
        b_g = tl.where(m_tk, gate_fwd(b_g, b_a, b_bias, lower_bound, GATE), 0.0)
    return b_g


@triton.jit
def _gam_slice(g, i_s, m_t, A_log, dt_bias, lower_bound, i_hv, HV, K: tl.constexpr, BT: tl.constexpr,
               BKS: tl.constexpr, GATE: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr):
    """K slice ``i_s`` (BKS columns) of the chunk: its columns and their mask, the
    tile's mask (rows ``m_t``) and offsets, the log decay and gam = cumsum over rows."""
    o_r = tl.arange(0, BT)
    o_k = i_s * BKS + tl.arange(0, BKS)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    p_tk = (o_r[:, None]) * (HV * K) + o_k[None, :]
    b_g = _log_decay(g, p_tk, m_tk, A_log, dt_bias, lower_bound, i_hv, o_k, m_k, K, GATE, HAS_A, HAS_BIAS)
    return o_k, m_k, m_tk, p_tk, b_g, tl.cumsum(b_g, axis=0)


@triton.jit
def _qk_slice(q, k, o_k, m_tk, scale, H, K: tl.constexpr, BT: tl.constexpr):
    """The slice's Q * scale and K tiles in fp32."""
    o_r = tl.arange(0, BT)
    b_q = tl.load(q + (o_r[:, None]) * (H * K) + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32) * scale
    b_k = tl.load(k + (o_r[:, None]) * (H * K) + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    return b_q, b_k


@triton.jit
def _block_middles(b_gam, BT: tl.constexpr, BC: tl.constexpr):
    """From a [BT, BK] tile of gam: each BC-row block's middle row [BT // BC, BK], and
    that row repeated over the block's rows [BT, BK]."""
    NB: tl.constexpr = BT // BC
    BK: tl.constexpr = b_gam.shape[1]
    b_blocks = tl.reshape(b_gam, (NB, BC, BK))
    b_mid = tl.sum(tl.where((tl.arange(0, BC) == BC // 2)[None, :, None], b_blocks, 0.0), 1)
    return b_mid, tl.reshape(tl.broadcast_to(b_mid[:, None, :], (NB, BC, BK)), (BT, BK))


@triton.jit
def _block_ref_dots(b_q, b_k, b_gam, b_mid, b_gmb, b_akk, b_aqk, BT: tl.constexpr, BC: tl.constexpr,
                    DOT_PREC: tl.constexpr, FAST_EXP: tl.constexpr):
    """One K slice's share of both A's with each BC-row block's middle row m as the
    reference of its rows (intra_a_fwd.py's block references, from gam in registers):
    A[i, j] += sum_k X_ik exp(gam_ik - gam_mk) K_jk exp(gam_mk - gam_jk) for j up to
    the end of i's block. Within exp(+-MAX_SPLIT) where every block strays at most
    MAX_SPLIT from its middle row; before the block exp(gam_m - gam_j) <= 1 for a
    decaying gate. Entries above the diagonal inside a block may overflow: dropped later."""
    NB: tl.constexpr = BT // BC
    o_r = tl.arange(0, BT)
    o_b = tl.arange(0, NB)
    b_er = exp(b_gam - b_gmb, FAST_EXP)
    b_kl = b_k * b_er
    b_ql = b_q * b_er
    for i_i in tl.static_range(NB):
        rows = (o_r // BC == i_i)[:, None]
        b_gm = tl.sum(tl.where((o_b == i_i)[:, None], b_mid, 0.0), 0)
        b_kc = tl.trans(b_k * exp(tl.where((o_r < (i_i + 1) * BC)[:, None], b_gm[None, :] - b_gam, float("-inf")),
                                  FAST_EXP))
        b_akk += tl.dot(tl.where(rows, b_kl, 0.0), b_kc, input_precision=DOT_PREC)
        b_aqk += tl.dot(tl.where(rows, b_ql, 0.0), b_kc, input_precision=DOT_PREC)
    return b_akk, b_aqk


@triton.jit
def kda_intra_fused_fwd_kernel(
    q, k, v, g, beta, gam, aqk, steep, qg, kr, w, u, akk, tm, A_log, dt_bias, lower_bound,
    cu_seqlens, chunk_index,  # varlen (IS_VARLEN): _indexing.py
    scale, T, NC,
    H, HV,  # runtime: one compiled kernel serves every head count
    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BKA: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_PREC: tl.constexpr, MAX_SPLIT: tl.constexpr, DIAG_INV_METHOD: tl.constexpr = 0,
    BF16_DOTS: tl.constexpr = False, INTERPRET: tl.constexpr = False, IS_VARLEN: tl.constexpr = False,
    QG_FIRST: tl.constexpr = True, KR_LAST: tl.constexpr = True, W_FIRST: tl.constexpr = True,
    FAST_EXP: tl.constexpr = False, GATE: tl.constexpr = 0, HAS_A: tl.constexpr = False,
    HAS_BIAS: tl.constexpr = False, BLOCK_REFS: tl.constexpr = False, NONPOSITIVE: tl.constexpr = False,
    STORE_TM: tl.constexpr = False, TM_ONLY: tl.constexpr = False,
):
    # STORE_TM (a forward that keeps its intermediates, the backward's recompute):
    # also the whole gam, A_kk and Tm, as the four launches keep them.
    # TM_ONLY (settings.INTRA_FUSED_TM_ONLY, for the scan that forms U' itself:
    # settings.FUSED_OUTPUT_SOLVE_U): Kb = diag(beta) K exp(gam) into ``w`` in pass 1 and
    # Tm in ``tm``'s dtype (bf16), no pass 2 (neither W nor U).
    # GATE, HAS_A, HAS_BIAS: fla's in-kernel gate (_gate.py): g is the raw gate.
    # BLOCK_REFS (settings.INTRA_A_BLOCK_REFS): a chunk too steep to split at its middle
    # row whose 16-row blocks each stay within MAX_SPLIT of their middle rows, and whose
    # log decays are <= 0, takes those rows as references (steep flag 1), in a second
    # pass over K here; NONPOSITIVE: the gate's form makes every log decay <= 0 (no check).
    # QG_FIRST / KR_LAST / W_FIRST: as intra_a_fwd.py's and intra_wu_fwd.py's (a forward
    # that keeps nothing leaves unwritten what nothing reads).
    # scale in fp32 whatever the caller's scalar type (inductor passes a Python float as fp64).
    scale = tl.cast(scale, tl.float32)
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_hv, i_h, bos, T, g_c, s_c = chunk_coords(i_c, i_bh, T, NC, H, HV, cu_seqlens, chunk_index, BT, IS_VARLEN)
    steep += g_c * HV + i_hv
    if IS_VARLEN:
        if T <= 0:  # an unused chunk slot: its flag, read by the launches after, is 0
            tl.store(steep, 0)
            return
    # Each pointer moves to this chunk and head once, in 64-bit (bos: the chunk's
    # first row); offsets inside the chunk are 32-bit at any T.
    q += (bos * H + i_h) * K
    k += (bos * H + i_h) * K
    g += (bos * HV + i_hv) * K
    gam += (bos * HV + i_hv) * K
    qg += (bos * HV + i_hv) * K
    kr += (bos * HV + i_hv) * K
    w += (bos * HV + i_hv) * K
    aqk += (bos * HV + i_hv) * BT
    akk += (bos * HV + i_hv) * BT
    tm += (bos * HV + i_hv) * BT
    v += (bos * HV + i_hv) * V
    u += (bos * HV + i_hv) * V
    beta += bos * HV + i_hv
    later = chunk_in_sequence(i_c, chunk_index, IS_VARLEN) > 0  # not the sequence's first chunk
    store_qg = later | QG_FIRST
    store_kr = (T > BT) | KR_LAST
    store_w = later | W_FIRST

    o_r = tl.arange(0, BT)
    m_t = o_r < T
    is_last = (o_r == BT - 1)[:, None]
    is_mid = (o_r == BT // 2)[:, None]
    last_row = tl.minimum(T, BT) - 1  # the row of gam the scan reads: the chunk's last

    # pass 1 over K slices (columns are independent): rows past the end load g = 0,
    # so they repeat the last row's gam (_indexing.gam_row's value)
    b_spread = tl.zeros([BT, BKA], dtype=tl.float32)
    b_bspread = tl.zeros([BT, BKA], dtype=tl.float32)  # BLOCK_REFS: from each block's middle row
    b_gmax = tl.zeros([BT, BKA], dtype=tl.float32)  # BLOCK_REFS, not NONPOSITIVE: the largest log decay
    b_akk = tl.zeros([BT, BT], dtype=tl.float32)
    b_aqk = tl.zeros([BT, BT], dtype=tl.float32)
    if TM_ONLY:  # Kb's rows in pass 1 (otherwise loaded after it: live shorter, fewer spills)
        b_beta = tl.load(beta + o_r * HV, mask=m_t, other=0.0).to(tl.float32)
    for i_s in range(tl.cdiv(K, BKA)):
        o_k, m_k, m_tk, p_tk, b_g, b_gam = _gam_slice(g, i_s, m_t, A_log, dt_bias, lower_bound, i_hv, HV, K, BT, BKA,
                                                      GATE, HAS_A, HAS_BIAS)
        if BLOCK_REFS:
            b_mid, b_gmb = _block_middles(b_gam, BT, BC)
            b_bspread = tl.maximum(b_bspread, tl.abs(b_gam - b_gmb))
            if not NONPOSITIVE:
                b_gmax = tl.maximum(b_gmax, b_g)
        b_glast = tl.sum(tl.where(is_last, b_gam, 0.0), 0)
        b_gmid = tl.sum(tl.where(is_mid, b_gam, 0.0), 0)
        if STORE_TM:
            tl.store(gam + p_tk, b_gam, mask=m_tk)
        else:
            tl.store(gam + last_row * (HV * K) + o_k, b_glast, mask=m_k)
        b_dmid = b_gam - b_gmid[None, :]
        b_spread = tl.maximum(b_spread, tl.abs(b_dmid))  # elementwise; one reduction after the loop
        b_q, b_k = _qk_slice(q, k, o_k, m_tk, scale, H, K, BT)
        if store_qg:
            tl.store(qg + p_tk, as_stored(b_q * exp(b_gam, FAST_EXP), qg, INTERPRET).to(qg.dtype.element_ty),
                     mask=m_tk)
        if store_kr:
            tl.store(kr + p_tk, as_stored(b_k * exp(b_glast[None, :] - b_gam, FAST_EXP), kr,
                                          INTERPRET).to(kr.dtype.element_ty), mask=m_tk)
        if TM_ONLY:
            if store_w:  # Kb, what the scan reads where it would read W
                tl.store(w + p_tk, as_stored(b_beta[:, None] * b_k * exp(b_gam, FAST_EXP), w,
                                             INTERPRET).to(w.dtype.element_ty), mask=m_tk)
        b_akk, b_aqk = _split_a_dots(b_q, b_k, b_dmid, b_akk, b_aqk, DOT_PREC, FAST_EXP)
    spread = tl.max(tl.max(b_spread, 1), 0)
    if BLOCK_REFS:
        by_blocks = (tl.max(tl.max(b_bspread, 1), 0) <= MAX_SPLIT) & (tl.max(tl.max(b_gmax, 1), 0) <= 0.0)
        mode = tl.where(spread <= MAX_SPLIT, 0, tl.where(by_blocks, 1, 2))
    else:
        mode = tl.where(spread <= MAX_SPLIT, 0, 2)
    tl.store(steep, mode.to(tl.int32))
    if mode == 1:
        # the A's again by block references (the split ones may hold inf: dropped)
        b_akk = tl.zeros([BT, BT], dtype=tl.float32)
        b_aqk = tl.zeros([BT, BT], dtype=tl.float32)
        for i_s in range(tl.cdiv(K, BKA)):
            o_k, m_k, m_tk, p_tk, b_g, b_gam = _gam_slice(g, i_s, m_t, A_log, dt_bias, lower_bound, i_hv, HV, K, BT,
                                                          BKA, GATE, HAS_A, HAS_BIAS)
            b_mid, b_gmb = _block_middles(b_gam, BT, BC)
            b_q, b_k = _qk_slice(q, k, o_k, m_tk, scale, H, K, BT)
            b_akk, b_aqk = _block_ref_dots(b_q, b_k, b_gam, b_mid, b_gmb, b_akk, b_aqk, BT, BC, DOT_PREC, FAST_EXP)

    if mode < 2:
        p_a = (o_r[:, None]) * (HV * BT) + o_r[None, :]
        tl.store(aqk + p_a, as_stored(tl.where(o_r[:, None] >= o_r[None, :], b_aqk, 0.0), aqk,
                                      INTERPRET).to(aqk.dtype.element_ty), mask=m_t[:, None])
        # M = diag(beta) A_kk, strictly lower (entries above the diagonal may be inf: dropped)
        if not TM_ONLY:
            b_beta = tl.load(beta + o_r * HV, mask=m_t, other=0.0).to(tl.float32)
        b_m = tl.where(o_r[:, None] > o_r[None, :], b_beta[:, None] * b_akk, 0.0)
        b_tm = tm_from_block_inverses(b_m, diag_block_inverses(b_m, BT, BC, DIAG_INV_METHOD), BT, BC, DOT_PREC)
        if STORE_TM:
            tl.store(akk + p_a, as_stored(tl.where(o_r[:, None] > o_r[None, :], b_akk, 0.0), akk,
                                          INTERPRET).to(akk.dtype.element_ty), mask=m_t[:, None])
            tl.store(tm + p_a, b_tm, mask=m_t[:, None])
        if TM_ONLY:
            tl.store(tm + p_a, as_stored(b_tm, tm, INTERPRET).to(tm.dtype.element_ty), mask=m_t[:, None])
        else:
            # pass 2: W's columns in K slices of BK (gam formed again from g: in cache), U's in V blocks
            m_sw = m_t & ((o_r * 0 + store_w.to(tl.int32)) > 0)
            for i_k in range(tl.cdiv(K, BK)):
                o_k, m_k, m_wk, p_tk, b_g, b_gam = _gam_slice(g, i_k, m_sw, A_log, dt_bias, lower_bound, i_hv, HV, K,
                                                              BT, BK, GATE, HAS_A, HAS_BIAS)
                b_k = tl.load(k + (o_r[:, None]) * (H * K) + o_k[None, :], mask=m_wk, other=0.0).to(tl.float32)
                b_w = dot(b_tm, b_beta[:, None] * b_k * exp(b_gam, FAST_EXP), BF16_DOTS, DOT_PREC, INTERPRET)
                tl.store(w + p_tk, as_stored(b_w, w, INTERPRET).to(w.dtype.element_ty), mask=m_wk)
            for i_v in range(tl.cdiv(V, BV)):
                o_v = i_v * BV + tl.arange(0, BV)
                m_tv = m_t[:, None] & (o_v < V)[None, :]
                p_v = (o_r[:, None]) * (HV * V) + o_v[None, :]
                b_v = tl.load(v + p_v, mask=m_tv, other=0.0).to(tl.float32)
                b_u = dot(b_tm, b_beta[:, None] * b_v, BF16_DOTS, DOT_PREC, INTERPRET)
                tl.store(u + p_v, as_stored(b_u, u, INTERPRET).to(u.dtype.element_ty), mask=m_tv)
    elif not STORE_TM:  # (STORE_TM: stored in pass 1)
        # steep: the whole gam of the chunk for the steep launch and intra_wu_fwd's ONLY_STEEP launch
        for i_s in range(tl.cdiv(K, BKA)):
            o_k, m_k, m_tk, p_tk, b_g, b_gam = _gam_slice(g, i_s, m_t, A_log, dt_bias, lower_bound, i_hv, HV, K, BT,
                                                          BKA, GATE, HAS_A, HAS_BIAS)
            tl.store(gam + p_tk, b_gam, mask=m_tk)
