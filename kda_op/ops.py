"""The KDA operators: ``torch.ops.kda_op.chunk_kda_fwd``, ``chunk_kda_bwd`` and
``fused_recurrent_kda_fwd``; ``fused_recurrent_kda_pool_`` and ``chunk_kda_pool_``,
decoding and prefill on a state pool in place (serving); ``chunk_kda_fwd_export``, the CUDA forward as a
triton_op for torch.export / AOTInductor; and ``kda_prep_fwd`` / ``kda_prep_bwd``,
fla's q/k l2 norm and beta sigmoid in one pass each way.

fla's in-kernel gate (``use_gate_in_kernel``) is part of the KDA ops themselves:
with ``use_gate`` their ``g`` is the raw gate, ``A_log`` [HV] / ``dt_bias``
[HV * K] its parameters (either may be None where fla allows it) and
``lower_bound`` selects the sigmoid form (``kda_op.reference.kda_gate_reference``);
the CUDA kernels form the log decay on the way into the chunk cumsum and take dg
back through it where they write it, so the activated gate is never stored.

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
from .reference import (
    beta_sigmoid_backward_reference,
    beta_sigmoid_reference,
    kda_backward_reference,
    kda_backward_reference_varlen,
    kda_forward_reference,
    kda_forward_reference_varlen,
    kda_gate_backward_reference,
    kda_gate_reference,
    kda_pool_reference,
    l2norm_backward_reference,
    l2norm_reference,
)

NAMESPACE = "kda_op"


def _gate(A_log: Optional[Tensor], dt_bias: Optional[Tensor], use_gate: bool, lower_bound: Optional[float]):
    """The kernels' form of the gate options: None, or ``(A_log, dt_bias, lower_bound)``."""
    return (A_log, dt_bias, lower_bound) if use_gate else None


def _reference_fwd(q, k, v, g, beta, scale, initial_state, gate=None, cu_seqlens=None):
    """chunk_kda_fwd on the einsum reference, which keeps no intermediates."""
    if gate is not None:
        g = kda_gate_reference(g, *gate)
    if cu_seqlens is None:
        o, final_state, chunk_states = kda_forward_reference(q, k, v, g, beta, scale, initial_state)
    else:
        o, final_state, chunk_states = kda_forward_reference_varlen(q, k, v, g, beta, scale, initial_state,
                                                                    cu_seqlens)
    return o, final_state, chunk_states, q.new_empty((0,), dtype=torch.uint8)


def _reference_bwd(q, k, v, g, beta, scale, initial_state, chunk_states, do, dht, gate=None, cu_seqlens=None):
    """chunk_kda_bwd on the einsum reference: the BPTT backward, then (with the
    gate) back through the gate."""
    def empty():  # a fresh one each time: op outputs must not alias each other
        return q.new_empty((0,), dtype=torch.float32)

    def bptt(g_in):
        if cu_seqlens is None:
            return kda_backward_reference(q, k, v, g_in, beta, scale, initial_state, chunk_states, do, dht)
        return kda_backward_reference_varlen(q, k, v, g_in, beta, scale, initial_state, chunk_states, do, dht,
                                             cu_seqlens)

    if gate is None:
        return (*bptt(g), empty(), empty())
    g_act = kda_gate_reference(g, *gate)
    dq, dk, dv, dg_act, dbeta, dh0 = bptt(g_act)
    dg, dA_log, ddt_bias = kda_gate_backward_reference(g, *gate, dg_act)
    return (dq, dk, dv, dg, dbeta, dh0, empty() if dA_log is None else dA_log,
            empty() if ddt_bias is None else ddt_bias)


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
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    use_gate: bool = False,
    lower_bound: Optional[float] = None,
    cu_seqlens: Optional[Tensor] = None,
    output_final_state: bool = True,
    keep_chunk_states: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """KDA forward. Returns ``(o [B,T,HV,V], final_state [B,HV,K,V],
    chunk_states [B,NC+1,HV,K,V], intermediates [N] uint8)``; ``chunk_states``
    holds the state at every boundary of the NC chunks of ``CHUNK_SIZE`` tokens
    (the final state last) and exists for the backward. With
    ``keep_intermediates`` the chunked CUDA kernels also keep their intra-chunk
    quantities in ``intermediates`` (layout: ``kda_op._contract.
    intermediates_layout``) so that the backward need not recompute them; it is
    empty otherwise, and always on the reference (CPU, fp64). ``use_gate``: ``g``
    is fla's raw gate (module docstring). ``cu_seqlens`` [N + 1]: N sequences
    packed along T (B = 1); the states are then [N, HV, K, V] and the chunk states
    [1, T // 64 + 2 N, HV, K, V], or without an initial state [1, T // 64 + 2, HV,
    K, V] (``kda_op._contract.varlen_state_slots``).
    ``output_final_state=False``: ``final_state`` is empty ([0]) and never formed
    (training: at 2048 packed sequences of 16 heads it is 2 GiB of fp32 written
    for nothing); its grad is then none.
    ``keep_chunk_states=False`` (a forward without grad: inference, prefill):
    ``chunk_states`` is empty ([0]); the CUDA kernels then need not store them
    (settings.FUSED_OUTPUT: the scan writes the output itself), and no backward can
    follow (setup_context refuses where an input requires grad)."""
    return _outputs_as_asked(
        _reference_fwd(q, k, v, g, beta, scale, initial_state, _gate(A_log, dt_bias, use_gate, lower_bound),
                       cu_seqlens), output_final_state, keep_chunk_states)


