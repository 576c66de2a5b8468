"""Stage 3 (forward): the output, parallel over chunks.

O = (Q * exp(gam)) S0 + A_qk U', one program per (chunk, batch * value head, V block).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._dot import as_stored, dot
from ._indexing import chunk_coords, chunk_in_sequence


@triton.jit
def kda_output_fwd_kernel(
    qg, aqk, up, u, chunk_states,
    o,
    cu_seqlens, chunk_index,  # varlen (IS_VARLEN): _indexing.py
    T, NC,
    H, HV,  # runtime: one compiled kernel serves every head count
    slots,  # POOL: each sequence's pool slot; a negative one (padding) outputs zeros
    K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BF16_DOTS: tl.constexpr = False, INTERPRET: tl.constexpr = False,
    IS_VARLEN: tl.constexpr = False, POOL: tl.constexpr = False, HAS_H0: tl.constexpr = True,
    FIRST_FROM_U: tl.constexpr = False,
):
    # FIRST_FROM_U (packed sequences without initial states): a sequence's first chunk
    # reads U, which is its U' (S0 = 0), where the scan did not write U' (state_fwd's
    # FIRST_UP = False).
    # BF16_DOTS (bf16 Qg only): S0, A_qk and U' enter the dots rounded to bf16 (fp32
    # accumulation), the precision of the bf16 output they make.
    # The V block varies fastest over the grid: the blocks of one chunk run side by
    # side and share their loads of Qg and A_qk through L2.
    i_v = tl.program_id(0)
    i_c = tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    i_b, i_hv, i_h, bos, T, g_c, s_c = chunk_coords(i_c, i_bh, T, NC, H, HV, cu_seqlens, chunk_index, BT, IS_VARLEN)
    if IS_VARLEN:
        if T <= 0:  # an unused chunk slot (past the last sequence's chunks): nothing to compute
            return
    # Each pointer moves to this chunk and head once, in 64-bit (bos: the chunk's
    # first row); offsets inside the chunk are 32-bit at any T.
    qg += (bos * HV + i_hv) * K
    aqk += (bos * HV + i_hv) * BT
    up += (bos * HV + i_hv) * V
    u += (bos * HV + i_hv) * V
    o += (bos * HV + i_hv) * V
    chunk_states += (s_c * HV + i_hv) * K * V

    o_t = tl.arange(0, BT)
    m_t = o_t < T
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_r = tl.arange(0, BT)

    b_a = tl.load(aqk + (o_t[:, None]) * (HV * BT) + o_r[None, :],
                  mask=m_t[:, None] & (o_r[:, None] >= o_r[None, :]), other=0.0)
    row_v = (o_t[:, None]) * (HV * V) + o_v[None, :]
    later = chunk_in_sequence(i_c, chunk_index, IS_VARLEN) > 0
    tl.static_assert(not (FIRST_FROM_U and HAS_H0), "U is U' only where S0 = 0")
    if FIRST_FROM_U:
        if later:
            b_up = tl.load(up + row_v, mask=m_t[:, None] & m_v[None, :], other=0.0)
        else:
            b_up = tl.load(u + row_v, mask=m_t[:, None] & m_v[None, :], other=0.0)
    else:
        b_up = tl.load(up + row_v, mask=m_t[:, None] & m_v[None, :], other=0.0)
    b_o = dot(b_a, b_up, BF16_DOTS, DOT_PREC, INTERPRET)
    # Qg S0, but for a sequence's first chunk without an initial state (S0 = 0: not read)
    if later | HAS_H0:
        b_qg = tl.load(qg + (o_t[:, None]) * (HV * K) + o_k[None, :],
                       mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_s0 = tl.load(chunk_states + o_k[:, None] * V + o_v[None, :],
                       mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_o += dot(b_qg, b_s0, BF16_DOTS, DOT_PREC, INTERPRET)
    if POOL:
        b_o = tl.where(tl.load(slots + i_b) >= 0, b_o, 0.0)
    tl.store(o + row_v, as_stored(b_o, o, INTERPRET).to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
