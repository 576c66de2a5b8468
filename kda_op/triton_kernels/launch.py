"""Host side of the Triton kernels: allocation, block sizes and launches.

``kda_fwd_triton`` / ``kda_bwd_triton`` take and return what the ops
``kda_op::chunk_kda_fwd`` / ``chunk_kda_bwd`` do. They run on CUDA tensors, and on
CPU tensors under ``TRITON_INTERPRET=1`` (how CPU CI tests the kernels).
No host synchronisation, so they can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
from torch import Tensor

from .._contract import CHUNK_SIZE
from .intra_bwd import kda_intra_bwd_kernel
from .intra_fwd import kda_intra_fwd_kernel
from .output_fwd import kda_output_fwd_kernel
from .state_bwd import kda_state_bwd_kernel
from .state_fwd import kda_state_fwd_kernel

BT = CHUNK_SIZE  # chunk length of the kernels = the chunk length of the saved states
BC = 16  # sub-block length inside a chunk (see intra_fwd.py on numerics)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: 3xTF32 keeps products at about fp32 accuracy on the tensor
    # cores. bf16/fp16 inputs: plain TF32 (10-bit mantissa) is already finer than
    # the inputs and outputs.
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _sizes(q: Tensor, v: Tensor) -> dict:
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    BK = max(16, triton.next_power_of_2(K))
    return dict(
        B=B, T=T, H=H, K=K, HV=HV, V=V,
        NC=triton.cdiv(T, BT),
        BK=BK,
        BKS=min(32, BK),
        BV=min(64, max(16, triton.next_power_of_2(V))),
    )


def _intra_fwd(q, k, v, g, beta, scale, s, store_tm: bool):
    B, T, HV, K, V, NC = s["B"], s["T"], s["HV"], s["K"], s["V"], s["NC"]
    f32 = dict(device=q.device, dtype=torch.float32)
    gam = torch.empty(B, NC * BT, HV, K, **f32)
    akk = torch.empty(B, T, HV, BT, **f32)
    aqk = torch.empty(B, T, HV, BT, **f32)
    w = torch.empty(B, T, HV, K, **f32)
    u = torch.empty(B, T, HV, V, **f32)
    tm = torch.empty(B, T, HV, BT, **f32) if store_tm else akk  # akk: an unused placeholder
    kda_intra_fwd_kernel[(NC, B * HV)](
        q, k, v, g, beta, gam, akk, aqk, w, u, tm, scale, T, NC,
        H=s["H"], HV=HV, K=K, V=V, BT=BT, BC=BC, BK=s["BK"], BKS=s["BKS"], BV=s["BV"],
        STORE_TM=store_tm, DOT_PREC=_dot_precision(q.dtype), num_warps=4,
    )
    return gam, akk, aqk, w, u, (tm if store_tm else None)


def kda_fwd_triton(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    scale: Optional[float], initial_state: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor]:
    """Chunked forward: ``(o, final_state, chunk_states)`` as ``chunk_kda_fwd``."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    s = _sizes(q, v)
    B, T, HV, K, V, NC = s["B"], s["T"], s["HV"], s["K"], s["V"], s["NC"]
    scale = K**-0.5 if scale is None else float(scale)
    f32 = dict(device=q.device, dtype=torch.float32)
    h0 = None if initial_state is None else initial_state.contiguous()

    chunk_states = torch.empty(B, NC + 1, HV, K, V, **f32)
    ht = torch.empty(B, HV, K, V, **f32)
    o = torch.empty(B, T, HV, V, device=q.device, dtype=v.dtype)
    if B * HV == 0:
        return o, ht, chunk_states
    prec = _dot_precision(q.dtype)
    if NC > 0:
        gam, _, aqk, w, u, _ = _intra_fwd(q, k, v, g, beta, scale, s, store_tm=False)
    else:  # T == 0: the scan only copies the initial state through
        gam = aqk = w = u = torch.empty(0, **f32)
    up = torch.empty(B, T, HV, V, **f32)
    kda_state_fwd_kernel[(triton.cdiv(V, s["BV"]), B * HV)](
        k, w, u, gam, h0 if h0 is not None else ht, up, chunk_states, ht, T, NC,
        H=s["H"], HV=HV, K=K, V=V, BT=BT, BK=s["BK"], BV=s["BV"],
        HAS_H0=h0 is not None, DOT_PREC=prec, num_warps=4,
    )
    if NC > 0:
        kda_output_fwd_kernel[(NC, B * HV, triton.cdiv(V, s["BV"]))](
            q, gam, aqk, up, chunk_states, o, scale, T, NC,
            H=s["H"], HV=HV, K=K, V=V, BT=BT, BK=s["BK"], BV=s["BV"],
            DOT_PREC=prec, num_warps=4,
        )
    return o, ht, chunk_states
