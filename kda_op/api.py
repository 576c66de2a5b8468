"""Public functions of kda-op, with flash-linear-attention's call convention."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import ops as _ops  # noqa: F401  (defines the ops and their autograd)
from . import meta as _meta  # noqa: F401  (registers the fake kernels; needs the ops)
from ._checks import check_bool, check_kda_inputs
from ._contract import chunked_kernels_serve


def chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    recompute_in_backward: bool = False,
) -> tuple[Tensor, Optional[Tensor]]:
    """Kimi Delta Attention: a gated delta rule with a per-channel decay.

    Per batch element and value head, with a state ``S`` of shape ``[K, V]``::

        S_dec = exp(g_t)[:, None] * S_{t-1}
        S_t   = S_dec + (beta_t * k_t) (outer) (v_t - k_t^T S_dec)
        o_t   = (scale * q_t)^T S_t

    Args:
        q: queries ``[B, T, H, K]``.
        k: keys ``[B, T, H, K]`` (usually l2-normalised), same dtype as ``q``.
        v: values ``[B, T, HV, V]`` with ``HV = G * H``; value head ``j`` reads
            query/key head ``j // G``. Same dtype as ``q``.
        g: log decay ``[B, T, HV, K]`` (natural log, usually <= 0).
        beta: write strength ``[B, T, HV]``.
        scale: multiplies ``q``; ``None`` means ``K ** -0.5``.
        initial_state: ``[B, HV, K, V]`` state before the first token, or ``None``
            for zeros.
        output_final_state: whether to return the state after the last token.
        recompute_in_backward: on CUDA, when a backward will follow, the forward
            keeps its intra-chunk quantities for it (about 3 KB per token and
            value head at K = V = 128 with bf16 inputs, until the backward runs);
            ``True`` keeps none and the backward recomputes them: less memory,
            a slower backward. No effect without grad or on the CPU reference.

    Returns:
        ``(o, final_state)``: ``o`` is ``[B, T, HV, V]`` in the dtype of ``v``;
        ``final_state`` is ``[B, HV, K, V]`` in fp32 (fp64 for fp64 inputs), or
        ``None`` when ``output_final_state`` is False.

    Inputs may be float16, bfloat16, float32 or float64; the state is kept in
    fp32 (fp64 for fp64 inputs). The function is differentiable in q, k, v, g,
    beta and initial_state through ``torch.ops.kda_op.chunk_kda_bwd``; it traces
    under ``torch.compile(fullgraph=True)`` and ``torch.export``. No input is
    modified. On CUDA, sequences of at most 16 tokens run the token-by-token
    kernel of :func:`fused_recurrent_kda` (one launch) and longer ones the chunked
    kernels; under ``torch.export`` on CUDA the op is
    ``kda_op::chunk_kda_fwd_export``, whose kernels AOTInductor compiles into its
    packages (needs T >= 1).

    Raises:
        TypeError: a non-tensor argument, an integer/bool dtype, or q/k/v dtypes
            that differ.
        ValueError: wrong ranks or shapes, HV not a multiple of H, K or V of 0,
            or tensors on different devices.
    """
    check_kda_inputs(q, k, v, g, beta, scale, initial_state, output_final_state)
    check_bool("recompute_in_backward", recompute_in_backward)
    if torch.compiler.is_exporting() and chunked_kernels_serve(q.device.type, q.dtype):
        # torch.export on CUDA: the forward whose kernels AOTInductor can compile
        # into a package (kda_op.ops.chunk_kda_fwd_export).
        o, final_state, _ = torch.ops.kda_op.chunk_kda_fwd_export(
            q, k, v, g, beta, None if scale is None else float(scale), initial_state
        )
        return o, (final_state if output_final_state else None)
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state)
    )
    o, final_state, _, _ = torch.ops.kda_op.chunk_kda_fwd(
        q, k, v, g, beta, None if scale is None else float(scale), initial_state,
        needs_grad and not recompute_in_backward,
    )
    return o, (final_state if output_final_state else None)


def fused_recurrent_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
) -> tuple[Tensor, Optional[Tensor]]:
    """Kimi Delta Attention token by token: the decoding path.

    Same arguments, results and checks as :func:`chunk_kda` (fla's
    ``fused_recurrent_kda`` convention). On CUDA a Triton kernel holds each
    state tile on chip for the whole sequence and writes no chunk states, which
    suits single-token steps and short sequences; for long sequences use
    ``chunk_kda``. Runs through ``torch.ops.kda_op.fused_recurrent_kda_fwd``;
    differentiable (its backward recomputes the chunk states and reuses
    ``chunk_kda_bwd``), and traceable by ``torch.compile(fullgraph=True)``,
    ``torch.export`` and CUDA graph capture.
    """
    check_kda_inputs(q, k, v, g, beta, scale, initial_state, output_final_state)
    o, final_state = torch.ops.kda_op.fused_recurrent_kda_fwd(
        q, k, v, g, beta, None if scale is None else float(scale), initial_state
    )
    return o, (final_state if output_final_state else None)
