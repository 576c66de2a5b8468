"""The KDA operators: ``torch.ops.kda_op.chunk_kda_fwd``, ``chunk_kda_bwd`` and
``fused_recurrent_kda_fwd``; and ``chunk_kda_fwd_export``, the CUDA forward as a
triton_op for torch.export / AOTInductor.

One op, several kernels: the CPU kernel is the einsum reference
(``kda_op.reference``); the CUDA kernels are the chunked Triton kernels of
``kda_op.triton_kernels``, registered on the same ops. Fake kernels live
in ``kda_op.meta``; autograd is registered here so that differentiation goes
through ``chunk_kda_bwd`` and nothing else. The ops trust their inputs: the public
functions in ``kda_op.api`` validate them first.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._contract import chunked_kernels_serve
from .reference import kda_backward_reference, kda_forward_reference

NAMESPACE = "kda_op"


def _reference_fwd(q, k, v, g, beta, scale, initial_state):
    """chunk_kda_fwd on the einsum reference, which keeps no intermediates."""
    o, final_state, chunk_states = kda_forward_reference(q, k, v, g, beta, scale, initial_state)
    return o, final_state, chunk_states, q.new_empty((0,), dtype=torch.uint8)


@torch.library.custom_op(f"{NAMESPACE}::chunk_kda_fwd", mutates_args=(), device_types="cpu")
def chunk_kda_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float],
    initial_state: Optional[Tensor],
    keep_intermediates: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """KDA forward. Returns ``(o [B,T,HV,V], final_state [B,HV,K,V],
    chunk_states [B,NC+1,HV,K,V], intermediates [N] uint8)``; ``chunk_states``
    holds the state at every boundary of the NC chunks of ``CHUNK_SIZE`` tokens
    (the final state last) and exists for the backward. With
    ``keep_intermediates`` the chunked CUDA kernels also keep their intra-chunk
    quantities in ``intermediates`` (layout: ``kda_op._contract.
    intermediates_layout``) so that the backward need not recompute them; it is
    empty otherwise, and always on the reference (CPU, fp64)."""
    return _reference_fwd(q, k, v, g, beta, scale, initial_state)


@torch.library.custom_op(f"{NAMESPACE}::chunk_kda_bwd", mutates_args=(), device_types="cpu")
def chunk_kda_bwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float],
    initial_state: Optional[Tensor],
    chunk_states: Tensor,
    do: Tensor,
    dht: Optional[Tensor],
    intermediates: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """KDA backward from the grads of o (``do``) and of the final state (``dht``,
    ``None`` for zero). Returns ``(dq, dk, dv, dg, dbeta, dh0)``; dq and dk are
    already reduced from the HV value heads to the H key heads. ``intermediates``:
    what ``chunk_kda_fwd`` kept (the CUDA kernels then skip their recompute);
    ``None`` or empty to recompute."""
    return kda_backward_reference(q, k, v, g, beta, scale, initial_state, chunk_states, do, dht)


def _save_for_input_grads(ctx, q, k, v, g, beta, scale, initial_state, chunk_states, *kept) -> None:
    """What _input_grads needs, saved by a forward op's setup_context."""
    ctx.scale = scale
    ctx.has_initial_state = initial_state is not None
    # Unused outputs get no grad (None) rather than zeros: materialising them would
    # fill a tensor the size of the kept intermediates (0.12 ms a step measured at
    # B1-T8192-H16) and of the chunk states, only to ignore it.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, g, beta, initial_state, chunk_states, *kept)


def _setup_context(ctx, inputs, output) -> None:
    _, _, chunk_states, intermediates = output
    ctx.mark_non_differentiable(chunk_states, intermediates)
    _save_for_input_grads(ctx, *inputs[:7], chunk_states, intermediates)


def _input_grads(ctx, do: Optional[Tensor], dht: Optional[Tensor], intermediates: Optional[Tensor]):
    """The grads of (q, k, v, g, beta, scale, initial_state) through chunk_kda_bwd,
    from what setup_context saved (inputs first, chunk_states after them)."""
    q, k, v, g, beta, initial_state, chunk_states = ctx.saved_tensors[:7]
    if do is None:  # only the final state was used
        do = torch.zeros_like(v)  # o has v's shape and dtype
    dq, dk, dv, dg, dbeta, dh0 = torch.ops.kda_op.chunk_kda_bwd(
        q, k, v, g, beta, ctx.scale, initial_state, chunk_states, do, dht, intermediates
    )
    return dq, dk, dv, dg, dbeta, None, (dh0 if ctx.has_initial_state else None)


def _backward(ctx, do: Optional[Tensor], dht: Optional[Tensor], _dchunk_states, _dintermediates):
    return *_input_grads(ctx, do, dht, ctx.saved_tensors[7]), None


chunk_kda_fwd.register_autograd(_backward, setup_context=_setup_context)


