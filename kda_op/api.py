"""Public functions of kda-op, with flash-linear-attention's call convention."""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
from torch import Tensor

from . import ops as _ops  # noqa: F401  (defines the ops and their autograd)
from . import meta as _meta  # noqa: F401  (registers the fake kernels; needs the ops)
from ._compat import is_exporting
from ._checks import check_bool, check_kda_inputs, check_options, check_pool_inputs
from ._contract import chunked_kernels_serve
from .reference import beta_sigmoid_reference, l2norm_reference


# fla 0.6 keywords that belong to work not done yet: refused, never ignored.
_NOT_YET = {
    "cp_context": "context parallelism",
    "use_graph": "fla's fixed-shape varlen chunk list for graph capture",
    "max_num_seqs": "fla's fixed-shape varlen chunk list for graph capture",
    "return_intermediate_states": "returning the chunk states for inference",
}
# fla's serving keywords: chunk_kda reads them from **kwargs (fused_recurrent_kda
# names them), both through _on_pool.
_POOL_KEYWORDS = ("ssm_state_indices", "num_accepted_tokens", "inplace_final_state")


def _refuse_not_yet(fn: str, values: dict) -> None:
    """NotImplementedError for a keyword of later work set to anything but its
    default (None or False: fla's callers pass those)."""
    for name, value in values.items():
        if value is not None and value is not False:
            raise NotImplementedError(f"{fn}(): {name!r} ({_NOT_YET[name]}) is not implemented in kda-op yet")


def _fla_kwargs(fn: str, kwargs: dict, state_v_first: bool, accepted: tuple) -> tuple[dict, bool]:
    """fla's ``**kwargs``: the ones ``fn`` reads (``accepted``), its deprecated
    ``transpose_state_layout`` (= state_v_first, with fla's warning), the later
    work's (NotImplementedError); any other is a TypeError, as for a misspelt
    keyword of a plain function."""
    kwargs = dict(kwargs)
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
        warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.",
                      DeprecationWarning, stacklevel=3)
        state_v_first = kwargs.pop("transpose_state_layout")
        check_bool("transpose_state_layout", state_v_first)
    read = {name: kwargs.pop(name) for name in accepted if name in kwargs}
    unknown = [name for name in kwargs if name not in _NOT_YET]
    if unknown:
        raise TypeError(f"{fn}() got an unexpected keyword argument {unknown[0]!r}")
    _refuse_not_yet(fn, kwargs)
    return read, state_v_first


def _prepare(q, k, beta, use_qk_l2norm_in_kernel: bool, use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool):
    """fla's q/k l2 norm and beta sigmoid, through ``kda_op::kda_prep_fwd`` (one
    launch on CUDA) where either is asked; plain torch ops under torch.export."""
    if not (use_qk_l2norm_in_kernel or use_beta_sigmoid_in_kernel):
        return q, k, beta
    beta_scale = (2.0 if allow_neg_eigval else 1.0) if use_beta_sigmoid_in_kernel else 0.0
    if is_exporting():
        # torch.export: the same math as plain torch ops, which AOTInductor compiles
        # into its packages; kda_op::kda_prep_fwd, a Python custom op, it cannot
        # carry (a package must load without kda_op, as the export forward op does).
        if use_qk_l2norm_in_kernel:
            q, k = l2norm_reference(q)[0], l2norm_reference(k)[0]
        if use_beta_sigmoid_in_kernel:
            beta = beta_sigmoid_reference(beta, beta_scale)
        return q, k, beta
    q_out, k_out, beta_out, _, _ = torch.ops.kda_op.kda_prep_fwd(q, k, beta, use_qk_l2norm_in_kernel, beta_scale)
    if use_qk_l2norm_in_kernel:
        q, k = q_out, k_out
    if use_beta_sigmoid_in_kernel:
        beta = beta_out
    return q, k, beta


def chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: Optional[float] = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    cu_seqlens_cpu: Optional[Tensor] = None,
    cp_context: Optional[Any] = None,
    use_graph: bool = False,
    max_num_seqs: Optional[int] = None,
    *,
    recompute_in_backward: bool = False,
    **kwargs: Any,
) -> tuple[Tensor, Optional[Tensor]]:
    """Kimi Delta Attention: a gated delta rule with a per-channel decay.

    Per batch element and value head, with a state ``S`` of shape ``[K, V]``::

        S_dec = exp(g_t)[:, None] * S_{t-1}
        S_t   = S_dec + (beta_t * k_t) (outer) (v_t - k_t^T S_dec)
        o_t   = (scale * q_t)^T S_t

    flash-linear-attention 0.6's ``chunk_kda`` signature and semantics: the same
    positional order, the same keywords (those not implemented yet raise
    NotImplementedError, an unknown one TypeError).

    Args:
        q: queries ``[B, T, H, K]``.
        k: keys ``[B, T, H, K]`` (usually l2-normalised), same dtype as ``q``.
        v: values ``[B, T, HV, V]`` with ``HV = G * H``; value head ``j`` reads
            query/key head ``j // G``. Same dtype as ``q``.
        g: log decay ``[B, T, HV, K]`` (natural log, usually <= 0); with
            ``use_gate_in_kernel`` the raw gate instead.
        beta: write strength ``[B, T, HV]``; with ``use_beta_sigmoid_in_kernel``
            its logits.
        scale: multiplies ``q``; ``None`` means ``K ** -0.5``.
        initial_state: ``[B, HV, K, V]`` (``[B, HV, V, K]`` with
            ``state_v_first``) state before the first token, or ``None`` for zeros.
        output_final_state: whether to return the state after the last token.
        use_qk_l2norm_in_kernel: scale each row of q and k to unit l2 norm first
            (``x / sqrt(sum(x^2) + 1e-6)``, fla's).
        use_gate_in_kernel: ``g`` is the raw gate; the log decay is
            ``-exp(A_log) * softplus(g + dt_bias)``, or with ``lower_bound``
            ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``. ``A_log`` [HV]
            and ``dt_bias`` [HV * K] come as keywords (fla's ``**kwargs``);
            ``dt_bias`` may be None, ``A_log`` too when ``lower_bound`` is set.
            On CUDA the gate is formed inside the chunk kernels and dg goes back
            through it there; ``A_log`` and ``dt_bias`` get grads.
        use_beta_sigmoid_in_kernel: ``beta`` is a logit: ``sigmoid(beta)`` is used.
        allow_neg_eigval: with ``use_beta_sigmoid_in_kernel``, ``2 * sigmoid(beta)``.
        safe_gate: fla's promise that the gates lie in ``[lower_bound, 0)``
            (which lets fla's kernels take a faster path). kda-op's kernels
            handle any gate, so it changes no result; fla's rules on it are
            checked (with ``use_gate_in_kernel`` it needs ``lower_bound`` in
            ``[-5, 0)``).
        lower_bound: see ``use_gate_in_kernel`` and ``safe_gate``.
        disable_recompute: fla's: keep every intra-chunk intermediate for the
            backward instead of recomputing it. kda-op's default already keeps
            them (see ``recompute_in_backward``); True only conflicts with
            ``recompute_in_backward=True``.
        state_v_first: states in ``[..., V, K]`` layout instead of ``[..., K, V]``.
        cu_seqlens: ``[N + 1]`` int64 (or int32) offsets of N sequences packed
            along T (B = 1), as FlashAttention's varlen API; the states are then
            ``[N, HV, K, V]``. Chunks never straddle two sequences; sequences of
            length 0 pass their initial state through. No path syncs with the
            host: the CUDA kernels build their chunk index on the device. Its
            values (starting at 0, non-decreasing, ending at T) are checked where
            that costs no sync: when it is a CPU tensor, or from
            ``cu_seqlens_cpu``; a CUDA ``cu_seqlens`` alone is checked for dtype
            and shape only (not while torch.compile or torch.export traces).
        cu_seqlens_cpu: the same offsets on the CPU, for those checks.
        chunk_size: (keyword) 32 or 64, as fla accepts; kda-op's kernels always
            cut 64-token chunks, so results differ from fla's by rounding only.
        return_intermediate_states, cp_context, use_graph, max_num_seqs:
            fla's; not implemented in kda-op yet (NotImplementedError when set).
        ssm_state_indices, inplace_final_state: (keywords) prefill into a state
            pool: ``initial_state`` is the pool, ``ssm_state_indices`` ``[N]``
            each sequence's slot, read first and (``inplace_final_state=True``)
            given the final state in place, by the chunked kernels' scan (no
            gather or scatter around them). Semantics, checks and the
            read-only form (``inplace_final_state=False``): as
            :func:`fused_recurrent_kda`'s 1-D slots. Inference only.
        recompute_in_backward: kda-op's: on CUDA, when a backward will follow,
            the forward keeps its intra-chunk quantities for it (about 3 KB per
            token and value head at K = V = 128 with bf16 inputs, until the
            backward runs); ``True`` keeps none and the backward recomputes them.
            No effect without grad or on the CPU reference.

    Returns:
        ``(o, final_state)``: ``o`` is ``[B, T, HV, V]`` in the dtype of ``v``;
        ``final_state`` is ``[B, HV, K, V]`` (``[B, HV, V, K]`` with
        ``state_v_first``) in fp32 (fp64 for fp64 inputs), or ``None`` when
        ``output_final_state`` is False.

    Inputs may be float16, bfloat16, float32 or float64 (``q``, ``k``, ``v``
    share one dtype); the state is kept in fp32 (fp64 for fp64 inputs). The
    function is differentiable in every tensor input (``A_log`` and ``dt_bias``
    included) through ``torch.ops.kda_op.chunk_kda_bwd`` (and
    ``kda_prep_bwd`` for the l2 norm and sigmoid); it traces under
    ``torch.compile(fullgraph=True)`` and ``torch.export``. No input is
    modified. On CUDA, sequences of at most 16 tokens run the token-by-token
    kernel of :func:`fused_recurrent_kda` (one launch) and longer ones the
    chunked kernels; under ``torch.export`` on CUDA the op is
    ``kda_op::chunk_kda_fwd_export``, whose kernels AOTInductor compiles into
    its packages (needs T >= 1).

    Raises:
        TypeError: a non-tensor argument, an integer/bool dtype, q/k/v dtypes
            that differ, a non-bool flag, or an unknown keyword.
        ValueError: wrong ranks or shapes, HV not a multiple of H, K or V of 0,
            tensors on different devices, or options that fla refuses.
        NotImplementedError: an fla keyword of work not done yet.
    """
    _refuse_not_yet("chunk_kda", dict(return_intermediate_states=return_intermediate_states, cp_context=cp_context,
                                      use_graph=use_graph, max_num_seqs=max_num_seqs))
    extra, state_v_first = _fla_kwargs("chunk_kda", kwargs, state_v_first,
                                       ("A_log", "dt_bias", "chunk_size") + _POOL_KEYWORDS)
    A_log, dt_bias = extra.get("A_log"), extra.get("dt_bias")
    pool_args = {name: extra.get(name) for name in _POOL_KEYWORDS}
    if any(x is not None and x is not False for x in pool_args.values()):
        inplace = False if pool_args["inplace_final_state"] is None else pool_args["inplace_final_state"]
        check_bool("inplace_final_state", inplace)
        return _on_pool("chunk_kda", q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
                        use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                        lower_bound, state_v_first, cu_seqlens, pool_args["ssm_state_indices"],
                        pool_args["num_accepted_tokens"], inplace, safe_gate, extra.get("chunk_size", 64))
    check_options(
        "chunk_kda", q, v, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, lower_bound=lower_bound,
        state_v_first=state_v_first, chunk_size=extra.get("chunk_size", 64),
    )
    dt_bias = _flat_dt_bias(dt_bias)
    check_bool("disable_recompute", disable_recompute)
    check_bool("recompute_in_backward", recompute_in_backward)
    if disable_recompute and recompute_in_backward:
        raise ValueError("disable_recompute=True (keep every intermediate) contradicts recompute_in_backward=True")
    h0 = _state_in(initial_state, state_v_first)
    check_kda_inputs(q, k, v, g, beta, scale, h0, output_final_state, state_v_first=state_v_first,
                     cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    q, k, beta = _prepare(q, k, beta, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    scale = None if scale is None else float(scale)
    gate = (A_log, dt_bias, use_gate_in_kernel, None if lower_bound is None else float(lower_bound))
    if is_exporting() and chunked_kernels_serve(q.device.type, q.dtype):
        # torch.export on CUDA: the forward whose kernels AOTInductor can compile
        # into a package (kda_op.ops.chunk_kda_fwd_export).
        o, final_state, _ = torch.ops.kda_op.chunk_kda_fwd_export(q, k, v, g, beta, scale, h0, *gate, cu_seqlens)
        return o, (_state_out(final_state, state_v_first) if output_final_state else None)
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, h0, A_log, dt_bias)
    )
    # without grad (inference, prefill) the chunk states are not kept: the kernels need not store them
    o, final_state, _, _ = torch.ops.kda_op.chunk_kda_fwd(
        q, k, v, g, beta, scale, h0, needs_grad and not recompute_in_backward, *gate, cu_seqlens, output_final_state,
        needs_grad,
    )
    return o, (_state_out(final_state, state_v_first) if output_final_state else None)


