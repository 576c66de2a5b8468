"""The einsum reference of KDA: the CPU kernel of the ops.

Forward: the recurrence of DESIGN.md section 1, one token at a time, saving the
state that enters every chunk of ``CHUNK_SIZE`` tokens.

Backward: reverse-time BPTT as in ``kda-backward-derivation.tex``. Chunks are
visited last to first; inside a chunk the per-token decayed states ``S_dec`` are
recomputed from the saved chunk state, so no ``[B, T, HV, K, V]`` tensor is ever
held: memory is O(T / C * K * V) per head for the saved states plus
O(C * K * V) for the chunk being differentiated.

Every function here works on any strides (einsum and indexing only) and returns
contiguous tensors, which is what the fake kernels promise.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.profiler import record_function

from ._contract import CHUNK_SIZE, num_chunk_boundaries, state_dtype, varlen_state_offsets, varlen_state_slots


def _expand_heads(x: Tensor, group: int, dtype: torch.dtype) -> Tensor:
    """[B, T, H, K] -> [B, T, H * group, K]: value head j reads key head j // group."""
    return x.to(dtype).repeat_interleave(group, dim=2)


def _prepare(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float]):
    """What both passes start from: the state dtype, the resolved scale, and the
    inputs in that dtype with q/k expanded to the HV value heads (q scaled) and
    g turned into the decay factors exp(g)."""
    K = q.shape[3]
    group = v.shape[2] // q.shape[2]
    acc = state_dtype(q.dtype)
    scale = K**-0.5 if scale is None else float(scale)
    qe = _expand_heads(q, group, acc) * scale
    ke = _expand_heads(k, group, acc)
    return acc, scale, qe, ke, v.to(acc), g.to(acc).exp(), beta.to(acc)


