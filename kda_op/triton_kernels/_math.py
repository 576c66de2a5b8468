"""exp for the kernels: the GPU's 2^x unit without its subnormal fix-ups.

``tl.exp(x)`` lowers to ``ex2.approx.f32(x * log2 e)``, which ptxas expands to four
instructions (a range test, two scalings, MUFU.EX2) so that subnormal results come out
right; with ``.ftz`` it is MUFU.EX2 alone. The intra-chunk kernels take several exps
per element of each [rows, K] tile (gate differences against a reference row), and
there those fix-ups were a fifth of the loop's instructions (kda_intra_a_fwd_rows at
sm_90a, benchmarks/kernel_resources.py --sass). Flushing changes only results below
2^-126 (to zero, next to fp32 sums of order one) and inputs below 2^-126 in magnitude
(taken as zero: exp(0) = 1, as it would round to anyway). settings.FAST_EXP switches it;
the interpreter cannot run inline PTX, so there it is always tl.exp.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def exp(x, FAST: tl.constexpr):
    """e^x in fp32; ``FAST``: by ``ex2.approx.ftz.f32`` (CUDA only)."""
    if FAST:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x.to(tl.float32) * LOG2E],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.exp(x)
