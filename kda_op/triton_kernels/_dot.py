"""Dots shared by the kernels (TF32-family or, optionally, bf16 operands), and
bf16 rounding as the GPU does it, for the interpreter."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _round_to_bf16_as_fp32(x):
    """fp32 ``x`` rounded to the nearest bf16 (ties to even), kept in fp32: what
    the GPU's conversion gives (finite inputs). The interpreter's own fp32 -> bf16
    cast truncates instead, which would overstate the rounding error."""
    bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def dot_bf16(a, b, INTERPRET: tl.constexpr):
    """``a @ b`` with both operands rounded to bf16, accumulated in fp32. Triton's
    interpreter multiplies the raw bit patterns of bf16 operands
    (triton-lang/triton#11584, unsupported there), so under it (``INTERPRET``) the
    operands are rounded in fp32 and multiplied in IEEE fp32: the same products,
    so CPU CI checks where the rounding happens and what it costs."""
    if INTERPRET:
        return tl.dot(_round_to_bf16_as_fp32(a), _round_to_bf16_as_fp32(b), input_precision="ieee")
    else:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))


@triton.jit
def dot(a, b, BF16_DOTS: tl.constexpr, DOT_PREC: tl.constexpr, INTERPRET: tl.constexpr):
    """``a @ b`` accumulated in fp32: with bf16 operands where ``BF16_DOTS``
    (``dot_bf16``), else on fp32 operands at ``DOT_PREC``."""
    if BF16_DOTS:
        return dot_bf16(a, b, INTERPRET)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=DOT_PREC)


@triton.jit
def as_stored(x, ptr, INTERPRET: tl.constexpr):
    """``x`` ready to store through ``ptr``: unchanged on the GPU, whose conversion
    to bf16 rounds to nearest; under the interpreter (``INTERPRET``), whose own
    cast truncates, rounded to nearest first where ``ptr`` holds bf16, so that CPU
    runs see the GPU's rounding of bf16 intermediates and outputs."""
    if INTERPRET:
        if ptr.dtype.element_ty == tl.bfloat16:
            x = _round_to_bf16_as_fp32(x)
    return x