def _outputs_as_asked(outputs: tuple, output_final_state: bool, keep_chunk_states: bool = True) -> tuple:
    """The forward op's outputs with the final state and the chunk states empty
    unless asked for."""
    o, final_state, chunk_states, *rest = outputs
    if not output_final_state:
        final_state = final_state.new_empty(0)
    if not keep_chunk_states:
        chunk_states = chunk_states.new_empty(0)
    return (o, final_state, chunk_states, *rest)


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
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    use_gate: bool = False,
    lower_bound: Optional[float] = None,
    cu_seqlens: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """KDA backward from the grads of o (``do``) and of the final state (``dht``,
    ``None`` for zero). Returns ``(dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias)``;
    dq and dk are already reduced from the HV value heads to the H key heads;
    dh0 is empty ([0]) without an initial state; dA_log and ddt_bias are empty unless ``use_gate`` and the parameter is given
    (dg is then the raw gate's grad). ``intermediates``: what ``chunk_kda_fwd``
    kept (the CUDA kernels then skip their recompute); ``None`` or empty to
    recompute."""
    return _reference_bwd(q, k, v, g, beta, scale, initial_state, chunk_states, do, dht,
                          _gate(A_log, dt_bias, use_gate, lower_bound), cu_seqlens)


def _save_for_input_grads(ctx, q, k, v, g, beta, scale, initial_state, A_log, dt_bias, use_gate, lower_bound,
                          cu_seqlens, chunk_states, *kept) -> None:
    """What _input_grads needs, saved by a forward op's setup_context."""
    ctx.scale = scale
    ctx.has_initial_state = initial_state is not None
    ctx.use_gate = use_gate
    ctx.lower_bound = lower_bound
    # Unused outputs get no grad (None) rather than zeros: materialising them would
    # fill a tensor the size of the kept intermediates (0.12 ms a step measured at
    # B1-T8192-H16) and of the chunk states, only to ignore it.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, chunk_states, *kept)


def _setup_context(ctx, inputs, output) -> None:
    _, _, chunk_states, intermediates = output
    ctx.mark_non_differentiable(chunk_states, intermediates)
    (q, k, v, g, beta, scale, initial_state, _keep, A_log, dt_bias, use_gate, lower_bound, cu_seqlens, with_ht,
     keep_chunk_states) = inputs
    if not keep_chunk_states:
        raise ValueError("chunk_kda_fwd: keep_chunk_states=False keeps nothing for a backward, but an input "
                         "requires grad; pass keep_chunk_states=True (the default) where grads are wanted")
    ctx.output_final_state = with_ht  # else the (empty) final state's grad, if any, is not a dht
    _save_for_input_grads(ctx, q, k, v, g, beta, scale, initial_state, A_log, dt_bias, use_gate, lower_bound,
                          cu_seqlens, chunk_states, intermediates)


