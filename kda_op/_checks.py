"""Input validation of the public functions: every check runs before any kernel,
and every error names the argument and what was expected."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ._contract import SUPPORTED_DTYPES, state_dtype


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
    state_v_first: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    cu_seqlens_cpu: Optional[Tensor] = None,
) -> None:
    """Validate the arguments of ``chunk_kda``; raise TypeError or ValueError.
    With ``cu_seqlens`` the states hold one entry per packed sequence.
    ``initial_state`` comes in the ops' [B, HV, K, V] layout (a transposed view
    of the caller's [B, HV, V, K] with ``state_v_first``, which the messages name)."""
    state_layout = "[B, HV, V, K] (state_v_first)" if state_v_first else "[B, HV, K, V]"
    _check_tensor("q", q, 4, "[B, T, H, K]")
    _check_tensor("k", k, 4, "[B, T, H, K]")
    _check_tensor("v", v, 4, "[B, T, HV, V]")
    _check_tensor("g", g, 4, "[B, T, HV, K]")
    _check_tensor("beta", beta, 3, "[B, T, HV]")
    if initial_state is not None:
        _check_tensor("initial_state", initial_state, 4, state_layout)

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
    if cu_seqlens is None and cu_seqlens_cpu is not None:
        raise ValueError("cu_seqlens_cpu is given without cu_seqlens")
    N = B if cu_seqlens is None else _check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, q)
    if initial_state is not None and initial_state.shape != (N, HV, K, V):
        want, got = (N, HV, K, V), tuple(initial_state.shape)
        if cu_seqlens is not None:
            raise ValueError(f"initial_state must hold one state per sequence of cu_seqlens: N = {N}, "
                             f"got {got[0]} (shape {got})")
        if state_v_first:
            want, got = (B, HV, V, K), got[:2] + got[2:][::-1]
        raise ValueError(f"initial_state must be {state_layout} = {want}, got shape {got}")

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


def _check_cu_seqlens(cu_seqlens: object, cu_seqlens_cpu: object, q: Tensor) -> int:
    """fla's varlen rules; returns N. Values are read only where that costs no
    host sync: a CPU ``cu_seqlens`` or ``cu_seqlens_cpu``, and not under tracing."""
    B, T = q.shape[:2]
    for name, x in (("cu_seqlens", cu_seqlens), ("cu_seqlens_cpu", cu_seqlens_cpu)):
        if x is None:
            continue
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a 1-D integer torch.Tensor [N + 1], got {type(x).__name__}")
        if x.dtype not in (torch.int64, torch.int32) or x.dim() != 1 or x.shape[0] < 1:
            raise ValueError(f"{name} must be a 1-D int64 (or int32) tensor [N + 1], got {x.dtype} of shape "
                             f"{tuple(x.shape)}")
    if cu_seqlens_cpu is not None:
        if cu_seqlens_cpu.device.type != "cpu" or cu_seqlens_cpu.shape != cu_seqlens.shape:
            raise ValueError(f"cu_seqlens_cpu must be cu_seqlens {tuple(cu_seqlens.shape)} on the CPU, got "
                             f"{tuple(cu_seqlens_cpu.shape)} on {cu_seqlens_cpu.device}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens must be on q's device {q.device}, got {cu_seqlens.device}")
    if (cu_seqlens_cpu is not None and cu_seqlens.device.type == "cpu" and not torch.compiler.is_compiling()
            and not torch.equal(cu_seqlens.to(torch.int64), cu_seqlens_cpu.to(torch.int64))):
        raise ValueError("cu_seqlens_cpu must hold the same offsets as cu_seqlens")
    if B != 1:
        raise ValueError(f"with cu_seqlens the sequences are packed along T: B must be 1, got q of shape "
                         f"{tuple(q.shape)}")
    values = cu_seqlens if cu_seqlens.device.type == "cpu" else cu_seqlens_cpu
    if values is not None and not torch.compiler.is_compiling():
        offsets = values.tolist()
        if offsets[0] != 0 or offsets[-1] != T or any(b < a for a, b in zip(offsets, offsets[1:])):
            raise ValueError(f"cu_seqlens must start at 0, never decrease and end at T = {T}, got "
                             f"{offsets if len(offsets) <= 16 else offsets[:8] + ['...'] + offsets[-4:]}")
    return cu_seqlens.shape[0] - 1


