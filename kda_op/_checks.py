"""Input validation of the public functions: every check runs before any kernel,
and every error names the argument and what was expected."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ._contract import SUPPORTED_DTYPES


def _check_tensor(name: str, x: object, ndim: int, layout: str) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{name} must have a floating dtype (float16, bfloat16, float32 or float64), got {x.dtype}"
        )
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(x.shape)}")
    return x


def check_bool(name: str, value: object) -> None:
    """A flag argument must be a real bool (not 0/1, not a tensor)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def check_kda_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float],
    initial_state: Optional[Tensor],
    output_final_state: bool,
) -> None:
    """Validate the arguments of ``chunk_kda``; raise TypeError or ValueError."""
    _check_tensor("q", q, 4, "[B, T, H, K]")
    _check_tensor("k", k, 4, "[B, T, H, K]")
    _check_tensor("v", v, 4, "[B, T, HV, V]")
    _check_tensor("g", g, 4, "[B, T, HV, K]")
    _check_tensor("beta", beta, 3, "[B, T, HV]")
    if initial_state is not None:
        _check_tensor("initial_state", initial_state, 4, "[B, HV, K, V]")

    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}"
        )

    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K == 0:
        raise ValueError(f"q and k must have a non-empty head dimension K, got q of shape {tuple(q.shape)}")
    if V == 0:
        raise ValueError(f"v must have a non-empty head dimension V, got v of shape {tuple(v.shape)}")
    if H == 0:
        raise ValueError(f"q must have at least one head, got q of shape {tuple(q.shape)}")
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)} = [B, T, H, K], got {tuple(k.shape)}")
    if v.shape[0] != B or v.shape[1] != T:
        raise ValueError(
            f"v must be [B, T, HV, V] with q's B={B} and T={T}, got shape {tuple(v.shape)}"
        )
    if HV == 0 or HV % H != 0:
        raise ValueError(
            f"v's head count HV must be a positive multiple of q's head count H={H} "
            f"(grouped value attention), got HV={HV}"
        )
    if g.shape != (B, T, HV, K):
        raise ValueError(
            f"g must be [B, T, HV, K] = {(B, T, HV, K)}, got shape {tuple(g.shape)}"
        )
    if beta.shape != (B, T, HV):
        raise ValueError(f"beta must be [B, T, HV] = {(B, T, HV)}, got shape {tuple(beta.shape)}")
    if initial_state is not None and initial_state.shape != (B, HV, K, V):
        raise ValueError(
            f"initial_state must be [B, HV, K, V] = {(B, HV, K, V)}, "
            f"got shape {tuple(initial_state.shape)}"
        )

    named = [("k", k), ("v", v), ("g", g), ("beta", beta)]
    if initial_state is not None:
        named.append(("initial_state", initial_state))
    for name, x in named:
        if x.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {x.device}")

    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale}")
    check_bool("output_final_state", output_final_state)