def _input_grads(ctx, do: Optional[Tensor], dht: Optional[Tensor], intermediates: Optional[Tensor],
                 chunk_states: Optional[Tensor] = None):
    """The grads of (q, k, v, g, beta, initial_state, A_log, dt_bias) through
    chunk_kda_bwd, from what setup_context saved (None for an input that had
    none). ``chunk_states``: in place of the saved ones (the recurrent op's
    backward, which recomputes them)."""
    q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, saved_states = ctx.saved_tensors[:10]
    if do is None:  # only the final state was used
        do = torch.zeros_like(v)  # o has v's shape and dtype
    dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias = torch.ops.kda_op.chunk_kda_bwd(
        q, k, v, g, beta, ctx.scale, initial_state, saved_states if chunk_states is None else chunk_states,
        do, dht, intermediates, A_log, dt_bias, ctx.use_gate, ctx.lower_bound, cu_seqlens,
    )
    return (dq, dk, dv, dg, dbeta, (dh0 if ctx.has_initial_state else None),
            dA_log if ctx.use_gate and A_log is not None else None,
            ddt_bias if ctx.use_gate and dt_bias is not None else None)


def _backward(ctx, do: Optional[Tensor], dht: Optional[Tensor], _dchunk_states, _dintermediates):
    dht = dht if ctx.output_final_state else None
    dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias = _input_grads(ctx, do, dht, ctx.saved_tensors[10])
    # one grad per input: q, k, v, g, beta, scale, initial_state, keep_intermediates,
    # A_log, dt_bias, use_gate, lower_bound, cu_seqlens, output_final_state, keep_chunk_states
    return dq, dk, dv, dg, dbeta, None, dh0, None, dA_log, ddt_bias, None, None, None, None, None


chunk_kda_fwd.register_autograd(_backward, setup_context=_setup_context)


# CUDA: the chunked Triton kernels (kda_op/triton_kernels), imported on first use
# so that importing kda_op needs no triton. fp64 inputs, which the Triton kernels
# (fp32 state) do not serve, run the einsum reference on the GPU: exact, slow.
@chunk_kda_fwd.register_kernel("cuda")
def _chunk_kda_fwd_cuda(q, k, v, g, beta, scale, initial_state, keep_intermediates=False, A_log=None,
                        dt_bias=None, use_gate=False, lower_bound=None, cu_seqlens=None, output_final_state=True,
                        keep_chunk_states=True):
    gate = _gate(A_log, dt_bias, use_gate, lower_bound)
    if not chunked_kernels_serve(q.device.type, q.dtype):
        return _outputs_as_asked(_reference_fwd(q, k, v, g, beta, scale, initial_state, gate, cu_seqlens),
                                 output_final_state, keep_chunk_states)
    from .triton_kernels import kda_fwd_triton

    return kda_fwd_triton(q, k, v, g, beta, scale, initial_state, keep_intermediates, gate=gate,
                          cu_seqlens=cu_seqlens, output_final_state=output_final_state,
                          keep_chunk_states=keep_chunk_states)


@chunk_kda_bwd.register_kernel("cuda")
def _chunk_kda_bwd_cuda(q, k, v, g, beta, scale, initial_state, chunk_states, do, dht, intermediates=None,
                        A_log=None, dt_bias=None, use_gate=False, lower_bound=None, cu_seqlens=None):
    gate = _gate(A_log, dt_bias, use_gate, lower_bound)
    if not chunked_kernels_serve(q.device.type, q.dtype):
        return _reference_bwd(q, k, v, g, beta, scale, initial_state, chunk_states, do, dht, gate, cu_seqlens)
    from .triton_kernels import kda_bwd_triton

    return kda_bwd_triton(q, k, v, g, beta, scale, initial_state, chunk_states, do, dht, intermediates, gate=gate,
                          cu_seqlens=cu_seqlens)


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
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    use_gate: bool = False,
    lower_bound: Optional[float] = None,
    cu_seqlens: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """KDA forward on the chunked Triton kernels (CUDA, fp32/bf16/fp16 inputs, T >= 1):
    ``(o, final_state, chunk_states)`` as ``chunk_kda_fwd`` without the kept
    intermediates; host code that tracing can follow (see
    ``kda_op.triton_kernels.fwd.kda_fwd_triton_export``)."""
    from .triton_kernels.fwd import kda_fwd_triton_export

    return kda_fwd_triton_export(q, k, v, g, beta, scale, initial_state,
                                 gate=_gate(A_log, dt_bias, use_gate, lower_bound), cu_seqlens=cu_seqlens)


def _export_setup_context(ctx, inputs, output) -> None:
    ctx.mark_non_differentiable(output[2])
    _save_for_input_grads(ctx, *inputs, output[2])


