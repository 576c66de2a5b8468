"""Host side of decoding: ``kda_recurrent_fwd_triton``, the token-by-token
forward (recurrent_fwd.py) as ``kda_op::fused_recurrent_kda_fwd`` takes and
returns it; the chunked forward (fwd.py) also routes short sequences to it.
Tuning settings (RECURRENT_*) are read from settings.py at every call.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import settings as S
from ._host import _cdiv, _check_grid, _check_offsets, _gate_args, _pow2
from .recurrent_fwd import kda_recurrent_fwd_kernel


def kda_recurrent_fwd_triton(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    scale: Optional[float], initial_state: Optional[Tensor],
    final_state_out: Optional[Tensor] = None, gate: Optional[tuple] = None, cu_seqlens: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """Token-by-token forward for decoding: ``(o, final_state)`` as
    ``fused_recurrent_kda_fwd``. ``final_state_out`` (internal, not reachable from
    the ops): a contiguous fp32 ``[B, HV, K, V]`` tensor to write the final state
    into, which may be ``initial_state`` itself (each program reads its state tile
    whole before it writes it back); the benchmark times the in-place update
    with it. ``gate``: None, or fla's in-kernel gate ``(A_log, dt_bias,
    lower_bound)`` with ``g`` the raw gate (``_host._gate_args``). ``cu_seqlens``:
    N sequences packed along T (B = 1), states [N, HV, K, V]."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    _check_offsets(T, HV, K, V)
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1  # sequences
    _check_grid(N, HV, None)
    scale = K**-0.5 if scale is None else float(scale)
    h0 = None if initial_state is None else initial_state.contiguous()
    o = torch.empty(B, T, HV, V, device=q.device, dtype=v.dtype)
    if final_state_out is None:
        ht = torch.empty(N, HV, K, V, device=q.device, dtype=torch.float32)
    else:
        if (final_state_out.shape != (N, HV, K, V) or final_state_out.dtype != torch.float32
                or not final_state_out.is_contiguous()):
            raise ValueError(f"final_state_out: expected a contiguous fp32 tensor of shape {(N, HV, K, V)}, "
                             f"got {final_state_out.dtype} {tuple(final_state_out.shape)}")
        ht = final_state_out
    if N * HV == 0:
        return o, ht
    BK = max(16, _pow2(K))
    # Small V blocks: more programs in flight to hide the state's memory traffic.
    BV = min(S.RECURRENT_BV, max(16, _pow2(V)))
    ga = _gate_args(gate, g)
    kda_recurrent_fwd_kernel[(_cdiv(V, BV), N * HV)](
        q, k, v, g, beta, h0 if h0 is not None else ht, o, ht, ga["A_log"], ga["dt_bias"], ga["lower_bound"],
        q if cu_seqlens is None else cu_seqlens.contiguous(), scale, T, H, HV, q, q, 1,
        K=K, V=V, BK=BK, BV=BV, HAS_H0=h0 is not None, STREAM_HINTS=bool(S.RECURRENT_STREAM_HINTS),
        INPUT_HINTS=bool(S.RECURRENT_INPUT_HINTS), GATE=ga["GATE"], HAS_A=ga["HAS_A"], HAS_BIAS=ga["HAS_BIAS"],
        IS_VARLEN=cu_seqlens is not None,
        num_warps=S.RECURRENT_WARPS, **({} if S.RECURRENT_MAXNREG is None else dict(maxnreg=S.RECURRENT_MAXNREG)),
    )
    return o, ht


def kda_recurrent_pool_triton(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float], pool: Tensor,
    ssm_state_indices: Tensor, num_accepted_tokens: Optional[Tensor] = None, state_v_first: bool = False,
    gate: Optional[tuple] = None, cu_seqlens: Optional[Tensor] = None,
) -> Tensor:
    """``kda_op::fused_recurrent_kda_pool_`` on the recurrent kernel: ``o``, with the
    states read from and written to ``pool`` (contiguous, fp32) in place, in one
    launch (recurrent_fwd.py, POOL)."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    _check_offsets(T, HV, K, V)
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    _check_grid(N, HV, None)
    scale = K**-0.5 if scale is None else float(scale)
    o = torch.empty(B, T, HV, V, device=q.device, dtype=v.dtype)
    if N * HV == 0:
        return o
    slots = ssm_state_indices.contiguous()
    BK = max(16, _pow2(K))
    BV = min(S.RECURRENT_BV, max(16, _pow2(V)))
    ga = _gate_args(gate, g)
    kda_recurrent_fwd_kernel[(_cdiv(V, BV), N * HV)](
        q, k, v, g, beta, pool, o, pool, ga["A_log"], ga["dt_bias"], ga["lower_bound"],
        q if cu_seqlens is None else cu_seqlens.contiguous(), scale, T, H, HV,
        slots, slots if num_accepted_tokens is None else num_accepted_tokens.contiguous(),
        slots.shape[1] if slots.dim() == 2 else 1,
        K=K, V=V, BK=BK, BV=BV, HAS_H0=True, STREAM_HINTS=bool(S.RECURRENT_STREAM_HINTS),
        INPUT_HINTS=bool(S.RECURRENT_INPUT_HINTS), GATE=ga["GATE"], HAS_A=ga["HAS_A"], HAS_BIAS=ga["HAS_BIAS"],
        IS_VARLEN=cu_seqlens is not None,
        POOL=True, SLOTS_2D=slots.dim() == 2, HAS_ACCEPTED=num_accepted_tokens is not None, V_FIRST=state_v_first,
        num_warps=S.RECURRENT_WARPS, **({} if S.RECURRENT_MAXNREG is None else dict(maxnreg=S.RECURRENT_MAXNREG)),
    )
    return o
