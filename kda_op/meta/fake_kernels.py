"""Fake kernels registered on ``kda_op::chunk_kda_fwd``, ``kda_op::chunk_kda_bwd``
and ``kda_op::fused_recurrent_kda_fwd``.

Every real kernel returns fresh contiguous tensors, so these return
``new_empty`` tensors of the same shapes and dtypes.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._contract import chunk_states_dtype, intermediates_layout, num_chunk_boundaries, state_dtype


def _output_and_final_state(q: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """o [B, T, HV, V] in v's dtype and the final state [B, HV, K, V] in the state
    dtype: what both forward ops return first."""
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    return v.new_empty((B, T, HV, V)), q.new_empty((B, HV, K, V), dtype=state_dtype(q.dtype))


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
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    o, final_state = _output_and_final_state(q, v)
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    chunk_states = q.new_empty((B, num_chunk_boundaries(T), HV, K, V),
                               dtype=chunk_states_dtype(q.dtype, q.device.type))
    # The kept intermediates exist only where the chunked CUDA kernels serve.
    nbytes = intermediates_layout(B, T, HV, K, V, q.dtype, q.device.type)[1] if keep_intermediates else 0
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
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    B, _, HV, K = g.shape
    V = v.shape[3]
    # dq/dk come back GVA-reduced: [B, T, HV, K] summed over the G value heads
    # of each key head gives q's own shape [B, T, H, K].
    dq = q.new_empty(q.shape)
    dk = k.new_empty(k.shape)
    dv = v.new_empty(v.shape)
    dg = g.new_empty(g.shape)
    dbeta = beta.new_empty(beta.shape)
    dh0_dtype = state_dtype(q.dtype) if initial_state is None else initial_state.dtype
    dh0 = q.new_empty((B, HV, K, V), dtype=dh0_dtype)
    return dq, dk, dv, dg, dbeta, dh0


@torch.library.register_fake("kda_op::fused_recurrent_kda_fwd")
def fused_recurrent_kda_fwd_fake(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float],
    initial_state: Optional[Tensor],
) -> tuple[Tensor, Tensor]:
    return _output_and_final_state(q, v)