def _export_backward(ctx, do: Optional[Tensor], dht: Optional[Tensor], _dchunk_states):
    # An exported training graph: nothing kept, the backward recomputes the intra-chunk stage.
    dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias = _input_grads(ctx, do, dht, None)
    return dq, dk, dv, dg, dbeta, None, dh0, dA_log, ddt_bias, None, None, None


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
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    use_gate: bool = False,
    lower_bound: Optional[float] = None,
    cu_seqlens: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """KDA forward token by token, for decoding: ``(o [B,T,HV,V], final_state
    [B,HV,K,V])``. Saves no chunk states; its backward recomputes them.
    ``use_gate``: ``g`` is fla's raw gate (module docstring); ``cu_seqlens`` as
    in ``chunk_kda_fwd``."""
    o, final_state, _, _ = _reference_fwd(q, k, v, g, beta, scale, initial_state,
                                          _gate(A_log, dt_bias, use_gate, lower_bound), cu_seqlens)
    return o, final_state


@fused_recurrent_kda_fwd.register_kernel("cuda")
def _fused_recurrent_kda_fwd_cuda(q, k, v, g, beta, scale, initial_state, A_log=None, dt_bias=None,
                                  use_gate=False, lower_bound=None, cu_seqlens=None):
    gate = _gate(A_log, dt_bias, use_gate, lower_bound)
    if q.dtype == torch.float64:
        o, final_state, _, _ = _reference_fwd(q, k, v, g, beta, scale, initial_state, gate, cu_seqlens)
        return o, final_state
    from .triton_kernels import kda_recurrent_fwd_triton

    return kda_recurrent_fwd_triton(q, k, v, g, beta, scale, initial_state, gate=gate, cu_seqlens=cu_seqlens)


def _recurrent_setup_context(ctx, inputs, output) -> None:
    q, k, v, g, beta, scale, initial_state, A_log, dt_bias, use_gate, lower_bound, cu_seqlens = inputs
    _save_for_input_grads(ctx, q, k, v, g, beta, scale, initial_state, A_log, dt_bias, use_gate, lower_bound,
                          cu_seqlens, None)
    ctx.set_materialize_grads(True)  # its backward reads do and dht whole


def _recurrent_backward(ctx, do: Tensor, dht: Tensor):
    # Decoding rarely needs grads: rather than make every decode step write chunk
    # states, the backward recomputes them with the chunked forward.
    q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens = ctx.saved_tensors[:9]
    _, _, chunk_states, intermediates = torch.ops.kda_op.chunk_kda_fwd(
        q, k, v, g, beta, ctx.scale, initial_state, True, A_log, dt_bias, ctx.use_gate, ctx.lower_bound, cu_seqlens,
        False,
    )
    dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias = _input_grads(ctx, do, dht, intermediates, chunk_states)
    return dq, dk, dv, dg, dbeta, None, dh0, dA_log, ddt_bias, None, None, None


fused_recurrent_kda_fwd.register_autograd(_recurrent_backward, setup_context=_recurrent_setup_context)


# Serving: decoding on a state pool [num_slots, HV, K, V] (or V-first), read and
# written in place through slot indices, as serving engines keep states (fla's
# fused_recurrent_kda_fwd with ssm_state_indices). The pool is declared mutated,
# so functionalisation (torch.compile), torch.export and CUDA graphs see the write.
# Inference only: no autograd (the public function refuses inputs that need grad).
@torch.library.custom_op(f"{NAMESPACE}::fused_recurrent_kda_pool_", mutates_args=("pool",), device_types="cpu")
def fused_recurrent_kda_pool_(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float],
    pool: Tensor,
    ssm_state_indices: Tensor,
    num_accepted_tokens: Optional[Tensor] = None,
    state_v_first: bool = False,
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    use_gate: bool = False,
    lower_bound: Optional[float] = None,
    cu_seqlens: Optional[Tensor] = None,
) -> Tensor:
    """KDA token by token on states in ``pool``, updated in place: returns ``o``
    ``[B, T, HV, V]``. Slot semantics: ``kda_op.reference.kda_pool_reference``
    (a negative slot: a padding sequence, zero output, nothing read or written);
    slots not written are untouched."""
    return _pool_reference_(q, k, v, g, beta, scale, pool, ssm_state_indices, num_accepted_tokens, state_v_first,
                            _gate(A_log, dt_bias, use_gate, lower_bound), cu_seqlens)


