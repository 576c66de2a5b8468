"""Fake kernels registered on ``kda_op::chunk_kda_fwd``, ``kda_op::chunk_kda_bwd``,
``kda_op::fused_recurrent_kda_fwd``, ``kda_op::fused_recurrent_kda_pool_``, ``kda_op::chunk_kda_pool_``,
``kda_op::kda_prep_fwd`` and ``kda_op::kda_prep_bwd``.

Every real kernel returns fresh contiguous tensors, so these return
``new_empty`` tensors of the same shapes and dtypes.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._contract import (chunk_states_dtype, intermediates_layout, num_chunk_boundaries, state_dtype,
                         varlen_state_slots)


def _num_states(q: Tensor, cu_seqlens: Optional[Tensor]):
    """How many states (initial, final): one per batch row, or per packed sequence."""
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _output_and_final_state(q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """o [B, T, HV, V] in v's dtype and the final state [N, HV, K, V] (N = B, or
    the packed sequences) in the state dtype: what both forward ops return first."""
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    return v.new_empty((B, T, HV, V)), q.new_empty((_num_states(q, cu_seqlens), HV, K, V),
                                                   dtype=state_dtype(q.dtype))


@torch.library.register_fake("kda_op::chunk_kda_fwd")
def chunk_kda_fwd_fake(
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
    o, final_state = _output_and_final_state(q, v, cu_seqlens)
    if not output_final_state:
        final_state = final_state.new_empty(0)
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if cu_seqlens is None:
        slots, num_seqs = num_chunk_boundaries(T), None
    else:
        num_seqs = cu_seqlens.shape[0] - 1
        slots = varlen_state_slots(T, num_seqs, initial_state is not None)
    chunk_states = q.new_empty((B, slots, HV, K, V) if keep_chunk_states else (0,),
                               dtype=chunk_states_dtype(q.dtype, q.device.type))
    # The kept intermediates exist only where the chunked CUDA kernels serve.
    nbytes = (intermediates_layout(B, T, HV, K, V, q.dtype, q.device.type, num_seqs)[1]
              if keep_intermediates else 0)
    intermediates = q.new_empty((nbytes,), dtype=torch.uint8)
    return o, final_state, chunk_states, intermediates


@torch.library.register_fake("kda_op::chunk_kda_bwd")
def chunk_kda_bwd_fake(
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
    _, _, HV, K = g.shape
    B = _num_states(q, cu_seqlens)
    V = v.shape[3]
    # dq/dk come back GVA-reduced: [B, T, HV, K] summed over the G value heads
    # of each key head gives q's own shape [B, T, H, K].
    dq = q.new_empty(q.shape)
    dk = k.new_empty(k.shape)
    dv = v.new_empty(v.shape)
    dg = g.new_empty(g.shape)
    dbeta = beta.new_empty(beta.shape)
    # no initial state: no grad of it (empty; fla returns None)
    if initial_state is None:
        dh0 = q.new_empty((0,), dtype=state_dtype(q.dtype))
    else:
        dh0 = q.new_empty((B, HV, K, V), dtype=initial_state.dtype)
    # the gate parameters' grads: empty unless the gate is on and the parameter given
    dA_log = A_log.new_empty(A_log.shape) if use_gate and A_log is not None else q.new_empty((0,), dtype=torch.float32)
    ddt_bias = (dt_bias.new_empty(dt_bias.shape) if use_gate and dt_bias is not None
                else q.new_empty((0,), dtype=torch.float32))
    return dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias


@torch.library.register_fake("kda_op::fused_recurrent_kda_fwd")
def fused_recurrent_kda_fwd_fake(
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
    return _output_and_final_state(q, v, cu_seqlens)


@torch.library.register_fake("kda_op::kda_prep_fwd")
def kda_prep_fwd_fake(
    q: Tensor, k: Tensor, beta: Tensor, qk_l2norm: bool, beta_scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    if qk_l2norm:
        rstd_dtype = state_dtype(q.dtype)
        q_out, k_out = q.new_empty(q.shape), k.new_empty(k.shape)
        q_rstd, k_rstd = q.new_empty(q.shape[:3], dtype=rstd_dtype), k.new_empty(k.shape[:3], dtype=rstd_dtype)
    else:
        q_out, k_out, q_rstd, k_rstd = (q.new_empty((0,)) for _ in range(4))
    beta_out = beta.new_empty(beta.shape) if beta_scale > 0 else q.new_empty((0,))
    return q_out, k_out, beta_out, q_rstd, k_rstd


@torch.library.register_fake("kda_op::kda_prep_bwd")
def kda_prep_bwd_fake(
    q_out: Tensor, k_out: Tensor, q_rstd: Tensor, k_rstd: Tensor, beta: Tensor,
    dq_out: Optional[Tensor], dk_out: Optional[Tensor], dbeta_out: Optional[Tensor],
    qk_l2norm: bool, beta_scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    if qk_l2norm:
        dq, dk = q_out.new_empty(q_out.shape), k_out.new_empty(k_out.shape)
    else:
        dq, dk = q_out.new_empty((0,)), q_out.new_empty((0,))
    dbeta = beta.new_empty(beta.shape) if beta_scale > 0 else q_out.new_empty((0,))
    return dq, dk, dbeta


@torch.library.register_fake("kda_op::fused_recurrent_kda_pool_")
def fused_recurrent_kda_pool_fake(
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
    # o only: the pool is written in place (declared in the schema)
    return v.new_empty(v.shape)


@torch.library.register_fake("kda_op::chunk_kda_pool_")
def chunk_kda_pool_fake(
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
    return v.new_empty(v.shape)
