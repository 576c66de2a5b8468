"""fla's in-kernel gate (``use_gate_in_kernel``), elementwise on a tile of the
raw gate, shared by the kernels that read g (gam_fwd.py, recurrent_fwd.py) and
the one that writes dg (intra_bwd_a.py). GATE selects the form:

  0  none: g is the log decay as given
  1  -exp(A_log) * softplus(g + dt_bias)
  2  lower_bound * sigmoid(exp(A_log) * (g + dt_bias))   (HAS_A False: without exp(A_log))

A_log is [HV], dt_bias [HV * K] (HAS_BIAS False: none). The math is the CPU
reference's (``kda_op.reference.kda_gate_reference``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gate_params(A_log, dt_bias, i_hv, o_k, m_k, K: tl.constexpr, HAS_A: tl.constexpr, HAS_BIAS: tl.constexpr):
    """exp(A_log[i_hv]) (1 without A_log) and dt_bias[i_hv, o_k] (0 without), fp32."""
    if HAS_A:
        b_a = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    else:
        b_a = tl.full([], 1.0, tl.float32)
    if HAS_BIAS:
        b_bias = tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    else:
        b_bias = tl.zeros([o_k.shape[0]], dtype=tl.float32)
    return b_a, b_bias


@triton.jit
def _softplus(x):
    # torch's threshold: x above 20 returns x
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def gate_fwd(b_g, b_a, b_bias, lower_bound, GATE: tl.constexpr):
    """The log decay from the raw gate tile ``b_g`` [rows, BK] (fp32)."""
    x = b_g + b_bias[None, :]
    if GATE == 2:
        return lower_bound * tl.sigmoid(b_a * x)
    else:
        return -b_a * _softplus(x)


@triton.jit
def gate_bwd(b_dy, b_g, b_a, b_bias, lower_bound, GATE: tl.constexpr):
    """From d(log decay) ``b_dy`` and the raw gate ``b_g`` (tiles [rows, BK],
    fp32): ``(d raw gate, d A_log per element)``; summed over rows and columns by
    the caller for dA_log, over rows for d dt_bias."""
    x = b_g + b_bias[None, :]
    if GATE == 2:
        z = b_a * x
        s = tl.sigmoid(z)
        dz = b_dy * lower_bound * s * (1.0 - s)
        return dz * b_a, dz * z
    else:
        return -b_dy * b_a * tl.sigmoid(x), -b_dy * b_a * _softplus(x)