def _pool_reference_(q, k, v, g, beta, scale, pool, ssm_state_indices, num_accepted_tokens, state_v_first, gate,
                     cu_seqlens):
    """fused_recurrent_kda_pool_ on the reference: o, and the pool written in place."""
    if gate is not None:
        g = kda_gate_reference(g, *gate)
    o, new_pool = kda_pool_reference(q, k, v, g, beta, scale, pool, ssm_state_indices, num_accepted_tokens,
                                     cu_seqlens, state_v_first)
    pool.copy_(new_pool)
    return o


@fused_recurrent_kda_pool_.register_kernel("cuda")
def _fused_recurrent_kda_pool_cuda(q, k, v, g, beta, scale, pool, ssm_state_indices, num_accepted_tokens=None,
                                   state_v_first=False, A_log=None, dt_bias=None, use_gate=False, lower_bound=None,
                                   cu_seqlens=None):
    gate = _gate(A_log, dt_bias, use_gate, lower_bound)
    if q.dtype == torch.float64:
        return _pool_reference_(q, k, v, g, beta, scale, pool, ssm_state_indices, num_accepted_tokens, state_v_first,
                                gate, cu_seqlens)
    from .triton_kernels import kda_recurrent_pool_triton

    return kda_recurrent_pool_triton(q, k, v, g, beta, scale, pool, ssm_state_indices, num_accepted_tokens,
                                     state_v_first, gate=gate, cu_seqlens=cu_seqlens)


# Serving, prefill: the chunked forward on the same pool, 1-D slots (a sequence's
# initial state read from its slot and its final state written back, in place).
@torch.library.custom_op(f"{NAMESPACE}::chunk_kda_pool_", mutates_args=("pool",), device_types="cpu")
def chunk_kda_pool_(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float],
    pool: Tensor,
    ssm_state_indices: Tensor,
    state_v_first: bool = False,
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    use_gate: bool = False,
    lower_bound: Optional[float] = None,
    cu_seqlens: Optional[Tensor] = None,
) -> Tensor:
    """The chunked KDA forward on states in ``pool``, updated in place: returns
    ``o``; ``ssm_state_indices`` [N] as in ``fused_recurrent_kda_pool_`` (the same
    results up to the chunked form's rounding)."""
    return _pool_reference_(q, k, v, g, beta, scale, pool, ssm_state_indices, None, state_v_first,
                            _gate(A_log, dt_bias, use_gate, lower_bound), cu_seqlens)


@chunk_kda_pool_.register_kernel("cuda")
def _chunk_kda_pool_cuda(q, k, v, g, beta, scale, pool, ssm_state_indices, state_v_first=False, A_log=None,
                         dt_bias=None, use_gate=False, lower_bound=None, cu_seqlens=None):
    gate = _gate(A_log, dt_bias, use_gate, lower_bound)
    if not chunked_kernels_serve(q.device.type, q.dtype):
        return _pool_reference_(q, k, v, g, beta, scale, pool, ssm_state_indices, None, state_v_first, gate,
                                cu_seqlens)
    from .triton_kernels import kda_chunk_pool_triton

    return kda_chunk_pool_triton(q, k, v, g, beta, scale, pool, ssm_state_indices, state_v_first, gate=gate,
                                 cu_seqlens=cu_seqlens)


