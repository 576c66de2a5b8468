"""Index helpers shared by the kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sequence_and_heads(i_bh, T, H, HV):
    """From a program's (batch * value head) index (64-bit): the batch index, the
    value head, the query/key head it reads (GVA: i_hv // G) and the row where
    its sequence starts (a variable-length batch would read it from cu_seqlens)."""
    i_b = i_bh // HV
    i_hv = i_bh % HV
    i_h = i_hv // (HV // H)
    return i_b, i_hv, i_h, i_b * T
