"""Random KDA inputs drawn the way fla's benchmarks draw them (never zeros)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def make_inputs(
    B: int = 2,
    T: int = 70,
    H: int = 2,
    G: int = 1,
    K: int = 8,
    V: int = 6,
    dtype: torch.dtype = torch.float64,
    device: str = "cpu",
    with_initial_state: bool = True,
    seed: Optional[int] = None,
    requires_grad: bool = False,
) -> dict:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    HV = H * G
    inputs = dict(
        q=randn(B, T, H, K),
        k=F.normalize(randn(B, T, H, K), dim=-1),
        v=randn(B, T, HV, V),
        g=F.logsigmoid(randn(B, T, HV, K)).clamp_min(-5.0),
        beta=torch.sigmoid(randn(B, T, HV)),
        initial_state=randn(B, HV, K, V) if with_initial_state else None,
    )
    out = {}
    for name, x in inputs.items():
        if x is None:
            out[name] = None
            continue
        # The state stays fp32 for low-precision inputs, as users pass it.
        x_dtype = dtype if name != "initial_state" or dtype == torch.float64 else torch.float32
        x = x.to(device=device, dtype=x_dtype)
        out[name] = x.requires_grad_(requires_grad)
    return out