# fla's q/k l2 norm (use_qk_l2norm_in_kernel) and beta sigmoid
# (use_beta_sigmoid_in_kernel, allow_neg_eigval): one op each way, in front of the
# KDA ops. On CUDA one Triton launch each way (triton_kernels/prep.py), on CPU the
# reference.
@torch.library.custom_op(f"{NAMESPACE}::kda_prep_fwd", mutates_args=(), device_types="cpu")
def kda_prep_fwd(
    q: Tensor, k: Tensor, beta: Tensor, qk_l2norm: bool, beta_scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(q_out, k_out, beta_out, q_rstd, k_rstd)``: with ``qk_l2norm`` q and k
    with rows of unit l2 norm (in their dtype) and the reciprocal norms [B, T, H]
    (fp32; fp64 for fp64 inputs), else four empty tensors; with ``beta_scale`` > 0
    ``beta_scale * sigmoid(beta)`` in beta's dtype, else empty."""
    return _reference_prep_fwd(q, k, beta, qk_l2norm, beta_scale)


def _reference_prep_fwd(q, k, beta, qk_l2norm, beta_scale):
    def empty():  # a fresh one each time: op outputs must not alias each other
        return q.new_empty((0,))

    if qk_l2norm:
        q_out, q_rstd = l2norm_reference(q)
        k_out, k_rstd = l2norm_reference(k)
    else:
        q_out, k_out, q_rstd, k_rstd = empty(), empty(), empty(), empty()
    beta_out = beta_sigmoid_reference(beta, beta_scale) if beta_scale > 0 else empty()
    return q_out, k_out, beta_out, q_rstd, k_rstd


@torch.library.custom_op(f"{NAMESPACE}::kda_prep_bwd", mutates_args=(), device_types="cpu")
def kda_prep_bwd(
    q_out: Tensor, k_out: Tensor, q_rstd: Tensor, k_rstd: Tensor, beta: Tensor,
    dq_out: Optional[Tensor], dk_out: Optional[Tensor], dbeta_out: Optional[Tensor],
    qk_l2norm: bool, beta_scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dbeta)`` of ``kda_prep_fwd`` from its outputs, the raw ``beta``
    and the outputs' grads (None for zero); a part that was off returns empty."""
    return _reference_prep_bwd(q_out, k_out, q_rstd, k_rstd, beta, dq_out, dk_out, dbeta_out, qk_l2norm,
                               beta_scale)


def _reference_prep_bwd(q_out, k_out, q_rstd, k_rstd, beta, dq_out, dk_out, dbeta_out, qk_l2norm, beta_scale):
    dq, dk, dbeta = (q_out.new_empty((0,)) for _ in range(3))  # fresh: outputs must not alias
    if qk_l2norm:
        dq = l2norm_backward_reference(q_out, q_rstd, torch.zeros_like(q_out) if dq_out is None else dq_out)
        dk = l2norm_backward_reference(k_out, k_rstd, torch.zeros_like(k_out) if dk_out is None else dk_out)
    if beta_scale > 0:
        dbeta = beta_sigmoid_backward_reference(beta, torch.zeros_like(beta) if dbeta_out is None else dbeta_out,
                                                beta_scale)
    return dq, dk, dbeta


@kda_prep_fwd.register_kernel("cuda")
def _kda_prep_fwd_cuda(q, k, beta, qk_l2norm, beta_scale):
    if q.dtype == torch.float64 or beta.dtype == torch.float64:
        return _reference_prep_fwd(q, k, beta, qk_l2norm, beta_scale)
    from .triton_kernels.fwd import kda_prep_fwd_triton

    return kda_prep_fwd_triton(q, k, beta, qk_l2norm, beta_scale)


@kda_prep_bwd.register_kernel("cuda")
def _kda_prep_bwd_cuda(q_out, k_out, q_rstd, k_rstd, beta, dq_out, dk_out, dbeta_out, qk_l2norm, beta_scale):
    if q_out.dtype == torch.float64 or beta.dtype == torch.float64:
        return _reference_prep_bwd(q_out, k_out, q_rstd, k_rstd, beta, dq_out, dk_out, dbeta_out, qk_l2norm,
                                   beta_scale)
    from .triton_kernels.bwd import kda_prep_bwd_triton

    return kda_prep_bwd_triton(q_out, k_out, q_rstd, k_rstd, beta, dq_out, dk_out, dbeta_out, qk_l2norm,
                               beta_scale)


def _prep_setup_context(ctx, inputs, output) -> None:
    _, _, beta, qk_l2norm, beta_scale = inputs
    q_out, k_out, _, q_rstd, k_rstd = output
    ctx.qk_l2norm, ctx.beta_scale = qk_l2norm, beta_scale
    ctx.mark_non_differentiable(q_rstd, k_rstd)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q_out, k_out, q_rstd, k_rstd, beta)


def _prep_backward(ctx, dq_out, dk_out, dbeta_out, _dq_rstd, _dk_rstd):
    q_out, k_out, q_rstd, k_rstd, beta = ctx.saved_tensors
    dq, dk, dbeta = torch.ops.kda_op.kda_prep_bwd(q_out, k_out, q_rstd, k_rstd, beta, dq_out, dk_out, dbeta_out,
                                                  ctx.qk_l2norm, ctx.beta_scale)
    return ((dq, dk) if ctx.qk_l2norm else (None, None)) + ((dbeta if ctx.beta_scale > 0 else None), None, None)


kda_prep_fwd.register_autograd(_prep_backward, setup_context=_prep_setup_context)
