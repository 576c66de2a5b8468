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
    state_v_first: bool = False,
) -> None:
    """Validate the arguments of ``chunk_kda``; raise TypeError or ValueError.
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
    if initial_state is not None and initial_state.shape != (B, HV, K, V):
        want, got = (B, HV, K, V), tuple(initial_state.shape)
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
    kernel, ``lower_bound`` in [-5, 0); ``chunk_size`` 32 or 64. ``A_log`` or
    ``dt_bias`` without ``use_gate_in_kernel`` is refused (fla would ignore them)."""
    for name, value in (("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel),
                        ("use_gate_in_kernel", use_gate_in_kernel),
                        ("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel),
                        ("allow_neg_eigval", allow_neg_eigval), ("safe_gate", safe_gate),
                        ("state_v_first", state_v_first)):
        check_bool(name, value)
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError(f"{fn}(): allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True")
    if isinstance(chunk_size, bool) or chunk_size not in (32, 64):
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