def _check_param(fn: str, name: str, x: object, shapes: tuple, layout: str, q: Tensor) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{fn}(): {name} must be a torch.Tensor of shape {layout}, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{fn}(): {name} must have a floating dtype, got {x.dtype}")
    if tuple(x.shape) not in shapes:
        raise ValueError(f"{fn}(): {name} must be {layout} = {' or '.join(map(str, shapes))}, "
                         f"got shape {tuple(x.shape)}")
    if x.device != q.device:
        raise ValueError(f"{fn}(): {name} must be on q's device {q.device}, got {x.device}")


def check_options(
    fn: str,
    q: object,
    v: object,
    *,
    A_log: object,
    dt_bias: object,
    use_qk_l2norm_in_kernel: object,
    use_gate_in_kernel: object,
    use_beta_sigmoid_in_kernel: object,
    allow_neg_eigval: object,
    safe_gate: object,
    lower_bound: object,
    state_v_first: object,
    chunk_size: object,
) -> None:
    """fla's in-kernel options and their rules (fla 0.6's, where it has one):
    flags are bools; ``allow_neg_eigval`` needs ``use_beta_sigmoid_in_kernel``;
    ``use_gate_in_kernel`` needs ``A_log`` [HV] unless ``lower_bound`` is set;
    ``dt_bias`` is [HV * K] (or [HV, K]); with ``safe_gate`` and the gate in the
    kernel, ``lower_bound`` in [-5, 0); ``chunk_size`` 32 or 64 (an int). ``A_log``
    or ``dt_bias`` without ``use_gate_in_kernel`` is refused (fla would ignore them);
    ``safe_gate`` and ``lower_bound`` without it are accepted, as fla does, and change
    nothing (in fla they pick its kernels' path; ours are exact on any gate)."""
    for name, value in (("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel),
                        ("use_gate_in_kernel", use_gate_in_kernel),
                        ("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel),
                        ("allow_neg_eigval", allow_neg_eigval), ("safe_gate", safe_gate),
                        ("state_v_first", state_v_first)):
        check_bool(name, value)
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError(f"{fn}(): allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size not in (32, 64):
        raise ValueError(f"{fn}(): chunk_size must be 32 or 64, got {chunk_size!r}")
    if lower_bound is not None:
        if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)):
            raise TypeError(f"{fn}(): lower_bound must be a float or None, got {type(lower_bound).__name__}")
        if not math.isfinite(lower_bound):
            raise ValueError(f"{fn}(): lower_bound must be finite, got {lower_bound}")
    if not use_gate_in_kernel:
        for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
            if x is not None:
                raise ValueError(f"{fn}(): {name} is given but use_gate_in_kernel is False: g is then the log "
                                 f"decay itself and {name} would be ignored; pass use_gate_in_kernel=True")
        return
    if A_log is None and lower_bound is None:
        raise ValueError(f"{fn}(): use_gate_in_kernel=True needs A_log (shape [HV]) unless lower_bound is set")
    if safe_gate:
        if lower_bound is None:
            raise ValueError(f"{fn}(): safe_gate=True with use_gate_in_kernel=True needs lower_bound")
        if not -5 <= lower_bound < 0:
            raise ValueError(f"{fn}(): lower_bound must be in [-5, 0) with safe_gate=True, got {lower_bound}")
    if not (isinstance(q, Tensor) and q.dim() == 4 and isinstance(v, Tensor) and v.dim() == 4):
        return  # check_kda_inputs names what is wrong with q or v
    HV, K = v.shape[2], q.shape[3]
    if A_log is not None:
        _check_param(fn, "A_log", A_log, ((HV,),), "[HV]", q)
    if dt_bias is not None:
        _check_param(fn, "dt_bias", dt_bias, ((HV * K,), (HV, K)), "[HV * K]", q)


def check_pool_inputs(q: Tensor, v: Tensor, pool: object, ssm_state_indices: object, num_accepted_tokens: object,
                      state_v_first: bool, cu_seqlens: Optional[Tensor], needs_grad: bool) -> None:
    """Validate decoding on a state pool (``fused_recurrent_kda`` with
    ``ssm_state_indices``); raise TypeError or ValueError before any state is
    touched. What reads the indices' values is checked only where they are CPU
    tensors (no host sync) and nothing traces: the slots' range, the accepted
    counts' range, that no two sequences share a slot, and with cu_seqlens that
    [N, T_max] indices have a column for every token (on CUDA a token past T_max
    writes no state)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    layout = "[num_slots, HV, V, K] (state_v_first)" if state_v_first else "[num_slots, HV, K, V]"
    if pool is None:
        raise ValueError("ssm_state_indices needs the state pool as initial_state")
    _check_tensor("initial_state (the state pool)", pool, 4, layout)
    want = (HV, V, K) if state_v_first else (HV, K, V)
    if tuple(pool.shape[1:]) != want:
        raise ValueError(f"initial_state (the state pool) must be {layout} with HV={HV}, K={K}, V={V}, "
                         f"got shape {tuple(pool.shape)}")
    if pool.dtype != state_dtype(q.dtype):
        raise TypeError(f"initial_state (the state pool) must be {state_dtype(q.dtype)} for {q.dtype} inputs "
                        f"(the states' dtype), got {pool.dtype}")
    if not pool.is_contiguous():
        raise ValueError("initial_state (the state pool) must be contiguous: it is written in place")
    if pool.device != q.device:
        raise ValueError(f"initial_state (the state pool) must be on q's device {q.device}, got {pool.device}")
    if needs_grad:
        raise ValueError("decoding on a state pool (ssm_state_indices) is for inference: no input may need grad "
                         "(run it under torch.no_grad() or detach the inputs)")
    if not isinstance(ssm_state_indices, Tensor):
        raise TypeError(f"ssm_state_indices must be a torch.Tensor, got {type(ssm_state_indices).__name__}")
    idx = ssm_state_indices
    if idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"ssm_state_indices must be int32 or int64, got {idx.dtype}")
    if idx.dim() not in (1, 2) or idx.shape[0] != N:
        raise ValueError(f"ssm_state_indices must be [N] or [N, T_max] with N = {N} sequences, "
                         f"got shape {tuple(idx.shape)}")
    if idx.device != q.device:
        raise ValueError(f"ssm_state_indices must be on q's device {q.device}, got {idx.device}")
    if idx.dim() == 2 and cu_seqlens is None and idx.shape[1] < T:
        raise ValueError(f"ssm_state_indices [N, T_max] needs a column per token: T_max >= T = {T}, "
                         f"got {idx.shape[1]}")
    if num_accepted_tokens is not None:
        if idx.dim() != 2:
            raise ValueError("num_accepted_tokens needs ssm_state_indices of shape [N, T_max] (a slot per token)")
        if not isinstance(num_accepted_tokens, Tensor):
            raise TypeError(f"num_accepted_tokens must be a torch.Tensor, got {type(num_accepted_tokens).__name__}")
        if num_accepted_tokens.dtype not in (torch.int32, torch.int64) or num_accepted_tokens.shape != (N,):
            raise ValueError(f"num_accepted_tokens must be an int32/int64 tensor of shape [N] = [{N}], got "
                             f"{num_accepted_tokens.dtype} {tuple(num_accepted_tokens.shape)}")
        if num_accepted_tokens.device != q.device:
            raise ValueError(f"num_accepted_tokens must be on q's device {q.device}, got {num_accepted_tokens.device}")
    if idx.device.type == "cpu" and not torch.compiler.is_compiling():  # cu_seqlens too: q's device
        if idx.dim() == 2 and cu_seqlens is not None and N:
            longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
            if longest > idx.shape[1]:
                raise ValueError(f"ssm_state_indices [N, T_max] needs a column per token: T_max >= the longest "
                                 f"sequence of cu_seqlens, {longest}, got {idx.shape[1]}")
        num_slots = pool.shape[0]
        if idx.numel() and int(idx.max()) >= num_slots:
            raise ValueError(f"ssm_state_indices holds slot {int(idx.max())}, past the pool's {num_slots} slots")
        if num_accepted_tokens is not None and N:
            nat = num_accepted_tokens
            if int(nat.min()) < 1 or int(nat.max()) > idx.shape[1]:
                raise ValueError(f"num_accepted_tokens must lie in [1, T_max = {idx.shape[1]}], "
                                 f"got {nat.min().item()} .. {nat.max().item()}")
        owner = {}
        for n, row in enumerate(idx.reshape(N, -1).tolist()):
            for slot in row:
                if slot >= 0 and owner.setdefault(slot, n) != n:
                    raise ValueError(f"ssm_state_indices gives slot {slot} to sequences {owner[slot]} and {n}: "
                                     "sequences of one call must not share a slot")
