"""A small causal language model of KDA layers."""

from __future__ import annotations

from typing import Optional

from torch import Tensor, nn
import torch.nn.functional as F

import torch

from .layer import KDAPool, KDAState, KimiDeltaAttention


class KDABlock(nn.Module):
    """Pre-norm residual block: KDA, then a SwiGLU MLP."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, num_v_heads: Optional[int], mlp_ratio: int):
        super().__init__()
        self.attn_norm = nn.RMSNorm(hidden_size)
        self.attn = KimiDeltaAttention(hidden_size=hidden_size, head_dim=head_dim, num_heads=num_heads,
                                       num_v_heads=num_v_heads)
        self.mlp_norm = nn.RMSNorm(hidden_size)
        inner = mlp_ratio * hidden_size
        self.up = nn.Linear(hidden_size, 2 * inner, bias=False)
        self.down = nn.Linear(inner, hidden_size, bias=False)

    def forward(self, x: Tensor, state: Optional[KDAState] = None, decode: bool = False,
                cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, KDAState]:
        h, state = self.attn(self.attn_norm(x), state, decode, cu_seqlens=cu_seqlens)
        return self._mlp(x + h), state

    def forward_pooled(self, x: Tensor, pool: KDAPool, slots: Tensor, cu_seqlens: Tensor,
                       decode: bool = False) -> Tensor:
        """:meth:`forward` for a serving step on a state pool
        (:meth:`KimiDeltaAttention.forward_pooled`)."""
        return self._mlp(x + self.attn.forward_pooled(self.attn_norm(x), pool, slots, cu_seqlens, decode))

    def _mlp(self, x: Tensor) -> Tensor:
        a, b = self.up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(a) * b)


class KDALanguageModel(nn.Module):
    """Embedding, ``num_layers`` KDA blocks, a final RMSNorm and a tied LM head.

    ``forward(input_ids [B, T], states=None, decode=False, cu_seqlens=None)``
    returns ``(logits [B, T, vocab], states)``, one :data:`KDAState` per layer; pass
    the states back to continue the sequence (prefill, then one token at a time with
    ``decode=True``). ``cu_seqlens`` [N + 1]: N sequences packed in ``input_ids``
    [1, T] (each layer's states then one per sequence).
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int = 64,
        num_layers: int = 2,
        num_heads: int = 2,
        head_dim: int = 16,
        num_v_heads: Optional[int] = None,
        mlp_ratio: int = 2,
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.blocks = nn.ModuleList(
            KDABlock(hidden_size, num_heads, head_dim, num_v_heads, mlp_ratio) for _ in range(num_layers)
        )
        self.norm = nn.RMSNorm(hidden_size)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False)
        self.head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(
        self, input_ids: Tensor, states: Optional[list[KDAState]] = None, decode: bool = False,
        cu_seqlens: Optional[Tensor] = None,
    ) -> tuple[Tensor, list[KDAState]]:
        x = self.embed(input_ids)
        new_states = []
        for i, block in enumerate(self.blocks):
            x, state = block(x, None if states is None else states[i], decode, cu_seqlens)
            new_states.append(state)
        return self.head(self.norm(x)), new_states

    def set_context_parallel(self, group) -> None:
        """Context parallelism over ``group`` for training forwards (None: off); see
        :meth:`KimiDeltaAttention.set_context_parallel`. Each rank then passes its
        slice of the sequence; sum the parameters' gradients over the ranks."""
        for block in self.blocks:
            block.attn.set_context_parallel(group)

    def new_pools(self, num_slots: int, device: Optional[torch.device] = None) -> list[KDAPool]:
        """Zeroed serving states for ``num_slots`` requests, one :data:`KDAPool` per layer."""
        dtype = self.embed.weight.dtype
        return [block.attn.new_pool(num_slots, device, torch.promote_types(dtype, torch.float32))
                for block in self.blocks]

    def forward_pooled(self, input_ids: Tensor, pools: list[KDAPool], slots: Tensor, cu_seqlens: Tensor,
                       decode: bool = False) -> Tensor:
        """One serving step: ``input_ids`` [1, T] holding N packed sequences
        (``cu_seqlens`` [N + 1]), sequence n continuing the request in slot
        ``slots[n]`` of ``pools`` (:meth:`new_pools`), updated in place; ``decode``:
        every sequence is one token (the recurrent kernel). Returns the logits
        [1, T, vocab]. Inference only (run it under ``torch.no_grad()``)."""
        x = self.embed(input_ids)
        for block, pool in zip(self.blocks, pools):
            x = block.forward_pooled(x, pool, slots, cu_seqlens, decode)
        return self.head(self.norm(x))