def kda_forward_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float],
    initial_state: Optional[Tensor],
    chunk_size: int = CHUNK_SIZE,
) -> tuple[Tensor, Tensor, Tensor]:
    """Run the KDA recurrence.

    Returns ``(o, final_state, chunk_states)``: ``o`` is ``[B, T, HV, V]`` in the
    dtype of ``v``; ``final_state`` is ``[B, HV, K, V]`` in the state dtype;
    ``chunk_states`` is ``[B, NC + 1, HV, K, V]``: the state entering each of the
    NC chunks, then the final state.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    acc, scale, qe, ke, ve, decay, b = _prepare(q, k, v, g, beta, scale)

    if initial_state is None:
        S = q.new_zeros((B, HV, K, V), dtype=acc)
    else:
        S = initial_state.to(acc).clone()

    o = q.new_empty((B, T, HV, V), dtype=acc)
    chunk_states = q.new_empty((B, num_chunk_boundaries(T, chunk_size), HV, K, V), dtype=acc)
    with record_function("kda_op::fwd::recurrence"):
        for t in range(T):
            if t % chunk_size == 0:
                chunk_states[:, t // chunk_size] = S
            S = decay[:, t, :, :, None] * S
            residual = ve[:, t] - torch.einsum("bhk,bhkv->bhv", ke[:, t], S)
            S = S + torch.einsum("bhk,bhv->bhkv", b[:, t, :, None] * ke[:, t], residual)
            o[:, t] = torch.einsum("bhk,bhkv->bhv", qe[:, t], S)
        chunk_states[:, -1] = S
    return o.to(v.dtype), S.contiguous(), chunk_states


def kda_backward_reference(
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
    chunk_size: int = CHUNK_SIZE,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of KDA given the grads of ``o`` (``do``) and of the final state
    (``dht``, ``None`` meaning zero).

    Returns ``(dq, dk, dv, dg, dbeta, dh0)``, each in the dtype of its input;
    ``dh0`` is empty ([0], the state dtype) when there is no initial state (no
    grad to give; the CUDA kernels then skip it, which matters with many packed
    sequences).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    group = HV // H
    acc, scale, qe, ke, ve, decay, b = _prepare(q, k, v, g, beta, scale)
    do = do.to(acc)

    dq_e = q.new_empty((B, T, HV, K), dtype=acc)
    dk_e = q.new_empty((B, T, HV, K), dtype=acc)
    dv = q.new_empty((B, T, HV, V), dtype=acc)
    dg = q.new_empty((B, T, HV, K), dtype=acc)
    dbeta = q.new_empty((B, T, HV), dtype=acc)

    # dS carries d(loss)/d(S_t) backwards in time, as dS_acc in the derivation.
    if dht is None:
        dS = q.new_zeros((B, HV, K, V), dtype=acc)
    else:
        dS = dht.to(acc).clone()

    for c in range(chunk_states.shape[1] - 2, -1, -1):
        t0, t1 = c * chunk_size, min(T, (c + 1) * chunk_size)
        # Recompute this chunk's decayed states and residuals from its saved state.
        with record_function("kda_op::bwd::recompute_chunk"):
            S = chunk_states[:, c].to(acc)
            S_decs, residuals = [], []
            for t in range(t0, t1):
                S_dec = decay[:, t, :, :, None] * S
                r = ve[:, t] - torch.einsum("bhk,bhkv->bhv", ke[:, t], S_dec)
                S = S_dec + torch.einsum("bhk,bhv->bhkv", b[:, t, :, None] * ke[:, t], r)
                S_decs.append(S_dec)
                residuals.append(r)

        with record_function("kda_op::bwd::bptt_chunk"):
            for i in range(t1 - t0 - 1, -1, -1):
                t = t0 + i
                S_dec, r = S_decs[i], residuals[i]
                k_t, b_t = ke[:, t], b[:, t, :, None]
                a_t = b_t * k_t
                S_t = S_dec + torch.einsum("bhk,bhv->bhkv", a_t, r)

                # Step 1: o_t = q_t^T S_t
                dS = dS + torch.einsum("bhk,bhv->bhkv", qe[:, t], do[:, t])
                dq_e[:, t] = torch.einsum("bhv,bhkv->bhk", do[:, t], S_t)
                # Step 2: S_t = S_dec + a_t (outer) r_t
                da = torch.einsum("bhv,bhkv->bhk", r, dS)
                dr = torch.einsum("bhk,bhkv->bhv", a_t, dS)
                # Step 3: a_t = beta_t k_t
                dbeta[:, t] = torch.einsum("bhk,bhk->bh", k_t, da)
                # Step 4: r_t = v_t - k_t^T S_dec
                dv[:, t] = dr
                dk_e[:, t] = b_t * da - torch.einsum("bhv,bhkv->bhk", dr, S_dec)
                # Step 5: both paths into S_dec (directly and through r_t) are summed.
                dS_dec = dS - torch.einsum("bhk,bhv->bhkv", k_t, dr)
                dg[:, t] = torch.einsum("bhkv,bhkv->bhk", S_dec, dS_dec)
                dS = decay[:, t, :, :, None] * dS_dec

    # Step 6: GVA reduction back to the H query/key heads.
    dq = dq_e.view(B, T, H, group, K).sum(3) * scale
    dk = dk_e.view(B, T, H, group, K).sum(3)
    return (
        dq.to(q.dtype).contiguous(),
        dk.to(k.dtype).contiguous(),
        dv.to(v.dtype),
        dg.to(g.dtype),
        dbeta.to(beta.dtype),
        q.new_empty((0,), dtype=acc) if initial_state is None else dS.to(initial_state.dtype).contiguous(),
    )


# ---------------------------------------------------------------------------
# fla's in-kernel options, as plain PyTorch (the CPU kernels of the option ops,
# and what the CUDA kernels are tested against). Each backward is written out
# rather than left to autograd: these run inside op kernels.

#: fla's eps inside the q/k l2 norm: y = x / sqrt(sum(x^2) + eps).
L2NORM_EPS = 1e-6


def l2norm_reference(x: Tensor, eps: float = L2NORM_EPS) -> tuple[Tensor, Tensor]:
    """Rows of ``x`` (last dim) scaled to unit l2 norm: ``(y in x's dtype, rstd)``
    with ``rstd = 1 / sqrt(sum(x^2) + eps)`` in the state dtype (fp32, fp64 for fp64)."""
    acc = state_dtype(x.dtype)
    xf = x.to(acc)
    rstd = torch.rsqrt((xf * xf).sum(-1) + eps)
    return (xf * rstd[..., None]).to(x.dtype).contiguous(), rstd.contiguous()


def l2norm_backward_reference(y: Tensor, rstd: Tensor, dy: Tensor) -> Tensor:
    """d x from the output ``y``, its ``rstd`` and d y: ``rstd (dy - y <dy, y>)``."""
    acc = rstd.dtype
    yf, dyf = y.to(acc), dy.to(acc)
    return (rstd[..., None] * (dyf - yf * (dyf * yf).sum(-1, keepdim=True))).to(y.dtype).contiguous()


def beta_sigmoid_reference(beta: Tensor, scale: float) -> Tensor:
    """``scale * sigmoid(beta)`` (scale 2 for fla's allow_neg_eigval), in beta's dtype."""
    acc = state_dtype(beta.dtype)
    return (scale * torch.sigmoid(beta.to(acc))).to(beta.dtype).contiguous()


def beta_sigmoid_backward_reference(beta: Tensor, dbeta_out: Tensor, scale: float) -> Tensor:
    """d beta from the raw ``beta`` and d(out), out = scale * sigmoid(beta):
    ``d(out) * scale * s * (1 - s)``."""
    acc = state_dtype(beta.dtype)
    s = torch.sigmoid(beta.to(acc))
    return (dbeta_out.to(acc) * scale * s * (1 - s)).to(beta.dtype).contiguous()


def kda_gate_reference(g: Tensor, A_log: Optional[Tensor], dt_bias: Optional[Tensor],
                       lower_bound: Optional[float]) -> Tensor:
    """fla's in-kernel gate, from the raw ``g`` [..., HV, K] to the log decay (fp32,
    fp64 for fp64 ``g``): ``-exp(A_log) * softplus(g + dt_bias)``, or with
    ``lower_bound`` ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``
    (``A_log`` may then be None: ``lower_bound * sigmoid(g + dt_bias)``).
    ``A_log`` is [HV], ``dt_bias`` [HV * K] or None."""
    acc = state_dtype(g.dtype)
    HV, K = g.shape[-2:]
    x = g.to(acc)
    if dt_bias is not None:
        x = x + dt_bias.to(acc).view(HV, K)
    a = None if A_log is None else A_log.to(acc).view(HV, 1).exp()
    if lower_bound is None:
        return -a * torch.nn.functional.softplus(x)
    return lower_bound * torch.sigmoid(x if a is None else a * x)


def kda_gate_backward_reference(g: Tensor, A_log: Optional[Tensor], dt_bias: Optional[Tensor],
                                lower_bound: Optional[float], dgate: Tensor):
    """The grads of ``kda_gate_reference``'s inputs from d(gate): ``(dg in g's
    dtype, dA_log or None, ddt_bias or None)``, the last two summed over every
    token (and batch row) in fp32 (fp64 for fp64 ``g``)."""
    acc = state_dtype(g.dtype)
    HV, K = g.shape[-2:]
    x = g.to(acc)
    if dt_bias is not None:
        x = x + dt_bias.to(acc).view(HV, K)
    dy = dgate.to(acc)
    a = None if A_log is None else A_log.to(acc).view(HV, 1).exp()
    if lower_bound is None:
        # y = -a softplus(x): dy/dx = -a sigmoid(x); dy/dA_log = y
        dx = dy * (-a) * torch.sigmoid(x)
        dlog_a = dy * (-a * torch.nn.functional.softplus(x))
    else:
        # y = lb sigmoid(a x): dy/dx = lb s (1 - s) a; dy/dA_log = lb s (1 - s) a x
        z = x if a is None else a * x
        s = torch.sigmoid(z)
        dz = dy * lower_bound * s * (1 - s)
        dx = dz if a is None else dz * a
        dlog_a = None if a is None else dz * z
    sum_dims = tuple(range(g.dim() - 2))
    dA_log = None if A_log is None else dlog_a.sum(sum_dims + (g.dim() - 1,)).to(A_log.dtype)
    ddt_bias = None if dt_bias is None else dx.sum(sum_dims).reshape(HV * K).to(dt_bias.dtype)
    return dx.to(g.dtype).contiguous(), dA_log, ddt_bias


# ---------------------------------------------------------------------------
# Packed sequences (cu_seqlens): the reference runs each sequence on its own.

def _bounds(cu_seqlens: Tensor) -> list[int]:
    # the reference reads the lengths on the host (a sync where cu_seqlens is on a GPU:
    # the fp64 path only; the CUDA kernels read them on the device)
    return [int(x) for x in cu_seqlens.tolist()]


def kda_forward_reference_varlen(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                                 scale: Optional[float], initial_state: Optional[Tensor], cu_seqlens: Tensor):
    """``kda_forward_reference`` over N sequences packed along T (B = 1):
    ``(o [1, T, HV, V], final_state [N, HV, K, V], chunk_states [1, S, HV, K, V])``
    in the layout of ``_contract.varlen_state_slots`` (S slots; with initial states
    each sequence's NC_n + 1 boundaries, without only the states entering its chunks
    after the first) and zeros in the unused slots."""
    bounds = _bounds(cu_seqlens)
    N, T = len(bounds) - 1, q.shape[1]
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    acc = state_dtype(q.dtype)
    has_h0 = initial_state is not None
    starts, _ = varlen_state_offsets([b - a for a, b in zip(bounds[:-1], bounds[1:])], has_h0)
    o = q.new_empty((1, T, HV, V), dtype=v.dtype)
    final = q.new_empty((N, HV, K, V), dtype=acc)
    chunk_states = q.new_zeros((1, varlen_state_slots(T, N, has_h0), HV, K, V), dtype=acc)
    for n in range(N):
        a, b = bounds[n], bounds[n + 1]
        h0 = None if initial_state is None else initial_state[n:n + 1]
        o_n, final_n, cs_n = kda_forward_reference(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], scale, h0)
        o[:, a:b] = o_n
        final[n] = final_n[0]
        kept = cs_n if has_h0 else cs_n[:, 1:-1]  # without h0: neither the zero first state nor the final one
        first = starts[n] if has_h0 else starts[n] + 1
        chunk_states[:, first:first + kept.shape[1]] = kept
    return o, final, chunk_states


def kda_backward_reference_varlen(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                                  scale: Optional[float], initial_state: Optional[Tensor], chunk_states: Tensor,
                                  do: Tensor, dht: Optional[Tensor], cu_seqlens: Tensor):
    """``kda_backward_reference`` over packed sequences (layout of
    ``kda_forward_reference_varlen``): ``(dq, dk, dv, dg, dbeta, dh0 [N, ...])``
    (dh0 empty without an initial state)."""
    bounds = _bounds(cu_seqlens)
    N = len(bounds) - 1
    grads = [x.new_empty(x.shape) for x in (q, k, v, g, beta)]  # contiguous, as the fake kernels say
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    acc = state_dtype(q.dtype)
    dh0 = q.new_empty((N, HV, K, V) if initial_state is not None else (0,),
                      dtype=acc if initial_state is None else initial_state.dtype)
    has_h0 = initial_state is not None
    starts, _ = varlen_state_offsets([b - a for a, b in zip(bounds[:-1], bounds[1:])], has_h0)
    for n in range(N):
        a, b = bounds[n], bounds[n + 1]
        boundaries = num_chunk_boundaries(b - a)
        h0 = None if initial_state is None else initial_state[n:n + 1]
        if has_h0:
            states_n = chunk_states[:, starts[n]:starts[n] + boundaries]
        else:  # the zero state entering chunk 0, the stored ones, the final one (not read)
            states_n = chunk_states.new_zeros((1, boundaries, HV, K, V))
            stored = max(boundaries - 2, 0)
            states_n[:, 1:1 + stored] = chunk_states[:, starts[n] + 1:starts[n] + 1 + stored]
        parts = kda_backward_reference(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], scale, h0,
                                       states_n, do[:, a:b], None if dht is None else dht[n:n + 1])
        for grad, part in zip(grads, parts[:5]):
            grad[:, a:b] = part
        if initial_state is not None:
            dh0[n] = parts[5][0]
    return (*grads, dh0)


# ---------------------------------------------------------------------------
# Decoding on a state pool (serving): fla's ssm_state_indices / num_accepted_tokens.

def _sequence_rows(B: int, T: int, cu_seqlens: Optional[Tensor]) -> list[tuple[int, int, int]]:
    """``(batch row, first token, end)`` of each sequence: B rows of T tokens, or
    the packed sequences of ``cu_seqlens`` (B = 1)."""
    if cu_seqlens is None:
        return [(n, 0, T) for n in range(B)]
    bounds = _bounds(cu_seqlens)
    return [(0, bounds[n], bounds[n + 1]) for n in range(len(bounds) - 1)]


def kda_pool_reference(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float],
                       pool: Tensor, indices: Tensor, num_accepted_tokens: Optional[Tensor],
                       cu_seqlens: Optional[Tensor], state_v_first: bool = False) -> tuple[Tensor, Tensor]:
    """The recurrence on states kept in a pool ``[num_slots, HV, K, V]`` (``[..., V,
    K]`` with ``state_v_first``): ``(o, new_pool)``, ``new_pool`` a copy of ``pool``
    with the writes done. Sequence n starts from slot ``indices[n]`` (1-D indices)
    or ``indices[n, num_accepted_tokens[n] - 1]`` (2-D; column 0 without
    ``num_accepted_tokens``); its final state goes to ``indices[n]`` (1-D), or the
    state after its token t to ``indices[n, t]`` (2-D, in token order; tokens past
    T_max, which callers refuse where they can, write nothing). A negative
    start slot marks a padding sequence: it reads and writes nothing and its
    output rows are zero; a negative ``indices[n, t]`` skips that write."""
    B, T = q.shape[:2]
    new_pool = pool.clone()
    o = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    idx = indices.tolist()
    nat = None if num_accepted_tokens is None else num_accepted_tokens.tolist()

    def layout(state: Tensor) -> Tensor:  # [HV, K, V] <-> the pool's layout
        return state.transpose(-1, -2) if state_v_first else state

    for n, (b, a, e) in enumerate(_sequence_rows(B, T, cu_seqlens)):
        row = idx[n]
        start = (row[nat[n] - 1] if nat is not None else row[0]) if indices.dim() == 2 else row
        if start < 0:
            continue
        h0 = layout(pool[start]).unsqueeze(0)
        # chunks of one token: the boundaries are the states after every token
        o_n, ht, states = kda_forward_reference(q[b:b + 1, a:e], k[b:b + 1, a:e], v[b:b + 1, a:e],
                                                g[b:b + 1, a:e], beta[b:b + 1, a:e], scale, h0, chunk_size=1)
        o[b:b + 1, a:e] = o_n
        if indices.dim() == 1:
            if e > a:
                new_pool[start] = layout(ht[0])
        else:
            for t in range(min(e - a, len(row))):  # tokens past T_max: no slot, no write
                if row[t] >= 0:
                    new_pool[row[t]] = layout(states[0, t + 1])
    return o, new_pool