def _state_in(state: Optional[Tensor], state_v_first: bool) -> Optional[Tensor]:
    """A caller's state in the ops' [..., K, V] layout (a view)."""
    return state.transpose(-1, -2) if state_v_first and isinstance(state, Tensor) else state


def _state_out(state: Tensor, state_v_first: bool) -> Tensor:
    """The ops' state in the caller's layout: [..., V, K] contiguous with state_v_first."""
    return state.transpose(-1, -2).contiguous() if state_v_first else state


def fused_recurrent_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    A_log: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: Optional[float] = None,
    state_v_first: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    ssm_state_indices: Optional[Tensor] = None,
    num_accepted_tokens: Optional[Tensor] = None,
    inplace_final_state: bool = False,
    **kwargs: Any,
) -> tuple[Tensor, Optional[Tensor]]:
    """Kimi Delta Attention token by token: the decoding path.

    flash-linear-attention 0.6's ``fused_recurrent_kda`` signature (note its
    positional order: ``A_log`` and ``dt_bias`` come before ``scale``) with the
    same options, results and checks as :func:`chunk_kda`. On CUDA a Triton
    kernel holds each state tile on chip for the whole sequence and writes no
    chunk states (the gate, when in the kernel, is formed there too), which
    suits single-token steps and short sequences; for long sequences use
    ``chunk_kda``. Runs through ``torch.ops.kda_op.fused_recurrent_kda_fwd``;
    differentiable (its backward recomputes the chunk states and reuses
    ``chunk_kda_bwd``), and traceable by ``torch.compile(fullgraph=True)``,
    ``torch.export`` and CUDA graph capture. ``cu_seqlens`` packs sequences as
    in ``chunk_kda``.

    Serving on a state pool (fla's ``fused_recurrent_kda_fwd`` keywords):
    ``initial_state`` is then a pool ``[num_slots, HV, K, V]`` (``[.., V, K]``
    with ``state_v_first``; fp32, contiguous) and ``ssm_state_indices`` (int32 or
    int64, on q's device) says which slot each of the N sequences (B, or those of
    ``cu_seqlens``) uses: ``[N]``, a slot per sequence, read first and, with
    ``inplace_final_state=True``, given the final state; or ``[N, T_max]``, a slot
    per token for speculative decoding: the state after token t goes to
    ``ssm_state_indices[n, t]`` and the sequence starts from slot
    ``ssm_state_indices[n, num_accepted_tokens[n] - 1]`` (column 0 without
    ``num_accepted_tokens``; needs ``inplace_final_state=True``). A negative slot
    marks a padding sequence (as start slot: it reads and writes no state and its
    output rows are zero) or a token whose state is not kept. Slots not written
    are untouched, bit for bit. With ``inplace_final_state=True`` the pool is
    updated in place by ``torch.ops.kda_op.fused_recurrent_kda_pool_`` (one
    launch on CUDA; the schema declares the write, so torch.compile, torch.export
    and CUDA graphs see it) and the second result is the pool; with False (1-D
    indices) the pool is only read and the final states come back fresh
    ``[N, ...]`` as without a pool. Inference only (no input may need grad).
    Sequences of one call must not share a slot: refused where the indices are
    CPU tensors (as are slots past the pool), unchecked on CUDA, where the
    result of sharing is undefined.
    """
    _, state_v_first = _fla_kwargs("fused_recurrent_kda", kwargs, state_v_first, ())
    check_bool("inplace_final_state", inplace_final_state)
    if ssm_state_indices is not None or num_accepted_tokens is not None or inplace_final_state:
        return _on_pool("fused_recurrent_kda", q, k, v, g, beta, A_log, dt_bias, scale, initial_state,
                        output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                        allow_neg_eigval, lower_bound, state_v_first, cu_seqlens, ssm_state_indices,
                        num_accepted_tokens, inplace_final_state, False, 64)
    check_options(
        "fused_recurrent_kda", q, v, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, safe_gate=False, lower_bound=lower_bound, state_v_first=state_v_first,
        chunk_size=64,
    )
    dt_bias = _flat_dt_bias(dt_bias)
    h0 = _state_in(initial_state, state_v_first)
    check_kda_inputs(q, k, v, g, beta, scale, h0, output_final_state, state_v_first=state_v_first,
                     cu_seqlens=cu_seqlens)
    q, k, beta = _prepare(q, k, beta, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    o, final_state = torch.ops.kda_op.fused_recurrent_kda_fwd(
        q, k, v, g, beta, None if scale is None else float(scale), h0,
        A_log, dt_bias, use_gate_in_kernel, None if lower_bound is None else float(lower_bound), cu_seqlens,
    )
    return o, (_state_out(final_state, state_v_first) if output_final_state else None)


def _flat_dt_bias(dt_bias: Optional[Tensor]) -> Optional[Tensor]:
    """dt_bias as the ops take it, [HV * K]; given as [HV, K] (accepted, as fla's
    layer holds it flat), a view, so that its grad comes back in its own shape."""
    return None if dt_bias is None else dt_bias.reshape(-1)


def _on_pool(fn, q, k, v, g, beta, A_log, dt_bias, scale, pool, output_final_state, use_qk_l2norm_in_kernel,
             use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first, cu_seqlens,
             ssm_state_indices, num_accepted_tokens, inplace_final_state, safe_gate, chunk_size):
    """chunk_kda / fused_recurrent_kda (``fn``) on a state pool (their docstrings):
    checks, then the in-place op, or (not in place) the plain op on the gathered
    slots."""
    if ssm_state_indices is None:
        raise ValueError("num_accepted_tokens and inplace_final_state=True need ssm_state_indices (the pool's slots)")
    check_options(
        fn, q, v, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, lower_bound=lower_bound, state_v_first=state_v_first,
        chunk_size=chunk_size,
    )
    check_kda_inputs(q, k, v, g, beta, scale, None, output_final_state, state_v_first=state_v_first,
                     cu_seqlens=cu_seqlens)
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, pool, A_log, dt_bias))
    check_pool_inputs(q, v, pool, ssm_state_indices, num_accepted_tokens, state_v_first, cu_seqlens, needs_grad)
    chunked = fn == "chunk_kda"
    if chunked and (ssm_state_indices.dim() == 2 or num_accepted_tokens is not None):
        raise NotImplementedError("chunk_kda takes one slot per sequence (ssm_state_indices [N]); a slot per token "
                                  "(speculative decoding) is fused_recurrent_kda's")
    if ssm_state_indices.dim() == 2 and not inplace_final_state:
        raise NotImplementedError("ssm_state_indices of shape [N, T_max] (a state per token) needs "
                                  "inplace_final_state=True in kda-op")
    q, k, beta = _prepare(q, k, beta, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    dt_bias = _flat_dt_bias(dt_bias)
    scale = None if scale is None else float(scale)
    lb = None if lower_bound is None else float(lower_bound)
    if inplace_final_state:
        if chunked:
            o = torch.ops.kda_op.chunk_kda_pool_(q, k, v, g, beta, scale, pool, ssm_state_indices, state_v_first,
                                                 A_log, dt_bias, use_gate_in_kernel, lb, cu_seqlens)
        else:
            o = torch.ops.kda_op.fused_recurrent_kda_pool_(q, k, v, g, beta, scale, pool, ssm_state_indices,
                                                           num_accepted_tokens, state_v_first, A_log, dt_bias,
                                                           use_gate_in_kernel, lb, cu_seqlens)
        return o, pool
    # read only: the slots gathered (zeros for a padding sequence), the plain op
    slots = ssm_state_indices.to(torch.int64)
    live = (slots >= 0).to(pool.dtype).view(-1, 1, 1, 1)
    h0 = _state_in(pool.index_select(0, slots.clamp_min(0)) * live, state_v_first)
    if chunked:
        # inference only (check_pool_inputs): no chunk states kept
        o, final_state, _, _ = torch.ops.kda_op.chunk_kda_fwd(q, k, v, g, beta, scale, h0, False, A_log, dt_bias,
                                                              use_gate_in_kernel, lb, cu_seqlens, True, False)
    else:
        o, final_state = torch.ops.kda_op.fused_recurrent_kda_fwd(q, k, v, g, beta, scale, h0, A_log, dt_bias,
                                                                  use_gate_in_kernel, lb, cu_seqlens)
    # a padding sequence: zero output rows and final state
    if cu_seqlens is None:
        tokens_live = live.view(-1, 1, 1, 1)
    else:
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        tokens_live = torch.repeat_interleave(live.view(-1), lengths, output_size=q.shape[1]).view(1, -1, 1, 1)
    o = o * tokens_live.to(o.dtype)
    final_state = final_state * live
    return o, (_state_out(final_state, state_v_first) if output_final_state else None)
