"""Context parallelism: one long sequence split over the ranks of a process group.

Over a slice of the sequence the state map is affine (DESIGN.md section 6):
``S_out = M S_in + S_local``, with ``M`` [K, K] per (batch, value head) and
``S_local`` the slice's final state from a zero state. Each rank computes its
slice's ``(M, S_local)`` with the existing ops (``S_local``: the forward from
zero; ``M``: the forward with ``v = 0`` from the identity, since with ``v = 0`` the
recurrence is linear in the state), the ranks exchange them with an all-gather
(``torch.distributed._functional_collectives``, differentiable and traceable by
``torch.compile``), each rank composes the maps of the ranks before it onto the
initial state to get its slice's true initial state, and runs its slice from
there. Gradients flow back through the same ops and the all-gather's backward
(a reduce-scatter) to the earlier ranks.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .api import chunk_kda


def init_from_torchrun(device: str) -> torch.device:
    """The process group of a torchrun launch (NCCL and this rank's GPU for a CUDA
    ``device``, else gloo) and the device this rank computes on."""
    if device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
        return torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("gloo")
    return torch.device("cpu")


def _all_gather(x: Tensor, group) -> Tensor:
    """``[world, *x.shape]``: every rank's ``x``, differentiable (the backward sums
    each rank's gradient of the gathered tensor and hands every rank its part)."""
    from torch.distributed._functional_collectives import wait_tensor

    from ._compat import all_gather_autograd

    return wait_tensor(all_gather_autograd()(x.unsqueeze(0).contiguous(), 0, group))


def chunk_kda_cp(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    group: Optional[dist.ProcessGroup] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    scale: Optional[float] = None,
    **kwargs: Any,
) -> tuple[Tensor, Optional[Tensor]]:
    """:func:`kda_op.chunk_kda` over a sequence split across the ranks of ``group``
    (default: the world).

    Each rank passes its contiguous slice ``[B, T_rank, ...]`` of the sequence (rank
    order = sequence order; slices of any lengths, 0 included; the same B, heads
    and head dims everywhere) and gets its slice of ``o``; with
    ``output_final_state`` every rank also gets the state after the whole
    sequence. ``initial_state`` ([B, HV, K, V], the state before the whole
    sequence) must be the same on every rank; as for any replicated input, its
    gradient is split over the ranks (their sum is the single-device gradient).
    The final state is replicated likewise: a loss on it counts once per rank, so
    take it on one rank (or scale it by 1 / world size). Every other gradient
    equals the single-device one for the rank's slice. All ranks must call the
    function (and the backward) together, as with any collective: the backward
    runs one collective per call on every rank, whatever each rank's loss uses. The
    other keywords are chunk_kda's (the in-kernel gate, l2norm, beta sigmoid...);
    not yet: ``cu_seqlens`` (packed sequences across ranks) and ``state_v_first``.

    Cost: three forwards of the slice (from zero for ``S_local``, with ``v = 0``
    from the identity for ``M``, and from the true initial state for ``o``) and
    one all-gather of ``B * HV * K * (K + V)`` values per rank.
    """
    for name in ("cu_seqlens", "cu_seqlens_cpu", "state_v_first", "cp_context"):
        value = kwargs.get(name)
        if value is not None and value is not False:
            raise NotImplementedError(f"chunk_kda_cp(): {name!r} is not implemented yet")
    group = group if group is not None else dist.group.WORLD
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    # the slice's affine map S_out = M S_in + S_local
    _, s_local = chunk_kda(q, k, v, g, beta, scale=scale, output_final_state=True, **kwargs)
    eye = torch.eye(K, dtype=s_local.dtype, device=q.device).expand(B, HV, K, K)
    _, m = chunk_kda(q, k, v.new_zeros(B, T, HV, K), g, beta, scale=scale, initial_state=eye,
                     output_final_state=True, **kwargs)
    maps = _all_gather(torch.cat([m, s_local], dim=-1), group)  # [world, B, HV, K, K + V]
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    state = (torch.zeros(B, HV, K, V, dtype=s_local.dtype, device=q.device) if initial_state is None
             else initial_state.to(s_local.dtype))
    s_in = state
    for r in range(world):
        if r == rank:
            s_in = state
        m_r, b_r = maps[r][..., :K], maps[r][..., K:]
        state = m_r @ state + b_r
    # Every rank's loss must reach the all-gather, or its backward (a collective)
    # would run on some ranks only: rank 0's slice needs no map, and the final
    # state may go unused. A zero term ties it in, the same on every rank.
    s_in = s_in + 0.0 * maps.sum()
    o, _ = chunk_kda(q, k, v, g, beta, scale=scale, initial_state=s_in, output_final_state=False, **kwargs)
    return o, (state if output_final_state else None)
