"""The KDA layer of Kimi Linear style models."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..api import chunk_kda, fused_recurrent_kda

#: The cache of one layer: (recurrent state [B, HV, K, V] in fp32,
#: conv caches of q [B, H*K, W-1], k [B, H*K, W-1] and v [B, HV*V, W-1]).
KDAState = tuple[Tensor, Tensor, Tensor, Tensor]


class ShortConvolution(nn.Module):
    """Causal depthwise convolution over time followed by SiLU.

    Keeps the last ``kernel_size - 1`` inputs as a cache, so a sequence fed in
    pieces (prefill, then one token at a time) gives the same outputs as fed whole.
    """

    def __init__(self, channels: int, kernel_size: int = 4):
        super().__init__()
        if kernel_size < 2:
            raise ValueError(f"kernel_size must be >= 2, got {kernel_size}")
        self.channels, self.kernel_size = channels, kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x: Tensor, cache: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """x: [B, T, D]; cache: [B, D, kernel_size - 1] or None (zeros).
        Returns (SiLU(conv(x)) [B, T, D], new cache)."""
        xt = x.transpose(1, 2)
        if cache is None:
            cache = xt.new_zeros(x.shape[0], self.channels, self.kernel_size - 1)
        padded = torch.cat([cache.to(xt.dtype), xt], dim=2)
        y = F.conv1d(padded, self.weight.to(xt.dtype), groups=self.channels)
        return F.silu(y).transpose(1, 2), padded[:, :, padded.shape[2] - (self.kernel_size - 1):].contiguous()


class KimiDeltaAttention(nn.Module):
    """Kimi Delta Attention layer.

    q, k and v are linear projections of the input, each through a short causal
    depthwise convolution with SiLU; q and k are l2-normalised per head. The
    per-channel log decay is ``g = -exp(A_log) * softplus(f(x) + dt_bias)`` with
    ``f`` a low-rank projection, ``beta = sigmoid(b(x))``, and the output of the
    attention goes through an RMSNorm gated by ``sigmoid`` of another low-rank
    projection, then the output projection. ``num_v_heads`` may be a multiple of
    ``num_heads`` (grouped value attention).

    ``forward(x, state=None, decode=False)`` returns ``(y, new_state)``; ``state``
    is a :data:`KDAState`. ``decode=True`` runs the attention with
    ``fused_recurrent_kda`` (one or a few tokens), otherwise ``chunk_kda``; both
    compute the same function.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        num_v_heads: Optional[int] = None,
        v_head_dim: Optional[int] = None,
        conv_size: int = 4,
        low_rank_dim: Optional[int] = None,
        norm_eps: float = 1e-5,
    ):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.num_v_heads = num_v_heads or num_heads
        self.v_head_dim = v_head_dim or head_dim
        if self.num_v_heads % num_heads:
            raise ValueError(f"num_v_heads ({self.num_v_heads}) must be a multiple of num_heads ({num_heads})")
        HK, HV, V = num_heads * head_dim, self.num_v_heads, self.v_head_dim
        rank = low_rank_dim or self.v_head_dim

        self.q_proj = nn.Linear(hidden_size, HK, bias=False)
        self.k_proj = nn.Linear(hidden_size, HK, bias=False)
        self.v_proj = nn.Linear(hidden_size, HV * V, bias=False)
        self.q_conv = ShortConvolution(HK, conv_size)
        self.k_conv = ShortConvolution(HK, conv_size)
        self.v_conv = ShortConvolution(HV * V, conv_size)
        self.f_proj = nn.Sequential(nn.Linear(hidden_size, rank, bias=False), nn.Linear(rank, HV * head_dim, bias=False))
        self.b_proj = nn.Linear(hidden_size, HV, bias=False)
        # Decay rates as in Mamba-style gates: A in [1, 16], dt in [1e-3, 1e-1].
        self.A_log = nn.Parameter(torch.empty(HV).uniform_(1, 16).log())
        dt = torch.exp(torch.empty(HV * head_dim).uniform_(math.log(1e-3), math.log(1e-1)))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        self.g_proj = nn.Sequential(nn.Linear(hidden_size, rank, bias=False), nn.Linear(rank, HV * V, bias=True))
        self.o_norm = nn.RMSNorm(V, eps=norm_eps)
        self.o_proj = nn.Linear(HV * V, hidden_size, bias=False)

    def forward(self, x: Tensor, state: Optional[KDAState] = None, decode: bool = False) -> tuple[Tensor, KDAState]:
        B, T, _ = x.shape
        H, K, HV, V = self.num_heads, self.head_dim, self.num_v_heads, self.v_head_dim
        recurrent, q_cache, k_cache, v_cache = state if state is not None else (None, None, None, None)

        q, q_cache = self.q_conv(self.q_proj(x), q_cache)
        k, k_cache = self.k_conv(self.k_proj(x), k_cache)
        v, v_cache = self.v_conv(self.v_proj(x), v_cache)
        q = F.normalize(q.view(B, T, H, K), dim=-1)
        k = F.normalize(k.view(B, T, H, K), dim=-1)
        v = v.view(B, T, HV, V)
        # The decay in fp32: it is exponentiated and summed over the sequence.
        g = -self.A_log.float().exp()[:, None] * F.softplus(
            self.f_proj(x).float().view(B, T, HV, K) + self.dt_bias.float().view(HV, K)
        )
        beta = torch.sigmoid(self.b_proj(x))

        attention = fused_recurrent_kda if decode else chunk_kda
        o, recurrent = attention(q, k, v, g, beta, initial_state=recurrent, output_final_state=True)
        gate = torch.sigmoid(self.g_proj(x).view(B, T, HV, V))
        o = self.o_norm(o) * gate
        return self.o_proj(o.reshape(B, T, HV * V)), (recurrent, q_cache, k_cache, v_cache)
