"""Host side of the chunked backward: allocation, block sizes and launches.

``kda_bwd_triton`` takes and returns what the op ``kda_op::chunk_kda_bwd`` does.
It runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (how CPU
CI tests the kernels). No host synchronisation, so it can be captured in a CUDA
graph. Tuning settings are read from settings.py at every call.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._contract import residual_dtype
from . import settings as S
from ._host import (_INTERPRET, _cdiv, _cp_async_wgmma_fenced, _dot_precision, _fast_exp, _gate_args,
                    _gate_bounds_every_block, _intermediates_views, _layout, _pow2, _range, _sizes,
                    _steep_dot_precision, _work_list, bf16_dup, intra_bwd_w_stages)
from .fwd import _intra_fwd
from .gva_reduce import kda_gva_reduce_kernel
from .intra_bwd import kda_intra_bwd_kernel
from .intra_bwd_a import kda_intra_bwd_a_kernel
from .intra_bwd_a_rows import kda_dg_of_chunk_kernel, kda_intra_bwd_a_rows_kernel
from .intra_bwd_w import kda_intra_bwd_w_kernel
from .prep import kda_prep_bwd_kernel
from .settings import BC, BT, MAX_SPLIT
from .state_bwd import kda_state_bwd_fused_kernel, kda_state_bwd_kernel, kda_state_bwd_prep_kernel


def _bwd_scan_loads_glast_ahead(s: dict, T: int) -> bool:
    """Whether the fused backward scan loads gam's row a chunk ahead (settings.SCAN_BWD_GLAST_AHEAD):
    on a GPU only in V blocks of 64 or more, or where every sequence has two chunks or more
    (fixed-length, T > BT). On an H100 (Triton 3.6, 2026-12-06, profiling/bwd_scan_diff.py,
    bf16, K = V = 128, h0 and dht) the load ahead gave dh0 with NaN in 41-45 columns at T = 9
    and 40 (one chunk) in V blocks of 32, and the fp64 reference's error (1.6-3.2e-3, the same
    as without it) at T = 65 to 300 in V blocks of 32 and at every T in blocks of 64. Packed
    sequences may hold one-chunk ones: not in V blocks of 32. The interpreter takes it everywhere."""
    if S.SCAN_BWD_GLAST_AHEAD not in (0, 1):
        raise ValueError(f"settings.SCAN_BWD_GLAST_AHEAD: expected 0 or 1, got {S.SCAN_BWD_GLAST_AHEAD!r}")
    if not S.SCAN_BWD_GLAST_AHEAD:
        return False
    return _INTERPRET or s["BV_SCAN_BWD"] >= 64 or (not s["IS_VARLEN"] and T > BT)


def _direct_dq_dk(G: int) -> bool:
    """Whether the backward through the A's writes the op's dq and dk itself
    (settings.DIRECT_DQ_DK: one value head a key head, nothing for gva_reduce to sum)."""
    if S.DIRECT_DQ_DK not in (0, 1):
        raise ValueError(f"settings.DIRECT_DQ_DK: expected 0 or 1, got {S.DIRECT_DQ_DK!r}")
    return bool(S.DIRECT_DQ_DK) and G == 1


def _one_launch_serves(packed: bool) -> bool:
    """Whether the per-chunk backward through the A's runs in one launch
    (settings.INTRA_BWD_A_ONE_LAUNCH: 0 never, 1 always, 2 for packed sequences
    only) rather than a launch per kind of chunk."""
    if S.INTRA_BWD_A_ONE_LAUNCH not in (0, 1, 2):
        raise ValueError(f"settings.INTRA_BWD_A_ONE_LAUNCH: expected 0, 1 or 2, got {S.INTRA_BWD_A_ONE_LAUNCH!r}")
    return S.INTRA_BWD_A_ONE_LAUNCH == 1 or (S.INTRA_BWD_A_ONE_LAUNCH == 2 and packed)


def _row_programs_serve(ga: dict) -> bool:
    """Whether the backward through the A's runs by row blocks (intra_bwd_a_rows.py):
    settings.INTRA_BWD_A_ROW_PROGRAMS, and fla's bounded gate keeps every block within
    MAX_SPLIT of its middle row (whatever a chunk's steep flag says) with its log
    decays in [lower_bound, 0] (the factors before a block <= 1)."""
    return bool(S.INTRA_BWD_A_ROW_PROGRAMS) and _gate_bounds_every_block(ga) and ga["lower_bound"] <= 0


def kda_bwd_triton(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    scale: Optional[float], initial_state: Optional[Tensor],
    chunk_states: Tensor, do: Tensor, dht: Optional[Tensor],
    intermediates: Optional[Tensor] = None, gate: Optional[tuple] = None, cu_seqlens: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Chunked backward: ``(dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias)`` as
    ``chunk_kda_bwd``. With fla's in-kernel gate (``gate``: ``(A_log, dt_bias,
    lower_bound)``, ``g`` the raw gate) dg is the raw gate's grad, and dA_log /
    ddt_bias the parameters' (empty where a parameter is absent, and always
    without the gate). ``cu_seqlens``: packed sequences, as ``kda_fwd_triton``.

    Takes the intra-chunk quantities from ``intermediates`` (the forward's, when
    it kept them) or recomputes them, then runs the reverse scan and the
    intra-chunk backward. Per-token memory is O(T * (K + V + C));
    states are kept only per chunk.
    """
    q, k, v, g, beta, do = (x.contiguous() for x in (q, k, v, g, beta, do))
    chunk_states = chunk_states.contiguous()
    s = _sizes(q, v, cu_seqlens=cu_seqlens, has_initial_state=initial_state is not None)
    B, T, H, HV, K, V, NC = s["B"], s["T"], s["H"], s["HV"], s["K"], s["V"], s["NC"]
    G = HV // H
    scale = K**-0.5 if scale is None else float(scale)
    f32 = dict(device=q.device, dtype=torch.float32)
    dh0_dtype = torch.float32 if initial_state is None else initial_state.dtype

    A_log, dt_bias = (None, None) if gate is None else gate[:2]
    def empty():  # a fresh one each time: op outputs must not alias each other
        return q.new_empty(0, dtype=torch.float32)

    if s["NSEQ"] * HV == 0 or T == 0:
        if initial_state is None:  # no initial state: no grad of it (empty, as the fake kernel says)
            dh0 = empty()
        else:
            dh0 = (torch.zeros(s["NSEQ"], HV, K, V, **f32) if dht is None else dht.to(torch.float32).clone())
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(g),
                torch.zeros_like(beta), dh0.to(dh0_dtype),
                empty() if A_log is None else torch.zeros_like(A_log),
                empty() if dt_bias is None else torch.zeros_like(dt_bias))

    prec = _dot_precision(q.dtype)
    if intermediates is not None and intermediates.numel() > 0:
        x = _intermediates_views(intermediates, _layout(q, v, cu_seqlens)[0])
    else:
        with _range("kda_op::bwd::intra_recompute"):
            x = _intra_fwd(q, k, v, g, beta, scale, s, store_tm=True, gate=gate)
    gam, akk, aqk, tm, steep = x["gam"], x["akk"], x["aqk"], x["tm"], x["steep"]

    # U' = U - W S0: the forward's own when it kept its intermediates, else made
    # by the prep kernel below
    up = x["up"] if "up" in x else torch.empty(B, T, HV, V, device=q.device, dtype=residual_dtype(q.dtype))
    fused = bool(S.SCAN_BWD_FUSED)
    # (Qg, Kr, W, A_qk and dO all bf16: the fused scan's dots on bf16 operands)
    scan_bf16_dots = bool(s["SCAN_BWD_BF16_DOTS"] and do.dtype == torch.bfloat16 and aqk.dtype == torch.bfloat16
                          and S.BF16_DSTATES and q.dtype == torch.bfloat16)
    # dU' in bf16 where the fused scan rounds it so itself (settings.BF16_DUP)
    dup = torch.empty(B, T, HV, V, device=q.device,
                      dtype=torch.bfloat16 if bf16_dup(s["IS_VARLEN"]) and fused and scan_bf16_dots
                      else torch.float32)
    # Packed sequences without dh0 and dht (training): each sequence's dS_C slots one
    # fewer than its chunks, T // BT in all (settings.COMPACT_DSTATES; state_bwd.py)
    compact = bool(S.COMPACT_DSTATES) and s["IS_VARLEN"] and dht is None and initial_state is None
    ds_offsets = s["DSTATE_OFFSETS"] if compact else dup
    dchunk_states = torch.empty(B, max(1, T // BT) if compact else NC, HV, K, V, device=q.device,
                                dtype=torch.bfloat16 if S.BF16_DSTATES and q.dtype == torch.bfloat16 else torch.float32)
    # the initial state's grad only where there is one (empty otherwise: fla returns None)
    dh0 = torch.empty(s["NSEQ"], HV, K, V, **f32) if initial_state is not None else empty()
    dht_arg = dht.contiguous() if dht is not None else dup  # a stand-in, never read without HAS_DHT
    dh0_arg = dh0 if initial_state is not None else dup  # likewise without HAS_DH0
    with _range("kda_op::bwd::state_scan"):
        # the fused scan forms A_qk^T dO and Qg^T dO itself: the prep kernel only for
        # U', where the forward did not keep it
        if not (fused and "up" in x):
            kda_state_bwd_prep_kernel[(_cdiv(V, s["BV"]), NC, B * HV)](
                x["qg"], x["w"], x["u"], aqk, chunk_states, do,
                up, dup, dchunk_states,
                *s["VL_CHUNK"], ds_offsets, T, NC,
                H=H, HV=HV, K=K, V=V, BT=BT, BK=s["BK"], BV=s["BV"],
                HAS_UP="up" in x, DOT_PREC=prec, INTERPRET=_INTERPRET, IS_VARLEN=s["IS_VARLEN"],
                HAS_DH0=initial_state is not None, COMPACT=compact, DO_TERMS=not fused, num_warps=8,
            )
        if fused:
            kda_state_bwd_fused_kernel[(_cdiv(V, s["BV_SCAN_BWD"]), s["NSEQ"] * HV)](
                x["qg"], x["kr"], x["w"], aqk, gam, do, dht_arg,
                dup, dchunk_states, dh0_arg,
                *s["VL_SEQ"], ds_offsets, T, NC,
                H=H, HV=HV, K=K, V=V, BT=BT, BK=s["BK"], BV=s["BV_SCAN_BWD"],
                HAS_DHT=dht is not None, DOT_PREC=prec,
                BF16_DOTS=scan_bf16_dots,
                IS_VARLEN=s["IS_VARLEN"], HAS_DH0=initial_state is not None, INTERPRET=_INTERPRET,
                COMPACT=compact, GLAST_AHEAD=_bwd_scan_loads_glast_ahead(s, T),
                AQK_ROW_MASK=bool(S.SCAN_AQK_ROW_MASK) and _cp_async_wgmma_fenced(),
                num_warps=s["SCAN_BWD_WARPS"], num_stages=s["SCAN_BWD_STAGES"],
            )
        else:
            kda_state_bwd_kernel[(_cdiv(V, s["BV_SCAN"]), s["NSEQ"] * HV)](
                x["kr"], x["w"], gam, dht_arg,
                dup, dchunk_states, dh0_arg,
                *s["VL_SEQ"], ds_offsets, T, NC,
                H=H, HV=HV, K=K, V=V, BT=BT, BK=s["BK"], BV=s["BV_SCAN"],
                HAS_DHT=dht is not None, DOT_PREC=prec, IS_VARLEN=s["IS_VARLEN"], HAS_DH0=initial_state is not None,
                INTERPRET=_INTERPRET, COMPACT=compact,
                num_warps=S.SCAN_WARPS, num_stages=s["SCAN_STAGES"],
            )

    # Each buffer is allocated just before the stage that writes it first and
    # dropped after the last stage that reads it, so that the peak holds only what
    # one stage needs (the caching allocator reuses the memory in stream order).
    dq_e = torch.empty(B, T, HV, K, **f32)
    dk_e = torch.empty(B, T, HV, K, **f32)
    dgam = torch.empty(B, T, HV, K, **f32)
    dgam_last = torch.empty(B, NC, HV, K, **f32)
    NS = _cdiv(K, S.BKS_W)
    # per row, not per chunk slot: a third of the slots' rows at 2048 packed sequences of 1-64 tokens
    dtm_part = torch.empty(B, T, HV, NS, BT, **f32)
    dbeta_part = torch.empty(B, T, HV, NS, **f32)
    with _range("kda_op::bwd::intra_through_w"):
        kda_intra_bwd_w_kernel[(NS, NC, B * HV)](
            q, k, beta, gam, tm, up, dup, chunk_states, dchunk_states, do,
            dq_e, dk_e, dgam, dgam_last, dtm_part, dbeta_part,
            *s["VL_CHUNK"], ds_offsets, scale, T, NC,
            H=H, HV=HV, K=K, V=V, BT=BT, BKS=S.BKS_W, BV=S.INTRA_BWD_W_BV or s["BV"],
            # (with loads ahead, where Triton does not fence the wgmmas reading their tiles,
            # S0 and dS_C pass through registers: _compat.fences_wgmma_after_cp_async)
            STATES_IN_REGISTERS=intra_bwd_w_stages(q.dtype) > 1 and not _cp_async_wgmma_fenced(),
            # (fp32 inputs not: their wider q, k tiles spill 1.4 KB loaded ahead)
            EARLY_QKG=bool(S.INTRA_BWD_W_EARLY_QKG) and q.dtype != torch.float32,
            DOT_PREC=prec, IS_VARLEN=s["IS_VARLEN"], HAS_H0=initial_state is not None, HAS_DHT=dht is not None,
            COMPACT=compact, num_warps=S.INTRA_BWD_W_WARPS, num_stages=intra_bwd_w_stages(q.dtype),
            **(dict(maxnreg=S.INTRA_BWD_W_MAXNREG) if S.INTRA_BWD_W_MAXNREG else {}),
            BF16_DQG=bool(S.INTRA_BWD_W_BF16_DQG) and do.dtype == torch.bfloat16
            and chunk_states.dtype == torch.bfloat16, INTERPRET=_INTERPRET,
            BF16_DKR=bool(S.INTRA_BWD_W_BF16_DKR) and up.dtype == torch.bfloat16
            and dchunk_states.dtype == torch.bfloat16, FAST_EXP=_fast_exp(),
            # (dU' and S0 both bf16: dU' S0^T on bf16 operands, settings.BF16_DUP)
            BF16_DW=dup.dtype == torch.bfloat16 and chunk_states.dtype == torch.bfloat16,
        )
    del dchunk_states
    dakk = torch.empty(B, T, HV, BT, **f32)
    daqk = torch.empty(B, T, HV, BT, **f32)
    dv = torch.empty_like(v)
    dbeta = torch.empty_like(beta)
    with _range("kda_op::bwd::intra"):
        kda_intra_bwd_kernel[(NC, B * HV)](
            v, beta, akk, tm, up, dup, do, dtm_part, dbeta_part,
            dv, dbeta, dakk, daqk,
            *s["VL_CHUNK"], T, NC,
            H=H, HV=HV, V=V, BT=BT, BV=s["BV"], NS=NS,
            DOT_PREC=prec, IS_VARLEN=s["IS_VARLEN"], num_warps=S.INTRA_BWD_WARPS, num_stages=S.INTRA_BWD_STAGES,
            # (fp32 inputs uncapped: their wider tiles spill 1.6 KB under the cap, 0.9 without)
            **(dict(maxnreg=S.INTRA_BWD_MAXNREG) if S.INTRA_BWD_MAXNREG and q.dtype != torch.float32 else {}),
            BF16_DAQK=(bool(S.INTRA_BWD_BF16_DAQK) and do.dtype == torch.bfloat16 and up.dtype == torch.bfloat16
                       and _cp_async_wgmma_fenced()),
            INTERPRET=_INTERPRET, UP_IN_REGISTERS=not _cp_async_wgmma_fenced(),
            # (Tm and dU' both bf16: Tm^T dU' on bf16 operands; _contract.BF16_TM)
            BF16_TDU=tm.dtype == torch.bfloat16 and dup.dtype == torch.bfloat16,
        )
    # (the stand-ins too: they may be dup, which they would keep for the rest of the backward)
    del dup, up, dtm_part, dbeta_part, ds_offsets, dht_arg, dh0_arg
    dg = torch.empty_like(g)
    # G = 1 (settings.DIRECT_DQ_DK): the backward through the A's writes the op's dq and dk
    # itself, and gva_reduce, with nothing to sum, does not run
    direct = _direct_dq_dk(G)
    dq = torch.empty_like(q) if direct else None
    dk = torch.empty_like(k) if direct else None
    out = (dq, dk, scale) if direct else (dq_e, dk_e, 1.0)  # intra_bwd_a.store_dq_dk (unread without DIRECT_OUT)
    with _range("kda_op::bwd::intra_through_a"):
        common = dict(H=H, HV=HV, K=K, BT=BT, BC=BC, DOT_PREC=prec, STEEP_DOT_PREC=_steep_dot_precision(q.dtype),
                      MAX_SPLIT=MAX_SPLIT, BLOCK_REFS=bool(S.STEEP_BLOCK_REFS),
                      ROW_BLOCK_DOTS=bool(S.INTRA_BWD_A_ROW_BLOCK_DOTS), FAST_EXP=_fast_exp(), DIRECT_OUT=direct)
        ga = _gate_args(gate, g)
        # the gate's partial sums over each chunk's rows (written where GATE)
        gate_parts = torch.empty(2, B, NC, HV, K, **f32) if gate is not None else None
        ddt_part, dla_part = (gate_parts[0], gate_parts[1]) if gate is not None else (dg, dg)  # unread without GATE
        args = (q, k, gam, dakk, daqk, dgam_last, steep, dq_e, dk_e, dgam, dg, *out,
                g, ga["A_log"], ga["dt_bias"], ga["lower_bound"], ddt_part, dla_part, *s["VL_CHUNK"], scale, T, NC)
        flags = dict(GATE=ga["GATE"], HAS_A=ga["HAS_A"], HAS_BIAS=ga["HAS_BIAS"], IS_VARLEN=s["IS_VARLEN"])
        if _row_programs_serve(ga):
            # one program per row block (settings.INTRA_BWD_A_ROW_PROGRAMS), then dg
            bkd_rows = S.INTRA_BWD_A_ROWS_BKD or S.BKD_A
            kda_intra_bwd_a_rows_kernel[(_cdiv(K, bkd_rows) * (BT // BC), NC, B * HV)](
                q, k, gam, dakk, daqk, dq_e, dk_e, dgam, *out, *s["VL_CHUNK"], scale, T, NC,
                H=H, HV=HV, K=K, BT=BT, BC=BC, BKD=bkd_rows, DOT_PREC=prec, IS_VARLEN=s["IS_VARLEN"],
                FAST_EXP=_fast_exp() and bool(S.INTRA_BWD_A_ROWS_FAST_EXP), DIRECT_OUT=direct,
                SUB_BLOCKS=bool(S.INTRA_BWD_A_ROWS_SUB_BLOCKS),
                num_warps=S.INTRA_BWD_A_ROWS_WARPS,
                **(dict(maxnreg=S.INTRA_BWD_A_ROWS_MAXNREG) if S.INTRA_BWD_A_ROWS_MAXNREG else {}),
            )
            kda_dg_of_chunk_kernel[(_cdiv(K, S.DG_OF_CHUNK_BK), NC, B * HV)](
                dgam, dgam_last, dg, g, ga["A_log"], ga["dt_bias"], ga["lower_bound"], ddt_part, dla_part,
                *s["VL_CHUNK"], T, NC, H=H, HV=HV, K=K, BT=BT, BKD=S.DG_OF_CHUNK_BK, **flags,
                num_warps=S.DG_OF_CHUNK_WARPS,
            )
        elif _one_launch_serves(s["IS_VARLEN"]):
            # both kinds of chunk in one launch, each program on its chunk's path
            if S.BKD_A != S.BKD:
                raise ValueError(f"settings.INTRA_BWD_A_ONE_LAUNCH needs BKD_A == BKD (one K slice per program), "
                                 f"got {S.BKD_A} and {S.BKD}")
            kda_intra_bwd_a_kernel[(_cdiv(K, S.BKD), NC, B * HV)](
                *args, **common, **flags, BKD=S.BKD, STEEP=False, ONE_LAUNCH=True, num_warps=S.INTRA_BWD_A_WARPS,
            )
        else:
            kda_intra_bwd_a_kernel[(_cdiv(K, S.BKD_A), NC, B * HV)](
                *args, **common, **flags, BKD=S.BKD_A, STEEP=False, num_warps=S.INTRA_BWD_A_WARPS,
                **(dict(maxnreg=S.INTRA_BWD_A_MAXNREG) if S.INTRA_BWD_A_MAXNREG else {}),
            )
            # a work list (settings.STEEP_WORK_LIST) or one program per K slice, chunk and head
            work_list = _work_list(B * NC * HV * _cdiv(K, S.BKD), q.device)
            kda_intra_bwd_a_kernel[work_list or (_cdiv(K, S.BKD), NC, B * HV)](
                *args, **common, **flags, BKD=S.BKD, STEEP=True, n_flags=B * NC * HV,
                WORK_LIST=work_list is not None, WL_BLOCK=S.WORK_LIST_BLOCK, num_warps=4,
            )
        dA_log = empty() if A_log is None else dla_part.sum((0, 1, 3)).to(A_log.dtype)
        ddt_bias = empty() if dt_bias is None else ddt_part.sum((0, 1)).reshape(HV * K).to(dt_bias.dtype)
    del dakk, daqk, dgam, dgam_last, gate_parts, ddt_part, dla_part, args, out
    if not direct:
        with _range("kda_op::bwd::gva_reduce"):
            # GVA: sum the G value heads of each key head, scale dq, cast: one pass.
            dq = torch.empty_like(q)
            dk = torch.empty_like(k)
            R = B * T * H
            kda_gva_reduce_kernel[(_cdiv(R, S.GVA_ROWS),)](
                dq_e, dk_e, dq, dk, scale, R, G=G, K=K, BR=S.GVA_ROWS, BK=_pow2(K), num_warps=4,
            )
    return dq, dk, dv, dg, dbeta, dh0.to(dh0_dtype), dA_log, ddt_bias


def kda_prep_bwd_triton(q_out: Tensor, k_out: Tensor, q_rstd: Tensor, k_rstd: Tensor, beta: Tensor,
                        dq_out: Optional[Tensor], dk_out: Optional[Tensor], dbeta_out: Optional[Tensor],
                        qk_l2norm: bool, beta_scale: float):
    """``kda_op::kda_prep_bwd`` in one launch (prep.py); a grad that is None is zero."""
    B, T, H, K = q_out.shape if qk_l2norm else (*beta.shape[:2], 1, 1)
    H = H if qk_l2norm else beta.shape[2]
    G = beta.shape[2] // H
    def empty():  # fresh, q's dtype (the fake kernel's): op outputs must not alias
        return q_out.new_empty(0)

    if qk_l2norm:
        q_out, k_out, q_rstd, k_rstd = (x.contiguous() for x in (q_out, k_out, q_rstd, k_rstd))
        dq_out = torch.zeros_like(q_out) if dq_out is None else dq_out.contiguous()
        dk_out = torch.zeros_like(k_out) if dk_out is None else dk_out.contiguous()
        dq, dk = torch.empty_like(q_out), torch.empty_like(k_out)
    else:
        dq, dk, dq_out, dk_out = empty(), empty(), empty(), empty()
    if beta_scale > 0:
        beta = beta.contiguous()
        dbeta_out = torch.zeros_like(beta) if dbeta_out is None else dbeta_out.contiguous()
        dbeta = torch.empty_like(beta)
    else:
        dbeta, dbeta_out = empty(), empty()
    R = B * T * H
    if R > 0:
        kda_prep_bwd_kernel[(_cdiv(R, S.PREP_ROWS),)](
            q_out, k_out, q_rstd, k_rstd, beta, dq_out, dk_out, dbeta_out, dq, dk, dbeta, R, float(beta_scale),
            K=K, G=G, BK=_pow2(K), BR=S.PREP_ROWS, BB=_pow2(S.PREP_ROWS * G), L2NORM=qk_l2norm, SIGMOID=beta_scale > 0,
            num_warps=S.PREP_WARPS,
        )
    return dq, dk, dbeta
