"""The KDA layer of Kimi Linear style models, a drop-in for flash-linear-attention
0.6's ``fla.layers.kda.KimiDeltaAttention``: the same constructor, parameters and
``state_dict``, computing the same function through kda-op's kernels."""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..api import chunk_kda, fused_recurrent_kda

#: The cache of one layer: (recurrent state [B, HV, K, V] in fp32 (fp64 for fp64
#: inputs), conv caches of q [B, H*K, W-1], k [B, H*K, W-1] and v [B, HV*V, W-1];
#: the conv caches are None when the layer has no short convolutions).
KDAState = tuple[Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor]]
#: One layer's states for up to num_slots requests (serving), in the KDAState order:
#: the recurrent pool [num_slots, HV, K, V] (fp32) and the conv-cache pools
#: [num_slots, D, W-1] of q, k, v (None without short convolutions).
KDAPool = tuple[Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor]]

_ACTIVATIONS = ("silu", "swish")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half types (as fla's kernels accumulate), else the dtype itself
    (fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)


class ShortConvolution(nn.Module):
    """Causal depthwise convolution over time, then SiLU (or no activation).

    fla's ``ShortConvolution`` parameter layout: ``weight`` [hidden_size, 1,
    kernel_size] (``weight[:, 0, -1]`` multiplies the current token) and, with
    ``bias``, ``bias`` [hidden_size]; initialised as ``nn.Conv1d`` initialises
    them. The cache holds the last ``kernel_size - 1`` inputs, so a sequence fed
    in pieces (prefill, then one token at a time) gives the same outputs as fed
    whole.

    Args:
        hidden_size: channels (input and output).
        kernel_size: taps, >= 1.
        bias: whether to add a per-channel bias.
        activation: ``"silu"`` / ``"swish"`` (the same) or ``None``.
    """

    def __init__(self, hidden_size: int, kernel_size: int = 4, bias: bool = False,
                 activation: Optional[str] = "silu"):
        super().__init__()
        _check_int("hidden_size", hidden_size, 1)
        _check_int("kernel_size", kernel_size, 1)
        _check_flag("bias", bias)
        if activation is not None and activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {_ACTIVATIONS} or None, got {activation!r}")
        self.hidden_size, self.kernel_size, self.activation = hidden_size, kernel_size, activation
        self.weight = nn.Parameter(torch.empty(hidden_size, 1, kernel_size))
        self.bias = nn.Parameter(torch.empty(hidden_size)) if bias else None
        # nn.Conv1d's initialisation (fla's module is an nn.Conv1d): fan_in = kernel_size.
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(kernel_size)
            nn.init.uniform_(self.bias, -bound, bound)

    def extra_repr(self) -> str:
        return (f"{self.hidden_size}, kernel_size={self.kernel_size}, bias={self.bias is not None}, "
                f"activation={self.activation}")

    def _activate(self, y: Tensor) -> Tensor:
        return F.silu(y) if self.activation is not None else y

    def forward(self, x: Tensor, cache: Optional[Tensor] = None,
                cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """Convolve ``x``.

        Args:
            x: ``[B, T, D]``; with ``cu_seqlens``, ``[1, T, D]`` holding N packed
                sequences.
            cache: the ``kernel_size - 1`` inputs before each sequence,
                ``[B, D, kernel_size - 1]`` (``[N, D, kernel_size - 1]`` with
                ``cu_seqlens``), or None for zeros.
            cu_seqlens: ``[N + 1]`` integer offsets of the packed sequences
                (0 first, T last; empty sequences allowed), or None. No token's
                window reaches into another sequence: a sequence's first tokens
                read its own cache.

        Returns:
            ``(y, new_cache)``: ``y`` like ``x``; ``new_cache`` [B or N, D,
            kernel_size - 1], the last ``kernel_size - 1`` inputs of each
            sequence (shifted in after its cache).
        """
        if cu_seqlens is not None:
            return self._forward_varlen(x, cache, cu_seqlens)
        W = self.kernel_size
        xt = x.transpose(1, 2)
        if cache is None:
            cache = xt.new_zeros(x.shape[0], self.hidden_size, W - 1)
        padded = torch.cat([cache.to(xt.dtype), xt], dim=2)
        if x.shape[1] == 0:  # conv1d refuses an input shorter than its kernel
            return x, padded.contiguous()
        bias = None if self.bias is None else self.bias.to(xt.dtype)
        y = F.conv1d(padded, self.weight.to(xt.dtype), bias, groups=self.hidden_size)
        # [B, T, D] contiguous: the kernels read q/k/v token-major (and kda_prep_fwd's
        # CPU reference keeps a strided input's layout, which its fake kernel does not).
        y = self._activate(y).transpose(1, 2).contiguous()
        return y, padded[:, :, padded.shape[2] - (W - 1):].contiguous()

    def _forward_varlen(self, x: Tensor, cache: Optional[Tensor], cu_seqlens: Tensor) -> tuple[Tensor, Tensor]:
        """The packed path: tap ``j`` of token ``t`` (position ``p`` in its
        sequence) reads token ``t - j`` when ``p >= j``, else the sequence's cache.
        Gathers and selects only, so shapes are static (torch.compile, export)."""
        if x.dim() != 3 or x.shape[0] != 1:
            raise ValueError(f"x must be [1, T, D] with cu_seqlens, got shape {tuple(x.shape)}")
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens must be 1-D with N + 1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
        W, D, T = self.kernel_size, self.hidden_size, x.shape[1]
        N = cu_seqlens.shape[0] - 1
        dtype = _compute_dtype(x.dtype)
        xs = x[0].to(dtype)
        if cache is None:
            cache = xs.new_zeros(N, D, W - 1)
        cache = cache.to(dtype)
        cu = cu_seqlens.to(device=x.device, dtype=torch.int64)
        w = self.weight[:, 0, :].to(dtype)  # [D, W]
        t = torch.arange(T, device=x.device)
        seq = torch.searchsorted(cu[1:].contiguous(), t, right=True)  # sequence of each token
        pos = t - cu[seq]  # position in its sequence
        y = xs * w[:, W - 1]
        for j in range(1, W):
            prev = F.pad(xs, (0, 0, j, 0))[:T]  # token t - j
            # cache[..., W - 1 - (j - pos)] is the input j - pos steps before the sequence
            slot = (W - 1 - j + pos).clamp(max=W - 2)
            y = y + torch.where((pos >= j)[:, None], prev, cache[seq, :, slot]) * w[:, W - 1 - j]
        if self.bias is not None:
            y = y + self.bias.to(dtype)
        y = self._activate(y).to(x.dtype)[None]

        # New cache slot i of sequence n: its input number len_n - (W - 1) + i, or,
        # for a sequence shorter than W - 1, the old cache shifted left by len_n.
        lens = cu[1:] - cu[:-1]
        i = torch.arange(W - 1, device=x.device)
        idx = lens[:, None] - (W - 1) + i  # [N, W - 1]
        from_x = xs[(cu[:-1, None] + idx).clamp(0, max(T - 1, 0))] if T > 0 else xs.new_zeros(N, W - 1, D)
        from_cache = cache[torch.arange(N, device=x.device)[:, None], :, (i + lens[:, None]).clamp(max=W - 2)]
        new_cache = torch.where((idx >= 0)[..., None], from_x, from_cache).transpose(1, 2).contiguous()
        return y, new_cache.to(x.dtype)


class RMSNormGated(nn.Module):
    """RMSNorm over the last dim, times an activation of a gate: what fla's
    ``FusedRMSNormGated`` computes, ``x / sqrt(mean(x^2) + eps) * weight * act(g)``
    with ``act`` sigmoid (or swish/silu: ``g * sigmoid(g)``), in fp32 for half
    inputs, returned in ``x``'s dtype. Parameter: ``weight`` [hidden_size], ones."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, activation: str = "sigmoid"):
        super().__init__()
        _check_int("hidden_size", hidden_size, 1)
        _check_positive_float("eps", eps)
        if activation not in ("sigmoid", "swish", "silu"):
            raise ValueError(f"activation must be 'sigmoid', 'swish' or 'silu', got {activation!r}")
        self.hidden_size, self.eps, self.activation = hidden_size, float(eps), activation
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, activation={self.activation}"

    def forward(self, x: Tensor, g: Tensor) -> Tensor:
        """x, g: ``[..., hidden_size]``; returns ``[..., hidden_size]`` in x's dtype."""
        dtype = _compute_dtype(x.dtype)
        xf, gf = x.to(dtype), g.to(dtype)
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps) * self.weight.to(dtype)
        gate = torch.sigmoid(gf) if self.activation == "sigmoid" else gf * torch.sigmoid(gf)
        return (y * gate).to(x.dtype)


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def _check_positive_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")


# Keywords of kda-op's earlier constructor: fla's **kwargs would swallow them, so a
# caller not yet moved to fla's names would silently get another layer.
_OLD_KEYWORDS = {
    "v_head_dim": "pass expand_v = v_head_dim / head_dim",
    "low_rank_dim": "fla's f_proj / g_proj bottleneck is head_v_dim",
}


class KimiDeltaAttention(nn.Module):
    """Kimi Delta Attention layer, a drop-in for fla 0.6's
    ``fla.layers.kda.KimiDeltaAttention``.

    Same constructor keywords, defaults and checks as fla's, and the same
    parameters (names, shapes, dtypes, initialisation), so
    ``ours.load_state_dict(fla_layer.state_dict())`` works and then computes
    fla's outputs: q, k, v are linear projections, each through a short causal
    depthwise convolution with SiLU (``q_conv1d`` ...; plain SiLU without
    ``use_short_conv``); the gate logits ``f_proj(x)`` (low rank) and beta logits
    ``b_proj(x)`` go raw to the kernels, which l2-normalise q and k, form the
    log decay ``-exp(A_log) * softplus(f + dt_bias)`` (with ``lower_bound``:
    ``lower_bound * sigmoid(exp(A_log) * (f + dt_bias))``) and ``sigmoid(b)``
    (times 2 with ``allow_neg_eigval``), as fla's layer asks of its kernels. The
    attention output goes through an RMSNorm gated by ``sigmoid(g_proj(x))``
    (``o_norm``) and ``o_proj``. ``num_v_heads`` may be a multiple of
    ``num_heads`` (grouped value attention).

    Args:
        hidden_size: model width. Default 2048.
        expand_v: head_v_dim = head_dim * expand_v (must be an integer). Default 1.
        head_dim: key head size K. Default 128.
        num_heads: query/key heads H. Default 16.
        num_v_heads: value heads HV, a multiple of num_heads; None means num_heads.
        mode: ``"chunk"`` or ``"fused_recurrent"``: which kernel runs without grad
            (with grad, always ``chunk``, as in fla).
        use_short_conv: short convolutions on q, k, v (else SiLU). Default True.
        allow_neg_eigval: beta = 2 * sigmoid(b). Default False.
        safe_gate: fla's promise that gates lie in [lower_bound, 0); needs
            lower_bound in [-5, 0) (checked here, fla checks it at the first
            chunk call). kda-op's kernels take no different path for it. With it,
            A_log starts at zeros, as fla does.
        lower_bound: see above. Default None.
        conv_size: taps of the short convolutions. Default 4.
        conv_bias: bias in the short convolutions. Default False.
        layer_idx: stored, as fla does (fla indexes its cache with it).
        norm_eps: eps of ``o_norm``. Default 1e-5.
        **kwargs: ignored, as fla ignores them (model configs pass extra keys);
            but kda-op's former ``v_head_dim`` and ``low_rank_dim`` raise TypeError.

    ``forward(hidden_states, state=None, decode=False, attention_mask=None)``
    returns ``(y, state)``; see :meth:`forward`.

    Differences from fla's layer, by design:

    * The recurrent state is kept ``[B, HV, K, V]`` (``state_v_first=False``);
      fla's layer asks for ``[B, HV, V, K]``. kda-op's kernels are K-first: the
      V-first layout would cost a transpose copy of the state on each call (on
      every decode step), and the results are the same.
    * fla picks ``fused_recurrent`` for inference calls of <= 64 tokens; here the
      kernel is chosen by ``decode`` and ``mode`` only, never by the length, so
      that export with a dynamic length has no branch on it (``chunk_kda`` runs
      its token-by-token kernel for short sequences on CUDA anyway).
    * ``forward`` takes and returns the layer's state, ``(y, state)``, where fla's
      takes a ``past_key_values`` Cache and returns ``(o, None, past_key_values)``.
    """

    def __init__(
        self,
        hidden_size: int = 2048,
        expand_v: float = 1,
        head_dim: int = 128,
        num_heads: int = 16,
        num_v_heads: Optional[int] = None,
        mode: str = "chunk",
        use_short_conv: bool = True,
        allow_neg_eigval: bool = False,
        safe_gate: bool = False,
        lower_bound: Optional[float] = None,
        conv_size: int = 4,
        conv_bias: bool = False,
        layer_idx: Optional[int] = None,
        norm_eps: float = 1e-5,
        **kwargs: Any,
    ):
        super().__init__()
        for name, hint in _OLD_KEYWORDS.items():
            if name in kwargs:
                raise TypeError(f"KimiDeltaAttention() takes fla's keywords; {name!r} is no longer one: {hint}")
        _check_int("hidden_size", hidden_size, 1)
        _check_int("head_dim", head_dim, 1)
        _check_int("num_heads", num_heads, 1)
        if num_v_heads is not None:
            _check_int("num_v_heads", num_v_heads, 1)
        _check_int("conv_size", conv_size, 1)
        _check_positive_float("expand_v", expand_v)
        _check_positive_float("norm_eps", norm_eps)
        for name, flag in (("use_short_conv", use_short_conv), ("allow_neg_eigval", allow_neg_eigval),
                           ("safe_gate", safe_gate), ("conv_bias", conv_bias)):
            _check_flag(name, flag)
        if mode not in ("chunk", "fused_recurrent"):
            raise ValueError(f"mode must be 'chunk' or 'fused_recurrent', got {mode!r}")
        if layer_idx is not None:
            _check_int("layer_idx", layer_idx, 0)

        self.mode = mode
        self.allow_neg_eigval = allow_neg_eigval
        self.safe_gate = safe_gate
        self.lower_bound = lower_bound
        self.hidden_size = hidden_size
        self.expand_v = expand_v
        self.use_short_conv = use_short_conv
        self.conv_size = conv_size
        self.conv_bias = conv_bias
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_v_heads = num_v_heads if num_v_heads is not None else num_heads
        self.head_k_dim = head_dim
        self.head_v_dim = int(head_dim * expand_v)
        self.key_dim = num_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.layer_idx = layer_idx

        # fla's checks, with its tolerance.
        if not math.isclose(self.num_v_heads * head_dim * expand_v, self.value_dim, rel_tol=1e-5):
            raise ValueError(f"expand_v={expand_v} does not give an integer value_dim: num_v_heads * head_dim * "
                             f"expand_v = {self.num_v_heads * head_dim * expand_v}")
        if not math.isclose(head_dim * expand_v, self.head_v_dim, rel_tol=1e-5):
            raise ValueError(f"expand_v={expand_v} does not give an integer head_v_dim: head_dim * expand_v = "
                             f"{head_dim * expand_v}")
        # fla refuses a num_v_heads above num_heads that is no multiple of it here,
        # and any other non-multiple in its kernels; both are refused here.
        if self.num_v_heads % num_heads:
            raise ValueError(f"num_v_heads={self.num_v_heads} must be a multiple of num_heads={num_heads}")
        # fla's kernel rules on lower_bound and safe_gate, checked now rather than
        # at the first forward.
        if lower_bound is not None:
            if isinstance(lower_bound, bool) or not isinstance(lower_bound, numbers.Real):
                raise TypeError(f"lower_bound must be a float or None, got {type(lower_bound).__name__}")
            if not math.isfinite(lower_bound):
                raise ValueError(f"lower_bound must be finite, got {lower_bound}")
        if safe_gate and (lower_bound is None or not -5 <= lower_bound < 0):
            raise ValueError(f"safe_gate=True needs lower_bound in [-5, 0), got lower_bound={lower_bound}")

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        if use_short_conv:
            self.q_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias, activation="silu")
            self.k_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias, activation="silu")
            self.v_conv1d = ShortConvolution(self.value_dim, conv_size, bias=conv_bias, activation="silu")

        # The gate is per value head and key channel: HV * K.
        self.gate_dim = self.num_v_heads * self.head_k_dim
        self.f_proj = nn.Sequential(
            nn.Linear(hidden_size, self.head_v_dim, bias=False),
            nn.Linear(self.head_v_dim, self.gate_dim, bias=False),
        )
        self.b_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        # fla's initialisation, in fp32 whatever the default dtype: A in [1, 16]
        # (zeros with safe_gate), dt in [1e-3, 1e-1] stored as softplus^-1(dt).
        if safe_gate:
            self.A_log = nn.Parameter(torch.zeros(self.num_v_heads, dtype=torch.float32))
        else:
            self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32).uniform_(1, 16).log())
        self.A_log._no_weight_decay = True
        dt = torch.exp(torch.rand(self.gate_dim, dtype=torch.float32) * (math.log(0.1) - math.log(0.001))
                       + math.log(0.001)).clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.dt_bias._no_weight_decay = True
        self.g_proj = nn.Sequential(
            nn.Linear(hidden_size, self.head_v_dim, bias=False),
            nn.Linear(self.head_v_dim, self.value_dim, bias=True),
        )
        self.o_norm = RMSNormGated(self.head_v_dim, eps=norm_eps, activation="sigmoid")
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    def forward(
        self,
        hidden_states: Tensor,
        state: Optional[KDAState] = None,
        decode: bool = False,
        attention_mask: Optional[Tensor] = None,
        cu_seqlens: Optional[Tensor] = None,
    ) -> tuple[Tensor, KDAState]:
        """Run the layer.

        Args:
            hidden_states: ``[B, T, hidden_size]``.
            state: a :data:`KDAState` from an earlier call (the sequence so far),
                or None to start afresh.
            decode: run the attention with ``fused_recurrent_kda`` (decoding one or
                a few tokens); otherwise ``chunk_kda`` (or ``fused_recurrent_kda``
                with ``mode="fused_recurrent"`` when grad is off). All compute the
                same function.
            attention_mask: ``[B, T']`` with ``T' >= T`` (only the last T columns
                are read, as in fla), nonzero for a token, 0 for padding (fla's
                convention; left padding is typical, any pattern works). Each row's
                tokens are then a sequence of their own, continuing that row's
                ``state``; padding changes no state and its outputs are 0.
            cu_seqlens: ``[N + 1]`` integer offsets of N sequences packed in
                ``hidden_states`` ``[1, T, hidden_size]`` (fla's layer's keyword;
                not with ``attention_mask``); ``state``'s entries are then one per
                sequence. Under :meth:`set_context_parallel`, the offsets of the
                whole packed batch that the ranks' slices cut.

        Returns:
            ``(y [B, T, hidden_size], new_state)``.

        With ``attention_mask`` the batch is unpadded to one packed sequence
        (``cu_seqlens``, B = 1) and repadded, with static shapes throughout (so
        ``torch.compile(fullgraph=True)`` and export trace it): the B*T tokens are
        permuted so that every row's tokens come first, row after row in time
        order, and all padding last as one extra trailing sequence (N = B + 1
        sequences, an empty one allowed) whose outputs and state are discarded.
        The short convolutions run on the packed tokens with ``cu_seqlens`` too
        (:class:`ShortConvolution`'s varlen path): a sequence's first tokens read
        its own conv cache, never the previous row's tokens nor padding, whatever
        the padding pattern; padded positions are zeroed first so that the padding
        sequence stays finite.
        """
        if not isinstance(hidden_states, Tensor):
            raise TypeError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states must be [B, T, {self.hidden_size}], got shape "
                             f"{tuple(hidden_states.shape)}")
        _check_flag("decode", decode)
        if state is not None and not (isinstance(state, (tuple, list)) and len(state) == 4):
            raise TypeError("state must be a KDAState: (recurrent, q conv cache, k conv cache, v conv cache)")
        if cu_seqlens is not None:
            if attention_mask is not None:
                raise ValueError("give attention_mask or cu_seqlens, not both (a mask is unpadded to cu_seqlens)")
            if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (
                    torch.int32, torch.int64):
                raise ValueError("cu_seqlens must be a 1-D int32 or int64 torch.Tensor [N + 1]")
            if hidden_states.shape[0] != 1:
                raise ValueError(f"with cu_seqlens the sequences are packed along T: hidden_states must be "
                                 f"[1, T, {self.hidden_size}], got shape {tuple(hidden_states.shape)}")
        if attention_mask is None:
            return self._forward(hidden_states, state, decode, cu_seqlens)
        return self._forward_masked(hidden_states, state, decode, attention_mask)

    def new_pool(self, num_slots: int, device: Optional[torch.device] = None,
                 dtype: torch.dtype = torch.float32) -> KDAPool:
        """Zeroed states for ``num_slots`` requests (:data:`KDAPool`); ``dtype``: the
        conv caches' (the inputs' compute dtype), the recurrent states are fp32."""
        _check_int("num_slots", num_slots, 1)
        W = self.conv_size - 1
        recurrent = torch.zeros(num_slots, self.num_v_heads, self.head_k_dim, self.head_v_dim, device=device)
        if not self.use_short_conv:
            return recurrent, None, None, None
        return (recurrent, torch.zeros(num_slots, self.key_dim, W, device=device, dtype=dtype),
                torch.zeros(num_slots, self.key_dim, W, device=device, dtype=dtype),
                torch.zeros(num_slots, self.value_dim, W, device=device, dtype=dtype))

    def forward_pooled(self, hidden_states: Tensor, pool: KDAPool, slots: Tensor, cu_seqlens: Tensor,
                       decode: bool = False) -> Tensor:
        """One serving step: N sequences packed along T (``hidden_states`` [1, T,
        hidden_size], ``cu_seqlens`` [N + 1]: prefill chunks of new requests beside
        decode tokens of running ones), sequence n continuing the request whose
        states are in slot ``slots[n]`` (distinct, non-negative) of ``pool``
        (:meth:`new_pool`). The pool is updated in place: the recurrent states by
        the kernels themselves (``chunk_kda`` / with ``decode`` ``fused_recurrent_kda``
        on ``ssm_state_indices``), the conv caches (a few columns a sequence) by
        ``index_copy_``. Inference only. Returns ``y`` [1, T, hidden_size]."""
        if hidden_states.dim() != 3 or hidden_states.shape[0] != 1 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states must be [1, T, {self.hidden_size}] (packed sequences), got shape "
                             f"{tuple(hidden_states.shape)}")
        if not (isinstance(pool, (tuple, list)) and len(pool) == 4):
            raise TypeError("pool must be a KDAPool: (recurrent, q conv cache, k conv cache, v conv cache)")
        _check_flag("decode", decode)
        x = hidden_states
        T = x.shape[1]
        H, K, HV, V = self.num_heads, self.head_k_dim, self.num_v_heads, self.head_v_dim
        recurrent, q_pool, k_pool, v_pool = pool
        slots = slots.to(torch.int64)
        if self.use_short_conv:
            convs = []
            for conv, proj, cache in ((self.q_conv1d, self.q_proj, q_pool), (self.k_conv1d, self.k_proj, k_pool),
                                      (self.v_conv1d, self.v_proj, v_pool)):
                y, new_cache = conv(proj(x), cache.index_select(0, slots), cu_seqlens)
                cache.index_copy_(0, slots, new_cache.to(cache.dtype))
                convs.append(y)
            q, k, v = convs
        else:
            q, k, v = F.silu(self.q_proj(x)), F.silu(self.k_proj(x)), F.silu(self.v_proj(x))
        q, k, v = q.view(1, T, H, K), k.view(1, T, H, K), v.view(1, T, HV, V)
        g = self.f_proj(x).view(1, T, HV, K)
        beta = self.b_proj(x)
        options = dict(initial_state=recurrent, ssm_state_indices=slots, inplace_final_state=True,
                       use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                       allow_neg_eigval=self.allow_neg_eigval, lower_bound=self.lower_bound, cu_seqlens=cu_seqlens,
                       A_log=self.A_log, dt_bias=self.dt_bias)
        if decode:
            o, _ = fused_recurrent_kda(q, k, v, g, beta, **options)
        else:
            o, _ = chunk_kda(q, k, v, g, beta, safe_gate=self.safe_gate, **options)
        o = self.o_norm(o, self.g_proj(x).view(1, T, HV, V))
        return self.o_proj(o.reshape(1, T, HV * V))

    def _forward_masked(self, x: Tensor, state: Optional[KDAState], decode: bool,
                        attention_mask: Tensor) -> tuple[Tensor, KDAState]:
        """Unpad to varlen, run, repad (see :meth:`forward`)."""
        B, T, D = x.shape
        if not isinstance(attention_mask, Tensor):
            raise TypeError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
        if attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] < T:
            raise ValueError(f"attention_mask must be [B, T'] = [{B}, >= {T}] (0 for padding), got shape "
                             f"{tuple(attention_mask.shape)}")
        if attention_mask.device != x.device:
            raise ValueError(f"attention_mask must be on hidden_states' device {x.device}, got {attention_mask.device}")
        real = attention_mask[:, attention_mask.shape[1] - T:] != 0  # [B, T]
        flat = real.reshape(-1)
        L = B * T
        # Packed slot of each token: real tokens in (row, time) order, then padding.
        n_real = flat.sum()
        dest = torch.where(flat, flat.cumsum(0) - 1, n_real + (~flat).cumsum(0) - 1)
        src = torch.empty_like(dest).scatter_(0, dest, torch.arange(L, device=x.device))
        lens = real.sum(1)
        cu_seqlens = torch.cat([lens.new_zeros(1), lens.cumsum(0), lens.new_full((1,), L)])

        x_packed = torch.where(flat[:, None], x.reshape(L, D), 0).index_select(0, src)[None]
        if state is not None:
            # The padding sequence starts from zeros.
            state = tuple(None if s is None else torch.cat([s, s.new_zeros(1, *s.shape[1:])]) for s in state)
        y_packed, new_state = self._forward(x_packed, state, decode, cu_seqlens)
        y = y_packed[0].index_select(0, dest)
        y = torch.where(flat[:, None], y, 0).view(B, T, D)  # fla's repad leaves 0 at padding
        return y, tuple(None if s is None else s[:B] for s in new_state)

    def set_context_parallel(self, group: Optional[Any]) -> None:
        """Run later training forwards context-parallel over ``group`` (a
        ``torch.distributed`` process group; None: off): each rank passes its
        contiguous slice of the sequence (at least ``conv_size - 1`` tokens, ranks in
        order); the attention runs through :func:`kda_op.distributed.chunk_kda_cp`
        and each short convolution reads the previous rank's last ``conv_size - 1``
        inputs (gathered, differentiable). The parameters' gradients are then each
        rank's share: sum them over the ranks (as data parallelism does)."""
        self.context_parallel_group = group

    def _forward(self, x: Tensor, state: Optional[KDAState], decode: bool,
                 cu_seqlens: Optional[Tensor]) -> tuple[Tensor, KDAState]:
        B, T, _ = x.shape
        H, K, HV, V = self.num_heads, self.head_k_dim, self.num_v_heads, self.head_v_dim
        if getattr(self, "context_parallel_group", None) is not None and not decode:
            return self._forward_context_parallel(x, state, cu_seqlens)
        recurrent, q_cache, k_cache, v_cache = state if state is not None else (None, None, None, None)

        if self.use_short_conv:
            q, q_cache = self.q_conv1d(self.q_proj(x), q_cache, cu_seqlens)
            k, k_cache = self.k_conv1d(self.k_proj(x), k_cache, cu_seqlens)
            v, v_cache = self.v_conv1d(self.v_proj(x), v_cache, cu_seqlens)
        else:
            q, k, v = F.silu(self.q_proj(x)), F.silu(self.k_proj(x)), F.silu(self.v_proj(x))
        q, k, v = q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, HV, V)
        # Raw gate and beta logits: the kernels form the decay and the sigmoid.
        g = self.f_proj(x).view(B, T, HV, K)
        beta = self.b_proj(x)

        options = dict(
            initial_state=recurrent, output_final_state=True, use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            allow_neg_eigval=self.allow_neg_eigval, lower_bound=self.lower_bound,
        )
        if decode or (self.mode == "fused_recurrent" and not torch.is_grad_enabled()):
            o, recurrent = fused_recurrent_kda(q, k, v, g, beta, A_log=self.A_log, dt_bias=self.dt_bias,
                                               cu_seqlens=cu_seqlens, **options)
        else:
            o, recurrent = chunk_kda(q, k, v, g, beta, A_log=self.A_log, dt_bias=self.dt_bias,
                                     safe_gate=self.safe_gate, cu_seqlens=cu_seqlens, **options)

        o = self.o_norm(o, self.g_proj(x).view(B, T, HV, V))
        return self.o_proj(o.reshape(B, T, HV * V)), (recurrent, q_cache, k_cache, v_cache)

    def _forward_context_parallel(self, x: Tensor, state: Optional[KDAState],
                                  cu_seqlens: Optional[Tensor]) -> tuple[Tensor, KDAState]:
        """:meth:`set_context_parallel`'s forward of this rank's slice."""
        import torch.distributed as dist

        from ..distributed import _all_gather, chunk_kda_cp

        group = self.context_parallel_group
        if state is not None:
            raise NotImplementedError("the context-parallel forward starts from a zero state (state is not "
                                      "supported there yet; neither is attention_mask: pass cu_seqlens)")
        B, T, _ = x.shape
        H, K, HV, V = self.num_heads, self.head_k_dim, self.num_v_heads, self.head_v_dim
        W = self.conv_size - 1
        rank = dist.get_rank(group)
        if self.use_short_conv:
            if T < W:
                raise ValueError(f"each rank's slice needs at least conv_size - 1 = {W} tokens, got {T}")
            convs = ((self.q_conv1d, self.q_proj), (self.k_conv1d, self.k_proj), (self.v_conv1d, self.v_proj))
            us = [proj(x) for _, proj in convs]
            # every rank's last W inputs of q, k and v in one all-gather (one collective
            # each way); this slice's windows read the previous rank's. Rank 0 takes
            # them times 0 so that its graph, and so its backward's collectives, are
            # those of every other rank.
            gathered = _all_gather(torch.cat([u[:, T - W:] for u in us], dim=-1).transpose(1, 2), group)
            cache_all = gathered[max(rank - 1, 0)] * float(rank > 0)  # [B, Dq + Dk + Dv, W]
            sizes = [u.shape[-1] for u in us]
            tails = list(gathered[-1].split(sizes, dim=1))
            local_cu = None
            if cu_seqlens is not None:
                cache_all, local_cu = self._packed_conv_caches(cache_all, T, cu_seqlens, group)
                tails = [None, None, None]  # a sequence's last inputs may lie on any rank: not gathered
            caches = cache_all.split(sizes, dim=1)
            q, k, v = (conv(u, cache, local_cu)[0] for (conv, _), u, cache in zip(convs, us, caches))
        else:
            q, k, v = F.silu(self.q_proj(x)), F.silu(self.k_proj(x)), F.silu(self.v_proj(x))
            tails = [None, None, None]
        q, k, v = q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, HV, V)
        g = self.f_proj(x).view(B, T, HV, K)
        beta = self.b_proj(x)
        o, recurrent = chunk_kda_cp(q, k, v, g, beta, group=group, output_final_state=True,
                                    use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                    use_beta_sigmoid_in_kernel=True, allow_neg_eigval=self.allow_neg_eigval,
                                    lower_bound=self.lower_bound, safe_gate=self.safe_gate, A_log=self.A_log,
                                    dt_bias=self.dt_bias, cu_seqlens=cu_seqlens)
        o = self.o_norm(o, self.g_proj(x).view(B, T, HV, V))
        return self.o_proj(o.reshape(B, T, HV * V)), (recurrent, *tails)

    def _packed_conv_caches(self, prev_inputs: Tensor, T: int, cu_seqlens: Tensor, group) -> tuple[Tensor, Tensor]:
        """The short convolutions' caches of a context-parallel slice of a packed
        batch: ``[N, D, W]`` zeros but for the slice's first sequence, which reads
        the previous rank's last W inputs (``prev_inputs`` [1, D, W]) where they
        belong to it (its start may fall among them); and the slice's ``local_cu``."""
        from ..distributed import packed_slice

        W = prev_inputs.shape[-1]
        place = packed_slice(T, cu_seqlens, group, prev_inputs.device)
        cu, first = place["cu"], place["first_seq"]
        N = cu.shape[0] - 1
        position = place["start"] - W + torch.arange(W, device=cu.device)  # of each cached input in the batch
        own = position >= cu.index_select(0, first.clamp(0, N - 1).reshape(1))  # [W]: inputs of the first sequence
        first_cache = torch.where(own, prev_inputs, torch.zeros_like(prev_inputs))
        is_first = (torch.arange(N, device=cu.device) == first).reshape(N, 1, 1)
        return torch.where(is_first, first_cache, torch.zeros_like(first_cache)), place["local_cu"]