# CUDA: the chunked Triton kernels (kda_op/triton_kernels), imported on first use
# so that importing kda_op needs no triton. fp64 inputs, which the Triton kernels
# (fp32 state) do not serve, run the einsum reference on the GPU: exact, slow.
@chunk_kda_fwd.register_kernel("cuda")
def _chunk_kda_fwd_cuda(q, k, v, g, beta, scale, initial_state, keep_intermediates=False):
    if not chunked_kernels_serve(q.device.type, q.dtype):
        return _reference_fwd(q, k, v, g, beta, scale, initial_state)
    from .triton_kernels import kda_fwd_triton

    return kda_fwd_triton(q, k, v, g, beta, scale, initial_state, keep_intermediates)


@chunk_kda_bwd.register_kernel("cuda")
def _chunk_kda_bwd_cuda(q, k, v, g, beta, scale, initial_state, chunk_states, do, dht, intermediates=None):
    if not chunked_kernels_serve(q.device.type, q.dtype):
        return kda_backward_reference(q, k, v, g, beta, scale, initial_state, chunk_states, do, dht)
    from .triton_kernels import kda_bwd_triton

    return kda_bwd_triton(q, k, v, g, beta, scale, initial_state, chunk_states, do, dht, intermediates)


# For deployment: the CUDA forward as a triton_op, whose body (host code and
# Triton launches) torch.export records as one op node and AOTInductor traces into,
# compiling the kernels into the package, so that a process loading the package
# need not import kda_op. chunk_kda calls it on CUDA while torch.export traces
# (torch.compiler.is_exporting()); everywhere else the ops above serve.
@torch.library.triton_op(f"{NAMESPACE}::chunk_kda_fwd_export", mutates_args=())
def chunk_kda_fwd_export(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float],
    initial_state: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor]:
    """KDA forward on the chunked Triton kernels (CUDA, fp32/bf16/fp16 inputs, T >= 1):
    ``(o, final_state, chunk_states)`` as ``chunk_kda_fwd`` without the kept
    intermediates; host code that tracing can follow (see
    ``kda_op.triton_kernels.fwd.kda_fwd_triton_export``)."""
    from .triton_kernels.fwd import kda_fwd_triton_export

    return kda_fwd_triton_export(q, k, v, g, beta, scale, initial_state)


def _export_setup_context(ctx, inputs, output) -> None:
    ctx.mark_non_differentiable(output[2])
    _save_for_input_grads(ctx, *inputs, output[2])


def _export_backward(ctx, do: Optional[Tensor], dht: Optional[Tensor], _dchunk_states):
    # An exported training graph: nothing kept, the backward recomputes the intra-chunk stage.
    return _input_grads(ctx, do, dht, None)


chunk_kda_fwd_export.register_autograd(_export_backward, setup_context=_export_setup_context)


@torch.library.custom_op(f"{NAMESPACE}::fused_recurrent_kda_fwd", mutates_args=(), device_types="cpu")
def fused_recurrent_kda_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float],
    initial_state: Optional[Tensor],
) -> tuple[Tensor, Tensor]:
    """KDA forward token by token, for decoding: ``(o [B,T,HV,V], final_state
    [B,HV,K,V])``. Saves no chunk states; its backward recomputes them."""
    o, final_state, _ = kda_forward_reference(q, k, v, g, beta, scale, initial_state)
    return o, final_state


@fused_recurrent_kda_fwd.register_kernel("cuda")
def _fused_recurrent_kda_fwd_cuda(q, k, v, g, beta, scale, initial_state):
    if q.dtype == torch.float64:
        o, final_state, _ = kda_forward_reference(q, k, v, g, beta, scale, initial_state)
        return o, final_state
    from .triton_kernels import kda_recurrent_fwd_triton

    return kda_recurrent_fwd_triton(q, k, v, g, beta, scale, initial_state)


def _recurrent_setup_context(ctx, inputs, output) -> None:
    q, k, v, g, beta, scale, initial_state = inputs
    ctx.scale = scale
    ctx.has_initial_state = initial_state is not None
    ctx.save_for_backward(q, k, v, g, beta, initial_state)


def _recurrent_backward(ctx, do: Tensor, dht: Tensor):
    # Decoding rarely needs grads: rather than make every decode step write chunk
    # states, the backward recomputes them with the chunked forward.
    q, k, v, g, beta, initial_state = ctx.saved_tensors
    _, _, chunk_states, intermediates = torch.ops.kda_op.chunk_kda_fwd(
        q, k, v, g, beta, ctx.scale, initial_state, True
    )
    dq, dk, dv, dg, dbeta, dh0 = torch.ops.kda_op.chunk_kda_bwd(
        q, k, v, g, beta, ctx.scale, initial_state, chunk_states, do, dht, intermediates
    )
    return dq, dk, dv, dg, dbeta, None, (dh0 if ctx.has_initial_state else None)


fused_recurrent_kda_fwd.register_autograd(_recurrent_backward, setup_context=_recurrent_setup_context)
