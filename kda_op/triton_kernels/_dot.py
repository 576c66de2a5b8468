"""A dot with bf16 operands shared by the kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot_bf16(a, b, INTERPRET: tl.constexpr):
    """``a @ b`` with both operands rounded to bf16, accumulated in fp32. Triton's
    interpreter multiplies the raw bit patterns of bf16 operands
    (triton-lang/triton#11584, unsupported there), so under it (``INTERPRET``) the
    rounded operands are widened back and multiplied in IEEE fp32: the same
    products, so CPU CI checks where the rounding happens."""
    if INTERPRET:
        return tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32),
                      input_precision="ieee")
    else:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
