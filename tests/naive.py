"""An independent oracle: the KDA recurrence as a plain loop over value heads and
tokens, written with matmuls (not the reference's einsums), for autograd to
differentiate. Slow on purpose; fp64 in the tests."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def naive_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """Returns (o [B,T,HV,V], final_state [B,HV,K,V]) in the dtype of q."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    scale = K**-0.5 if scale is None else scale
    outs, finals = [], []
    for j in range(HV):
        h = j // G  # GVA: value head j reads key head j // G
        if initial_state is None:
            S = q.new_zeros(B, K, V)
        else:
            S = initial_state[:, j].to(q.dtype)
        o_j = []
        for t in range(T):
            S = S * torch.exp(g[:, t, j].to(q.dtype)).unsqueeze(-1)
            kt = k[:, t, h].unsqueeze(1)  # [B, 1, K]
            residual = v[:, t, j].unsqueeze(1) - kt @ S  # [B, 1, V]
            write = (beta[:, t, j].to(q.dtype)[:, None, None] * kt).transpose(1, 2)  # [B, K, 1]
            S = S + write @ residual
            o_j.append(((scale * q[:, t, h]).unsqueeze(1) @ S).squeeze(1))
        outs.append(torch.stack(o_j, dim=1) if T > 0 else q.new_zeros(B, 0, V))
        finals.append(S)
    return torch.stack(outs, dim=2), torch.stack(finals, dim=1)
