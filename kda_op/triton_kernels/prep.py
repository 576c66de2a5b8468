"""fla's in-kernel input options that act on q, k and beta, one pass each way:
q and k scaled to unit l2 norm per row (``use_qk_l2norm_in_kernel``), beta
through ``scale * sigmoid`` (``use_beta_sigmoid_in_kernel``, scale 2 with
``allow_neg_eigval``).

One program per BR rows of q and k (a row: one token and key head, K wide) and
the G * BR entries of beta that belong to the same tokens and heads (beta is
[B, T, HV] with HV = G * H, so key-head row r owns beta entries r*G .. r*G+G-1).
The l2 norm's backward reads what the forward wrote (y and rstd; the chunk op
keeps y anyway), beta's the raw beta (a tiny tensor; exact where the rounded
output would not be):
  dx     = rstd * (dy - y * <dy, y>)
  dbeta  = d(out) * scale * s * (1 - s),   s = sigmoid(beta)
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _l2norm_rows(x, y, rstd, p, m, o_r, m_r, eps):
    b_x = tl.load(x + p, mask=m, other=0.0).to(tl.float32)
    b_rstd = 1.0 / tl.sqrt(tl.sum(b_x * b_x, 1) + eps)
    tl.store(y + p, (b_x * b_rstd[:, None]).to(y.dtype.element_ty), mask=m)
    tl.store(rstd + o_r, b_rstd, mask=m_r)


@triton.jit
def _l2norm_rows_bwd(y, rstd, dy, dx, p, m, o_r, m_r):
    b_y = tl.load(y + p, mask=m, other=0.0).to(tl.float32)
    b_dy = tl.load(dy + p, mask=m, other=0.0).to(tl.float32)
    b_rstd = tl.load(rstd + o_r, mask=m_r, other=0.0)
    b_dx = b_rstd[:, None] * (b_dy - b_y * tl.sum(b_dy * b_y, 1)[:, None])
    tl.store(dx + p, b_dx.to(dx.dtype.element_ty), mask=m)


@triton.jit
def _rows(i_r, R, K: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):
    """Program i_r's rows of q and k: their indices, mask, offsets and mask of the tile."""
    o_r = i_r * BR + tl.arange(0, BR)
    m_r = o_r < R
    o_k = tl.arange(0, BK)
    return o_r, m_r, o_r[:, None] * K + o_k[None, :], m_r[:, None] & (o_k < K)[None, :]


@triton.jit
def _beta_block(i_r, R, G: tl.constexpr, BR: tl.constexpr, BB: tl.constexpr):
    """The beta entries of program i_r's rows: offsets and mask (BB: BR * G rounded
    up to a power of two, G need not be one)."""
    o_b = i_r * BR * G + tl.arange(0, BB)
    return o_b, (o_b < (i_r + 1) * BR * G) & (o_b < R * G)


@triton.jit
def kda_prep_fwd_kernel(
    q, k, beta, q_out, k_out, beta_out, q_rstd, k_rstd,
    R, eps, beta_scale,
    K: tl.constexpr, G: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, BB: tl.constexpr,
    L2NORM: tl.constexpr, SIGMOID: tl.constexpr,
):
    i_r = tl.program_id(0).to(tl.int64)
    if L2NORM:
        o_r, m_r, p, m = _rows(i_r, R, K, BK, BR)
        _l2norm_rows(q, q_out, q_rstd, p, m, o_r, m_r, eps)
        _l2norm_rows(k, k_out, k_rstd, p, m, o_r, m_r, eps)
    if SIGMOID:
        o_b, m_b = _beta_block(i_r, R, G, BR, BB)
        b_beta = tl.load(beta + o_b, mask=m_b, other=0.0).to(tl.float32)
        tl.store(beta_out + o_b, (beta_scale * tl.sigmoid(b_beta)).to(beta_out.dtype.element_ty), mask=m_b)


@triton.jit
def kda_prep_bwd_kernel(
    q_out, k_out, q_rstd, k_rstd, beta, dq_out, dk_out, dbeta_out, dq, dk, dbeta,
    R, beta_scale,
    K: tl.constexpr, G: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, BB: tl.constexpr,
    L2NORM: tl.constexpr, SIGMOID: tl.constexpr,
):
    i_r = tl.program_id(0).to(tl.int64)
    if L2NORM:
        o_r, m_r, p, m = _rows(i_r, R, K, BK, BR)
        _l2norm_rows_bwd(q_out, q_rstd, dq_out, dq, p, m, o_r, m_r)
        _l2norm_rows_bwd(k_out, k_rstd, dk_out, dk, p, m, o_r, m_r)
    if SIGMOID:
        o_b, m_b = _beta_block(i_r, R, G, BR, BB)
        b_s = tl.sigmoid(tl.load(beta + o_b, mask=m_b, other=0.0).to(tl.float32))
        b_dout = tl.load(dbeta_out + o_b, mask=m_b, other=0.0).to(tl.float32)
        tl.store(dbeta + o_b, (b_dout * beta_scale * b_s * (1.0 - b_s)).to(dbeta.dtype.element_ty), mask=m_b)
