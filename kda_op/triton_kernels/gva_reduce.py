"""Stage 3 of the backward: dq and dk from the value heads to the key heads.

The intra-chunk backward writes dq and dk per value head in fp32 ([B, T, HV, K],
q entering unscaled). Value head h * G + j reads key head h, so
  dq[b, t, h] = scale * sum_j dq_e[b, t, h * G + j],   dk alike without the scale,
cast to the input dtype: one pass over both, in a fixed order (deterministic).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def kda_gva_reduce_kernel(
    dq_e, dk_e, dq, dk,
    scale, R,  # R = B * T * H rows of K
    G: tl.constexpr, K: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
):
    i_r = tl.program_id(0)
    o_r = (i_r * BR + tl.arange(0, BR)).to(tl.int64)
    o_k = tl.arange(0, BK)
    m = (o_r < R)[:, None] & (o_k < K)[None, :]
    b_dq = tl.zeros([BR, BK], dtype=tl.float32)
    b_dk = tl.zeros([BR, BK], dtype=tl.float32)
    for j in tl.static_range(G):
        p = (o_r[:, None] * G + j) * K + o_k[None, :]
        b_dq += tl.load(dq_e + p, mask=m, other=0.0)
        b_dk += tl.load(dk_e + p, mask=m, other=0.0)
    p_out = o_r[:, None] * K + o_k[None, :]
    tl.store(dq + p_out, (b_dq * scale).to(dq.dtype.element_ty), mask=m)
    tl.store(dk + p_out, b_dk.to(dk.dtype.element_ty), mask=m)
