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

    from ._compat import all_gather_autograd, contiguous_grad

    return contiguous_grad(wait_tensor(all_gather_autograd()(x.unsqueeze(0).contiguous(), 0, group)))


def _all_gather_plain(x: Tensor, group) -> Tensor:
    """``[world, *x.shape]`` without autograd (sizes, indices)."""
    from torch.distributed._functional_collectives import wait_tensor

    from ._compat import all_gather_plain

    return wait_tensor(all_gather_plain()(x.unsqueeze(0).contiguous(), 0, group))


def packed_slice(T: int, cu_seqlens: Tensor, group, device: torch.device) -> dict:
    """Where this rank's T tokens lie in a packed batch cut over the ranks of
    ``group`` (in rank order), from an all-gather of the slice lengths (no host sync):
    ``lengths`` and ``ends`` [world] of every rank's slice, this rank's
    ``start`` (0-d), ``local_cu`` [N + 1] (the global offsets clamped to this slice:
    sequence n's part here, empty where it misses the slice) and ``first_seq`` (0-d:
    the sequence holding this slice's first token; N - 1 or past it for an empty
    slice at the end)."""
    world = dist.get_world_size(group)
    cu = cu_seqlens.to(torch.int64)
    lengths = _all_gather_plain(torch.full((1,), T, dtype=torch.int64, device=device), group).reshape(world)
    ends = lengths.cumsum(0)
    rank = dist.get_rank(group)
    start = ends[rank] - lengths[rank]
    first_seq = torch.searchsorted(cu, start.reshape(1), right=True).reshape(()) - 1
    return dict(cu=cu, lengths=lengths, ends=ends, start=start, local_cu=(cu - start).clamp(0, T),
                first_seq=first_seq)


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
    cu_seqlens: Optional[Tensor] = None,
    state_v_first: bool = False,
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
    other keywords are chunk_kda's (the in-kernel gate, l2norm, beta sigmoid,
    ``state_v_first``...).

    Packed sequences across the ranks: ``cu_seqlens`` [N + 1] are the offsets of N
    sequences in the whole packed batch (B = 1; the same tensor on every rank, on
    each rank's device), which the ranks' slices cut anywhere (a sequence may span
    several ranks, a slice may hold many sequences); ``initial_state`` and the final
    states are then [N, HV, K, V], one per sequence. The ranks first all-gather their
    slice lengths (a few bytes) to place their slice in the batch: no host sync.

    Cost: three forwards of the slice (from zero for ``S_local``, with ``v = 0``
    from the identity for ``M``, and from the true initial state for ``o``) and
    one all-gather of ``B * HV * K * (K + V)`` values per rank (with ``cu_seqlens``:
    the map of the rank's last sequence only, ``HV * K * (K + V)``; each rank's calls
    carry all N sequences, those outside its slice empty, and the final states are
    all-gathered, ``N * HV * K * V`` values per rank, when asked for).
    """
    if kwargs.get("cp_context") is not None:
        raise NotImplementedError("chunk_kda_cp(): fla's 'cp_context' is not implemented: the ranks' slices and "
                                  "cu_seqlens say all this function needs")
    cu_seqlens_cpu = kwargs.pop("cu_seqlens_cpu", None)
    group = group if group is not None else dist.group.WORLD
    if state_v_first:  # the maps compose K-first states: transpose in and out
        initial_state = None if initial_state is None else initial_state.transpose(-1, -2)
        o, ht = chunk_kda_cp(q, k, v, g, beta, group=group, initial_state=initial_state,
                             output_final_state=output_final_state, scale=scale, cu_seqlens=cu_seqlens,
                             cu_seqlens_cpu=cu_seqlens_cpu, **kwargs)
        return o, (None if ht is None else ht.transpose(-1, -2))
    if cu_seqlens is not None:
        return _chunk_kda_cp_varlen(q, k, v, g, beta, group, initial_state, output_final_state, scale, cu_seqlens,
                                    cu_seqlens_cpu, kwargs)
    if cu_seqlens_cpu is not None:
        raise ValueError("chunk_kda_cp(): cu_seqlens_cpu is given without cu_seqlens")
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


def _check_cp_cu_seqlens(cu_seqlens: object, cu_seqlens_cpu: object, q: Tensor,
                         initial_state: Optional[Tensor]) -> Optional[list]:
    """chunk_kda's varlen rules that one rank can check: 1-D integer tensors
    (``cu_seqlens`` on q's device, ``cu_seqlens_cpu`` the same on the CPU), B = 1, one
    initial state per sequence; the values (start at 0, never decrease) where that
    costs no sync (a CPU tensor, not under tracing): returned then, else None."""
    for name, x in (("cu_seqlens", cu_seqlens), ("cu_seqlens_cpu", cu_seqlens_cpu)):
        if x is None:
            continue
        if not isinstance(x, Tensor):
            raise TypeError(f"chunk_kda_cp(): {name} must be a 1-D integer torch.Tensor [N + 1], got "
                            f"{type(x).__name__}")
        if x.dtype not in (torch.int64, torch.int32) or x.dim() != 1 or x.shape[0] < 2:
            raise ValueError(f"chunk_kda_cp(): {name} must be a 1-D int64 (or int32) tensor [N + 1], N >= 1, got "
                             f"{x.dtype} of shape {tuple(x.shape)}")
    if cu_seqlens_cpu is not None and (cu_seqlens_cpu.device.type != "cpu"
                                       or cu_seqlens_cpu.shape != cu_seqlens.shape):
        raise ValueError(f"chunk_kda_cp(): cu_seqlens_cpu must be cu_seqlens {tuple(cu_seqlens.shape)} on the CPU, "
                         f"got {tuple(cu_seqlens_cpu.shape)} on {cu_seqlens_cpu.device}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"chunk_kda_cp(): cu_seqlens must be on q's device {q.device}, got {cu_seqlens.device}")
    if q.shape[0] != 1:
        raise ValueError(f"chunk_kda_cp(): with cu_seqlens the sequences are packed along T: B must be 1, got q "
                         f"of shape {tuple(q.shape)}")
    N = cu_seqlens.shape[0] - 1
    if initial_state is not None and initial_state.shape[0] != N:
        raise ValueError(f"chunk_kda_cp(): initial_state must hold one state per sequence of cu_seqlens: N = {N}, "
                         f"got shape {tuple(initial_state.shape)}")
    values = cu_seqlens if cu_seqlens.device.type == "cpu" else cu_seqlens_cpu
    if values is None or torch.compiler.is_compiling():
        return None
    offsets = values.tolist()
    if offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"chunk_kda_cp(): cu_seqlens must start at 0 and never decrease, got "
                         f"{offsets if len(offsets) <= 16 else offsets[:8] + ['...'] + offsets[-4:]}")
    return offsets


def _chunk_kda_cp_varlen(q, k, v, g, beta, group, initial_state, output_final_state, scale, cu_seqlens,
                         cu_seqlens_cpu, kwargs):
    """chunk_kda_cp with packed sequences (DESIGN.md section 6 per sequence).

    Rank r holds tokens [start_r, start_r + T_r) of the batch. Its calls take the
    global offsets clamped to its slice (sequence n's part here, empty where it
    misses the slice). Only two of its sequences meet another rank: the first one
    here (n_first, the one holding the slice's first token) may have begun on an
    earlier rank, and the last one (n_last) may go on. So each rank all-gathers the
    affine map of its n_last part, and rank r starts n_first from its initial state
    carried through the maps of every earlier rank whose n_last is that sequence (a
    sequence can span several ranks). The final state of a sequence is the one
    computed on the rank holding its last token (of an empty sequence, its initial
    state, on rank 0)."""
    offsets = _check_cp_cu_seqlens(cu_seqlens, cu_seqlens_cpu, q, initial_state)
    N = cu_seqlens.shape[0] - 1
    _, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    rank = dist.get_rank(group)
    place = packed_slice(T, cu_seqlens, group, q.device)
    cu, lengths, ends, start, local_cu, first_seq = (
        place[n] for n in ("cu", "lengths", "ends", "start", "local_cu", "first_seq"))
    if offsets is not None and lengths.device.type == "cpu":  # gloo: the lengths are on the host already
        total = int(ends[-1])
        if offsets[-1] != total:
            raise ValueError(f"chunk_kda_cp(): cu_seqlens must end at the ranks' tokens in all, {total}, got "
                             f"{offsets[-1]}")
    # the sequence holding each rank's last token (-1 for an empty slice): the one whose map goes on
    last_seq = torch.searchsorted(cu, ends - 1, right=True) - 1
    last_seq = torch.where(lengths > 0, last_seq, torch.full_like(last_seq, -1))

    _, s_local = chunk_kda(q, k, v, g, beta, scale=scale, output_final_state=True, cu_seqlens=local_cu, **kwargs)
    eye = torch.eye(K, dtype=s_local.dtype, device=q.device).expand(N, HV, K, K)
    _, m = chunk_kda(q, k, v.new_zeros(1, T, HV, K), g, beta, scale=scale, initial_state=eye,
                     output_final_state=True, cu_seqlens=local_cu, **kwargs)
    pick = last_seq[rank].clamp(min=0)  # an empty slice sends its (identity, zero) pass-through maps
    mine = torch.cat([m, s_local], dim=-1).index_select(0, pick.reshape(1)).squeeze(0)
    maps = _all_gather(mine, group)  # [world, HV, K, K + V]

    base = (torch.zeros(N, HV, K, V, dtype=s_local.dtype, device=q.device) if initial_state is None
            else initial_state.to(s_local.dtype))
    # n_first's state at this slice's start (an empty slice: index clamped, unused)
    state = base.index_select(0, first_seq.clamp(0, N - 1).reshape(1)).squeeze(0)
    for r in range(rank):
        m_r, b_r = maps[r][..., :K], maps[r][..., K:]
        state = torch.where(last_seq[r] == first_seq, m_r @ state + b_r, state)
    is_first = (torch.arange(N, device=q.device) == first_seq).reshape(N, 1, 1, 1)
    s_in = torch.where(is_first, state.unsqueeze(0), base)
    # every rank's loss reaches the all-gather (see chunk_kda_cp)
    s_in = s_in + 0.0 * maps.sum()
    o, ht = chunk_kda(q, k, v, g, beta, scale=scale, initial_state=s_in, output_final_state=output_final_state,
                      cu_seqlens=local_cu, **kwargs)
    if not output_final_state:
        return o, None
    last_token = cu[1:] - 1
    owned = (last_token >= start) & (last_token < start + T) & (cu[1:] > cu[:-1])
    if rank == 0:
        owned = owned | (cu[1:] == cu[:-1])  # an empty sequence: its initial state, passed through here
    finals = _all_gather(torch.where(owned.reshape(N, 1, 1, 1), ht, torch.zeros_like(ht)), group).sum(0)
    # as above, for this second all-gather: every rank's loss on o reaches it
    return o + 0.0 * finals.sum(), finals
