"""Host side of the chunked forward: allocation, block sizes and launches.

``kda_fwd_triton`` takes and returns what the op ``kda_op::chunk_kda_fwd`` does;
``kda_fwd_triton_export`` is the body of ``kda_op::chunk_kda_fwd_export``. They
run on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (how CPU CI
tests the kernels). No host synchronisation, so they can be captured in a CUDA
graph. Tuning settings are read from settings.py at every call.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..reference import L2NORM_EPS
from .._contract import akk_dtype, aqk_dtype, chunk_states_dtype, residual_dtype, scan_operand_dtype, tm_dtype
from . import settings as S
from ._host import (_INTERPRET, _SERVES, _cdiv, _dot_precision, _fast_exp, _gate_args, _gate_bounds_every_block,
                    _intermediates_views, _kernel, _layout, _pow2, _range, _sizes, _sm_count, _steep_dot_precision,
                    _work_list, _zero_alignment_gaps)
from .decode import kda_recurrent_fwd_triton
from .diag_inv import kda_diag_inv_kernel
from .gam_fwd import kda_gam_fwd_kernel
from .intra_a_fwd import kda_intra_a_fwd_kernel, kda_intra_a_fwd_steep_kernel
from .intra_a_fwd_rows import kda_intra_a_fwd_rows_kernel
from .intra_fused_fwd import kda_intra_fused_fwd_kernel
from .intra_wu_fwd import kda_intra_wu_fwd_kernel
from .one_pass_fwd import kda_one_pass_fwd
from .output_fwd import kda_output_fwd_kernel
from .prep import kda_prep_fwd_kernel
from .settings import BC, BT, MAX_SPLIT
from .state_fwd import kda_state_fwd_kernel
from .state_output_fwd import kda_state_output_fwd_kernel
from .zero_slots import kda_zero_slots_kernel


def _no_steep_launch(ga: dict) -> bool:
    """Whether no chunk can take the steep launch (flag 2) so it need not run: with
    the block references on (INTRA_A_BLOCK_REFS) and fla's bounded gate
    (``lower_bound * sigmoid(...)``, every log decay within |lower_bound|), gam strays
    at most BC / 2 * |lower_bound| from a 16-row block's middle row, 40 at fla's
    safe_gate bound of -5, under MAX_SPLIT (60) with a margin of a whole unit for
    rounding: every chunk is then split (0) or takes block references (1) in
    intra_a_fwd. The launch only exits then (0.31 ms at 2048 packed sequences of
    1-64 tokens on the H200: its 197k programs)."""
    return bool(S.SKIP_IDLE_STEEP_LAUNCH) and bool(S.INTRA_A_BLOCK_REFS) and _gate_bounds_every_block(ga)


def _a_row_programs_serve(ga: dict, row_spreads: bool) -> bool:
    """Whether the A's, Qg and Kr are formed by row blocks (intra_a_fwd_rows.py;
    settings.INTRA_A_ROW_PROGRAMS): where every chunk can take block references
    (fla's bounded gate, _host._gate_bounds_every_block) and its log decays are <= 0
    (``row_spreads``: the steep flag from three rows of gam)."""
    return (bool(S.INTRA_A_ROW_PROGRAMS) and bool(S.INTRA_A_BLOCK_REFS) and row_spreads
            and _gate_bounds_every_block(ga))


def _tilings(tile: int) -> tuple[dict, ...]:
    """The tile constexprs of intra_a_fwd's and intra_wu_fwd's launches, one dict per
    launch: ``tile`` 0, one launch on [BT, BT] tiles; else per
    settings.SHORT_TILE_LAUNCHES one launch that picks the tile per chunk, or two (the
    one at BT skipping the chunks of at most ``tile`` rows, and the one that takes them)."""
    if not tile:
        return (dict(),)
    if S.SHORT_TILE_LAUNCHES == 1:
        return (dict(PICK_TILE=tile),)
    if S.SHORT_TILE_LAUNCHES == 2:
        return (dict(SKIP_TILED=tile), dict(TILE=tile))
    raise ValueError(f"settings.SHORT_TILE_LAUNCHES: expected 1 or 2, got {S.SHORT_TILE_LAUNCHES!r}")


def _intra_fwd(q, k, v, g, beta, scale, s, store_tm: bool, out: Optional[dict] = None, traced: bool = False,
               gate: Optional[tuple] = None, qg_first: bool = True, kr_last: bool = True, w_first: bool = True,
               solve_u: bool = False):
    """Stage 1 of the forward (and of the backward's recompute): gam, the A's, Tm
    (when ``store_tm``), W, U, Qg, Kr and the steep flags, into the tensors of
    ``out`` where given (views of the kept intermediates), else fresh ones.
    ``gate``: fla's in-kernel gate (``_host._gate_args``), applied by gam_fwd.py,
    which then runs whatever INTRA_GAM_KERNEL says. ``qg_first`` / ``w_first`` /
    ``kr_last`` = False (a forward that keeps nothing): the rows of Qg and W in
    each sequence's first chunk, of Kr in its last, are not written (where neither
    the output nor the scan reads them: no initial state; compact chunk states and
    no final state). ``solve_u``: the caller hands ``x`` to the scan that writes the output
    (_scan_and_output, the pool's prefill), which may then form U' itself from Tm
    (_solve_u_serves): W's buffer keeps Kb, ``x["u"]`` is ``v`` and ``x["tm_solve"]`` Tm."""
    B, T, HV, K, V, NC = s["B"], s["T"], s["HV"], s["K"], s["V"], s["NC"]
    f32 = dict(device=q.device, dtype=torch.float32)
    prec = _dot_precision(q.dtype)
    fresh = out is None
    if out is None:
        operand = dict(device=q.device, dtype=scan_operand_dtype(q.dtype))
        out = dict(
            gam=torch.empty(B, T, HV, K, **f32),
            akk=torch.empty(B, T, HV, BT, device=q.device, dtype=akk_dtype(q.dtype)),
            aqk=torch.empty(B, T, HV, BT, device=q.device, dtype=aqk_dtype(q.dtype)),
            # Traced: flat with one spare entry, so that no dimension of it is NC,
            # whose contiguity check would guard NC != 1 (i.e. T > 64).
            steep=(torch.empty(B * NC * HV + 1, device=q.device, dtype=torch.int32) if traced
                   else torch.empty(B, NC, HV, device=q.device, dtype=torch.int32)),
            qg=torch.empty(B, T, HV, K, **operand),
            kr=torch.empty(B, T, HV, K, **operand),
            w=torch.empty(B, T, HV, K, **operand),
            u=torch.empty(B, T, HV, V, device=q.device, dtype=residual_dtype(q.dtype)),
            tm=torch.empty(B, T, HV, BT, device=q.device, dtype=tm_dtype(q.dtype)) if store_tm else None,
        )
    gam, akk, aqk, steep, qg, kr, w, u = (out[n] for n in ("gam", "akk", "aqk", "steep", "qg", "kr", "w", "u"))
    tm = out["tm"] if store_tm else akk.new_empty(0)  # not written without STORE_TM
    common = dict(H=s["H"], HV=HV, K=K, BT=BT, DOT_PREC=prec, MAX_SPLIT=MAX_SPLIT, IS_VARLEN=s["IS_VARLEN"])
    if (solve_u and _intra_fused_tm_serves(s, gate, traced, q.dtype)
            and _solve_u_serves(s, w, kb_handed=True, fresh=fresh, traced=traced)):
        # the fused stage's TM_ONLY form for the scan that forms U' (settings.INTRA_FUSED_TM_ONLY):
        # Kb into W's buffer, Tm alone (bf16)
        tm = torch.empty(B, T, HV, BT, device=q.device, dtype=torch.bfloat16)
        _intra_fused_fwd(q, k, v, g, beta, scale, s, out, prec, common, traced, _gate_args(gate, g), store_tm,
                         qg_first, kr_last, w_first, tm_only=tm)
        return dict(gam=gam, akk=akk, aqk=aqk, w=w, u=v, tm=None, steep=steep, qg=qg, kr=kr, tm_solve=tm, beta=beta)
    if _intra_fused_serves(s, store_tm, gate, traced):
        _intra_fused_fwd(q, k, v, g, beta, scale, s, out, prec, common, traced, _gate_args(gate, g), store_tm,
                         qg_first, kr_last, w_first)
        return dict(gam=gam, akk=akk, aqk=aqk, w=w, u=u, tm=(tm if store_tm else None), steep=steep, qg=qg, kr=kr)
    regs = dict(maxnreg=S.INTRA_A_FWD_MAXNREG) if S.INTRA_A_FWD_MAXNREG else {}
    # short packed sequences (settings.SHORT_TILE): the chunks of at most SHORT_TILE rows
    # on smaller tiles, picked per program (SHORT_TILE_LAUNCHES 1) or in launches of
    # their own that the launches at BT skip (2); they need gam from its own launch
    short_tiles = bool(S.SHORT_TILE) and s["SHORT"] and not traced
    # gam formed inside intra_a_fwd and kept on chip, Kb handed to intra_wu_fwd instead
    # (settings.INTRA_A_GAM_ON_CHIP): where nothing is kept and there is no gate to apply
    on_chip = _gam_on_chip_serves(store_tm, gate, short_tiles, q.dtype)
    ga = _gate_args(gate, g)
    # gam_fwd's spreads of each chunk (per K block), for intra_a_fwd's choice of path,
    # unless fla's gate makes every log decay <= 0 (the softplus form, or lower_bound
    # <= 0): intra_a_fwd then reads them off rows of gam (settings.GAM_ROW_SPREADS)
    row_spreads = bool(S.GAM_ROW_SPREADS) and (ga["GATE"] == 1 or (ga["GATE"] == 2 and ga["lower_bound"] <= 0))
    a_rows = _a_row_programs_serve(ga, row_spreads)
    # the row programs hand Kb to intra_wu_fwd as intra_a_fwd does with gam on chip
    # (settings.INTRA_A_ROWS_KBG)
    rows_kbg = a_rows and _rows_kbg_serves(store_tm, q.dtype)
    # ... and form gam themselves from the raw gate, so that gam_fwd does not run
    # (settings.INTRA_A_ROWS_GAM_ON_CHIP)
    rows_on_chip = rows_kbg and _rows_gam_on_chip_serves()
    # gam through memory (gam_fwd.py) unless one of those forms it on chip
    gam_kernel = (bool(S.INTRA_GAM_KERNEL) or gate is not None) and not on_chip and not rows_on_chip
    # Kb goes into W's buffer, which intra_wu_fwd overwrites with W = Tm Kb in place (each
    # program reads its chunk's rows of a K slice of Kb before it writes W's there), so gam on
    # chip costs no memory; traced, a buffer of its own (a launch passes no tensor twice: see
    # _stand_in)
    if on_chip or rows_kbg:
        kbg = torch.empty_like(w) if traced else w
    else:
        kbg = _stand_in(w, traced)
    NKB = _cdiv(K, S.BKG)
    spreads = torch.empty(B * NC * HV * NKB * 2, **f32) if gam_kernel and not row_spreads else _stand_in(gam, traced)
    if gam_kernel:
        _kernel(kda_gam_fwd_kernel, traced)[(NC, B * HV, NKB)](
            g, gam, spreads, ga["A_log"], ga["dt_bias"], ga["lower_bound"], *s["VL_CHUNK"], T, NC, H=s["H"], HV=HV,
            K=K, BT=BT, BKG=S.BKG, GATE=ga["GATE"], HAS_A=ga["HAS_A"], HAS_BIAS=ga["HAS_BIAS"],
            IS_VARLEN=s["IS_VARLEN"], BC=BC, SPREADS=not row_spreads, num_warps=S.GAM_WARPS,
        )
    # intra_wu_fwd's tiles of short chunks also where the row programs form gam (handed Kb,
    # it reads no gam)
    tile = S.SHORT_TILE if (short_tiles and (gam_kernel or rows_on_chip)) else 0
    tilings = _tilings(tile)
    if a_rows:
        # one program per 16-row block (intra_a_fwd_rows.py): a short chunk's blocks past
        # its rows return at once, so no tiles
        _kernel(kda_intra_a_fwd_rows_kernel, traced)[(BT // BC, NC, B * HV)](
            q, k, gam, akk, aqk, steep, qg, kr, *s["VL_CHUNK"], scale, T, NC, H=s["H"], HV=HV, K=K, BT=BT, BC=BC,
            BKA=S.INTRA_A_ROWS_BK, DOT_PREC=prec, MAX_SPLIT=MAX_SPLIT, INTERPRET=_INTERPRET, IS_VARLEN=s["IS_VARLEN"],
            QG_FIRST=qg_first, KR_LAST=kr_last, FAST_EXP=_fast_exp(), beta=beta, kbg=kbg, KBG=rows_kbg,
            g=g, A_log=ga["A_log"], dt_bias=ga["dt_bias"], lower_bound=ga["lower_bound"], GATE=ga["GATE"],
            HAS_A=ga["HAS_A"], HAS_BIAS=ga["HAS_BIAS"], GAM_ON_CHIP=rows_on_chip,
            num_warps=S.INTRA_A_ROWS_WARPS, num_stages=S.INTRA_A_ROWS_STAGES,
            **(dict(maxnreg=S.INTRA_A_ROWS_MAXNREG) if S.INTRA_A_ROWS_MAXNREG else {}),
        )
    if S.INTRA_A_SPREAD_TILE not in (0, 1, 2):  # the kernel would read any other value as 1
        raise ValueError(f"settings.INTRA_A_SPREAD_TILE: expected 0, 1 or 2, got {S.INTRA_A_SPREAD_TILE!r}")
    for tiling in (() if a_rows else tilings):
        _kernel(kda_intra_a_fwd_kernel, traced)[(NC, B * HV)](
            q, k, g, gam, spreads, akk, aqk, steep, qg, kr, *s["VL_CHUNK"], scale, T, NC, **common, BKA=S.BKA,
            SPREAD_TILE=int(S.INTRA_A_SPREAD_TILE), GAM_IN=gam_kernel, INTERPRET=_INTERPRET,
            NKB=NKB, BLOCK_REFS=bool(S.INTRA_A_BLOCK_REFS), BC=BC, ROW_SPREADS=row_spreads,
            BKR=min(128, _pow2(K)), QG_FIRST=qg_first, KR_LAST=kr_last, FAST_EXP=_fast_exp(),
            MODE_LOOPS=bool(S.INTRA_A_MODE_LOOPS), **tiling,
            beta=beta, kbg=kbg, STORE_GAM=not on_chip, KBG=on_chip,
            num_warps=S.INTRA_A_FWD_WARPS, num_stages=S.INTRA_A_FWD_STAGES, **regs,
        )
    if not _no_steep_launch(ga):
        _steep_a_fwd(q, k, gam, akk, aqk, steep, scale, s, common, traced)
    # the diagonal blocks' inverses in programs of their own (settings.INTRA_DIAG_INV_KERNEL)
    diag_inv = bool(S.INTRA_DIAG_INV_KERNEL)
    dinv = torch.empty(B, T, HV, BC, **f32) if diag_inv else _stand_in(akk, traced)  # a stand-in, never read
    if diag_inv:
        if S.DIAG_INV_BLOCKS not in (1, 2, 4):
            raise ValueError(f"settings.DIAG_INV_BLOCKS: expected 1, 2 or 4, got {S.DIAG_INV_BLOCKS!r}")
        _kernel(kda_diag_inv_kernel, traced)[(BT // BC // S.DIAG_INV_BLOCKS, NC, B * HV)](
            akk, beta, dinv, *s["VL_CHUNK"], T, NC, H=s["H"], HV=HV, BT=BT, BC=BC, IS_VARLEN=s["IS_VARLEN"],
            NBLK=S.DIAG_INV_BLOCKS, num_warps=S.DIAG_INV_WARPS,
        )
    two_warp_bf16 = q.dtype == torch.bfloat16 and s["BK"] <= 128
    wu_warps = S.INTRA_WU_FWD_WARPS_BF16 if two_warp_bf16 else S.INTRA_WU_FWD_WARPS
    # the register cap was measured on the two-warp bf16 path only
    wu_cap = S.INTRA_WU_FWD_MAXNREG if two_warp_bf16 else None
    # Tm alone (bf16), the scan forming U' from it (settings.FUSED_OUTPUT_SOLVE_U)
    tm_only = solve_u and _solve_u_serves(s, w, kb_handed=on_chip or rows_kbg, fresh=fresh, traced=traced)
    if tm_only:
        u = out["u"] = v  # the scan reads V where it would read U (the unused buffer goes)
        tm = torch.empty(B, T, HV, BT, device=q.device, dtype=torch.bfloat16)
    for tiling in tilings:
        _kernel(kda_intra_wu_fwd_kernel, traced)[(NC, B * HV)](
            k, v, beta, gam, akk, dinv, w, u, tm, *s["VL_CHUNK"], T, NC, DINV_IN=diag_inv, TM_ONLY=tm_only,
            H=s["H"], HV=HV, K=K, V=V, BT=BT, BC=BC, BK=S.INTRA_WU_BK or s["BK"], BV=S.INTRA_WU_BV or s["BV"],
            STORE_TM=store_tm, DOT_PREC=prec, TM_ROW_LOADS=S.TM_ROW_LOADS,
            BF16_DOTS=s["WU_BF16_DOTS"], INTERPRET=_INTERPRET, IS_VARLEN=s["IS_VARLEN"],
            W_FIRST=w_first, FAST_EXP=_fast_exp(), **tiling, steep=_stand_in(steep, traced), ONLY_STEEP=False,
            kbg=kbg, KBG_IN=on_chip or rows_kbg, num_warps=wu_warps, **(dict(maxnreg=wu_cap) if wu_cap else {}),
        )
    x = dict(gam=gam, akk=akk, aqk=aqk, w=w, u=u, tm=(tm if store_tm else None), steep=steep, qg=qg, kr=kr)
    if tm_only:
        x.update(tm_solve=tm, beta=beta)
    return x


def _solve_u_serves(s: dict, w: Tensor, kb_handed: bool, fresh: bool, traced: bool) -> bool:
    """Whether the scan that writes the output forms U' = Tm (diag(beta) V - Kb S) itself
    (settings.FUSED_OUTPUT_SOLVE_U, state_output_fwd.py's SOLVE_U), intra_wu_fwd then
    forming Tm alone (bf16): where Kb is handed on in W's buffer (``kb_handed``: gam on
    chip, or the row programs' Kb), the intermediates are this call's own (``fresh``: none
    kept), the launches are not traced, and that scan serves (_fused_output_launch)."""
    if S.FUSED_OUTPUT_SOLVE_U not in (0, 1):
        raise ValueError(f"settings.FUSED_OUTPUT_SOLVE_U: expected 0 or 1, got {S.FUSED_OUTPUT_SOLVE_U!r}")
    return (bool(S.FUSED_OUTPUT_SOLVE_U) and kb_handed and fresh and not traced
            and _fused_output_launch(s, {"w": w}) is not None)


def _rows_kbg_serves(store_tm: bool, input_dtype: torch.dtype) -> bool:
    """Whether the row programs (intra_a_fwd_rows.py), where they form the A's, also store
    Kb = diag(beta) K exp(gam) for intra_wu_fwd's W, which then reads neither K nor gam
    (settings.INTRA_A_ROWS_KBG): where nothing is kept (the backward recomputes W from K and
    gam) and on bf16 inputs, whose Kb is bf16 in W's buffer (intra_wu_fwd overwrites it
    with W in place), as for gam on chip."""
    if S.INTRA_A_ROWS_KBG not in (0, 1):
        raise ValueError(f"settings.INTRA_A_ROWS_KBG: expected 0 or 1, got {S.INTRA_A_ROWS_KBG!r}")
    return bool(S.INTRA_A_ROWS_KBG) and not store_tm and input_dtype == torch.bfloat16


def _rows_gam_on_chip_serves() -> bool:
    """Whether the row programs, where they hand Kb on (_rows_kbg_serves), also form gam from
    the raw gate themselves (settings.INTRA_A_ROWS_GAM_ON_CHIP): gam_fwd does not run, and of
    gam only each chunk's last row is stored (the scans' decay)."""
    if S.INTRA_A_ROWS_GAM_ON_CHIP not in (0, 1):
        raise ValueError(f"settings.INTRA_A_ROWS_GAM_ON_CHIP: expected 0 or 1, got {S.INTRA_A_ROWS_GAM_ON_CHIP!r}")
    return bool(S.INTRA_A_ROWS_GAM_ON_CHIP)


def _gam_on_chip_serves(store_tm: bool, gate: Optional[tuple], short_tiles: bool, input_dtype: torch.dtype) -> bool:
    """Whether intra_a_fwd forms gam itself and hands Kb = diag(beta) K exp(gam) to
    intra_wu_fwd (settings.INTRA_A_GAM_ON_CHIP), so that gam never goes through memory but
    each chunk's last row (the scans' decay) and a steep chunk's rows (the steep launch's):
    where nothing is kept (the backward reads gam), without fla's in-kernel gate (gam_fwd.py
    applies it), not on short packed sequences' tiles, and on bf16 inputs, whose Kb is bf16.
    Other inputs would hand Kb over in fp32: more bytes than K and gam (timed slower on bf16
    inputs), and under Triton 3.6-3.8 intra_wu_fwd's W dot would then read the tile its async
    copy wrote without a proxy fence (tests/test_kernel_resources.py)."""
    if S.INTRA_A_GAM_ON_CHIP not in (0, 1):
        raise ValueError(f"settings.INTRA_A_GAM_ON_CHIP: expected 0 or 1, got {S.INTRA_A_GAM_ON_CHIP!r}")
    return (bool(S.INTRA_A_GAM_ON_CHIP) and not store_tm and gate is None and not short_tiles
            and input_dtype == torch.bfloat16)


def _steep_a_fwd(q, k, gam, akk, aqk, steep, scale, s: dict, common: dict, traced: bool) -> None:
    """The A's of the chunks flagged 2 (intra_a_fwd.py's steep launch): a work list
    (settings.STEEP_WORK_LIST) or one program per chunk, head (and row block)."""
    B, T, HV, NC = s["B"], s["T"], s["HV"], s["NC"]
    row_programs = bool(S.STEEP_FWD_ROW_PROGRAMS)
    sub = BT // BC if row_programs else 1
    work_list = _work_list(B * NC * HV * sub, q.device)
    _kernel(kda_intra_a_fwd_steep_kernel, traced)[work_list or (NC, B * HV, sub)](
        q, k, gam, akk, aqk, steep, *s["VL_CHUNK"], scale, T, NC, n_flags=B * NC * HV,
        **(common | dict(DOT_PREC=_steep_dot_precision(q.dtype))),
        BC=BC, BKS=S.BKS, INTERPRET=_INTERPRET, ROW_PROGRAMS=row_programs,
        BLOCK_REFS=bool(S.STEEP_BLOCK_REFS), WORK_LIST=work_list is not None, WL_BLOCK=S.WORK_LIST_BLOCK,
        num_warps=4,
    )


def _check_intra_fused_settings() -> None:
    """The fused stage's settings that the kernel would otherwise misread, refused by name."""
    if S.INTRA_FUSED_FWD not in (0, 1, 2):
        raise ValueError(f"settings.INTRA_FUSED_FWD: expected 0, 1 or 2, got {S.INTRA_FUSED_FWD!r}")
    if S.INTRA_FUSED_TM_ONLY not in (0, 1):
        raise ValueError(f"settings.INTRA_FUSED_TM_ONLY: expected 0 or 1, got {S.INTRA_FUSED_TM_ONLY!r}")
    if S.INTRA_FUSED_BLOCK_REFS not in (0, 1, 2):
        raise ValueError(f"settings.INTRA_FUSED_BLOCK_REFS: expected 0, 1 or 2, got {S.INTRA_FUSED_BLOCK_REFS!r}")
    if S.INTRA_FUSED_DIAG_INV not in (0, 1):
        raise ValueError(f"settings.INTRA_FUSED_DIAG_INV: expected 0 or 1, got {S.INTRA_FUSED_DIAG_INV!r}")


def _intra_fused_takes(s: dict, gate: Optional[tuple], traced: bool) -> bool:
    """Whether the fused stage (intra_fused_fwd.py, either form) takes these inputs: not
    short packed sequences (their tiles), fla's gate only where INTRA_FUSED_WITH_GATE
    (slower there: settings.py). Its settings are checked here."""
    _check_intra_fused_settings()
    short_tiles = bool(S.SHORT_TILE) and s["SHORT"] and not traced
    return not short_tiles and (gate is None or bool(S.INTRA_FUSED_WITH_GATE))


def _intra_fused_serves(s: dict, store_tm: bool, gate: Optional[tuple], traced: bool) -> bool:
    """Whether the intra-chunk stage runs as one launch (settings.INTRA_FUSED_FWD,
    intra_fused_fwd.py): where nothing is kept for the backward (1), or also where Tm
    is (2: the forward that keeps its intermediates, the backward's recompute), on the
    inputs the fused stage takes (_intra_fused_takes)."""
    return (_intra_fused_takes(s, gate, traced) and bool(S.INTRA_FUSED_FWD)
            and (S.INTRA_FUSED_FWD == 2 or not store_tm))


def _intra_fused_tm_serves(s: dict, gate: Optional[tuple], traced: bool, input_dtype: torch.dtype) -> bool:
    """Whether, where the scan forms U' from Tm (the caller also asks _solve_u_serves), the
    intra-chunk stage runs as the fused stage's TM_ONLY launch (settings.INTRA_FUSED_TM_ONLY):
    on bf16 inputs (Kb and Tm in bf16) that the fused stage takes (_intra_fused_takes)."""
    return (_intra_fused_takes(s, gate, traced) and bool(S.INTRA_FUSED_TM_ONLY)
            and input_dtype == torch.bfloat16)


def _intra_fused_fwd(q, k, v, g, beta, scale, s: dict, out: dict, prec: str, common: dict, traced: bool, ga: dict,
                     store_tm: bool, qg_first: bool, kr_last: bool, w_first: bool,
                     tm_only: Optional[Tensor] = None) -> None:
    """_intra_fwd's work in one launch (intra_fused_fwd.py) into ``out``'s tensors; the
    steep chunks it flags 2 then through the steep launch (their A's) and intra_wu_fwd's
    ONLY_STEEP launch (their Tm, W and U), which do not run where no chunk can be
    flagged 2 (fla's bounded gate with block references: _no_steep_launch). ``ga``:
    the gate's arguments (_host._gate_args). gam holds each chunk's last row (the scan's
    decay), and a steep chunk's every row; A_kk only steep chunks'. fp32 inputs take the
    diagonal inverses by substitution whatever INTRA_FUSED_DIAG_INV says (the product's
    cancellations cost them two digits: tests/test_intra_fused_fwd.py). ``tm_only``: the
    TM_ONLY form (_intra_fused_tm_serves) into this bf16 [B, T, HV, BT] Tm, Kb into W's
    buffer, neither W nor U (the steep chunks' Tm by intra_wu_fwd's TM_ONLY alike)."""
    B, T, HV, K, V, NC = s["B"], s["T"], s["HV"], s["K"], s["V"], s["NC"]
    gam, akk, aqk, steep, qg, kr, w, u = (out[n] for n in ("gam", "akk", "aqk", "steep", "qg", "kr", "w", "u"))
    tm = out["tm"] if store_tm else _stand_in(akk, traced)  # a stand-in without STORE_TM, never written
    if tm_only is not None:
        tm = tm_only
        warps, stages, cap = S.INTRA_FUSED_TM_ONLY_WARPS, S.INTRA_FUSED_TM_ONLY_STAGES, S.INTRA_FUSED_TM_ONLY_MAXNREG
    else:
        # the cap was timed on bf16 inputs; fp32 ones (fp32 operands) spill 3.3 KB under it
        warps, stages = S.INTRA_FUSED_WARPS, S.INTRA_FUSED_STAGES
        cap = S.INTRA_FUSED_MAXNREG if q.dtype != torch.float32 else None
    # fla's gate forms (softplus; lower_bound <= 0) make every log decay <= 0
    nonpositive = ga["GATE"] == 1 or (ga["GATE"] == 2 and ga["lower_bound"] <= 0)
    # the kernel's own block references (settings.INTRA_FUSED_BLOCK_REFS)
    block_refs = bool(S.INTRA_A_BLOCK_REFS) and (S.INTRA_FUSED_BLOCK_REFS == 2
                                                 or (S.INTRA_FUSED_BLOCK_REFS == 1 and ga["GATE"] > 0))
    _kernel(kda_intra_fused_fwd_kernel, traced)[(NC, B * HV)](
        q, k, v, g, beta, gam, aqk, steep, qg, kr, w, u, akk, tm, ga["A_log"], ga["dt_bias"], ga["lower_bound"],
        *s["VL_CHUNK"], scale, T, NC, H=s["H"], HV=HV, K=K, V=V,
        BT=BT, BC=BC, BKA=S.INTRA_FUSED_BKA, BK=S.INTRA_FUSED_BK, BV=S.INTRA_FUSED_BV, DOT_PREC=prec,
        MAX_SPLIT=MAX_SPLIT, DIAG_INV_METHOD=S.INTRA_FUSED_DIAG_INV if q.dtype != torch.float32 else 0,
        BF16_DOTS=s["WU_BF16_DOTS"],
        INTERPRET=_INTERPRET, IS_VARLEN=s["IS_VARLEN"], QG_FIRST=qg_first, KR_LAST=kr_last, W_FIRST=w_first,
        FAST_EXP=_fast_exp(), GATE=ga["GATE"], HAS_A=ga["HAS_A"], HAS_BIAS=ga["HAS_BIAS"],
        BLOCK_REFS=block_refs, NONPOSITIVE=nonpositive, STORE_TM=store_tm, TM_ONLY=tm_only is not None,
        num_warps=warps, num_stages=stages, **(dict(maxnreg=cap) if cap else {}),
    )
    if block_refs and _no_steep_launch(ga):  # fla's bounded gate: every chunk split or by block references here
        return
    _steep_a_fwd(q, k, gam, akk, aqk, steep, scale, s, common, traced)
    _kernel(kda_intra_wu_fwd_kernel, traced)[(NC, B * HV)](
        k, v, beta, gam, akk, _stand_in(akk, traced), w, u, tm, *s["VL_CHUNK"], T, NC, DINV_IN=False,
        H=s["H"], HV=HV, K=K, V=V, BT=BT, BC=BC, BK=S.INTRA_WU_BK or s["BK"], BV=S.INTRA_WU_BV or s["BV"],
        STORE_TM=store_tm, DOT_PREC=prec, TM_ROW_LOADS=S.TM_ROW_LOADS, BF16_DOTS=s["WU_BF16_DOTS"],
        INTERPRET=_INTERPRET, IS_VARLEN=s["IS_VARLEN"], W_FIRST=w_first, FAST_EXP=_fast_exp(),
        steep=steep, ONLY_STEEP=True, kbg=_stand_in(w, traced), KBG_IN=False, TM_ONLY=tm_only is not None,
        num_warps=4,
    )


def kda_fwd_triton(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    scale: Optional[float], initial_state: Optional[Tensor],
    keep_intermediates: bool = False, gate: Optional[tuple] = None, cu_seqlens: Optional[Tensor] = None,
    output_final_state: bool = True, keep_chunk_states: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Chunked forward: ``(o, final_state, chunk_states, intermediates)`` as
    ``chunk_kda_fwd``. ``intermediates`` is the flat uint8 buffer of
    ``kda_op._contract.intermediates_layout`` when ``keep_intermediates``, else
    empty; with it the backward skips recomputing the intra-chunk stage.
    ``gate``: None, or fla's in-kernel gate ``(A_log, dt_bias, lower_bound)``
    with ``g`` the raw gate (``_host._gate_args``). ``cu_seqlens``: N sequences
    packed along T (B = 1; _indexing.py); states are then [N, HV, K, V] and the
    chunk states ``_contract.varlen_state_slots`` slots (fewer without an initial state). ``output_final_state=False``:
    the final state is empty ([0]), never stored. ``keep_chunk_states=False``: the
    chunk states are empty ([0]); stored nowhere where the scan writes the output
    (settings.FUSED_OUTPUT), else into a buffer of this call's own."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    s = _sizes(q, v, cu_seqlens=cu_seqlens, has_initial_state=initial_state is not None)
    B, T, HV, K, V, NC = s["B"], s["T"], s["HV"], s["K"], s["V"], s["NC"]
    scale = K**-0.5 if scale is None else float(scale)
    f32 = dict(device=q.device, dtype=torch.float32)
    h0 = None if initial_state is None else initial_state.contiguous()

    layout, nbytes = _layout(q, v, cu_seqlens) if keep_intermediates else ([], 0)
    intermediates = torch.empty(nbytes, device=q.device, dtype=torch.uint8)
    if keep_intermediates:
        _zero_alignment_gaps(intermediates, layout, nbytes)
    chunk_states = _new_chunk_states(q, s, empty=not keep_chunk_states)
    # Short sequences: one token-by-token launch, unless the backward wants the
    # chunked intermediates (or the sequences are packed: their chunk states are
    # laid out per sequence).
    if 0 < T <= S.RECURRENT_MAX_T and not keep_intermediates and cu_seqlens is None:
        with _range("kda_op::fwd::recurrent"):
            o, ht = kda_recurrent_fwd_triton(q, k, v, g, beta, scale, h0, gate=gate)
        if keep_chunk_states:
            if h0 is None:
                chunk_states[:, 0].zero_()
            else:
                chunk_states[:, 0].copy_(h0)
            chunk_states[:, 1].copy_(ht)
        return o, (ht if output_final_state else ht.new_empty(0)), chunk_states, intermediates
    if NC > 0 and T > 0 and s["NSEQ"] * HV > 0 and not keep_intermediates and _one_pass_serves(q, s, gate):
        # the whole forward in one launch (settings.ONE_PASS_FWD)
        with _range("kda_op::fwd::one_pass"):
            o, ht, _ = kda_one_pass_fwd(q, k, v, g, beta, scale, h0, output_final_state=output_final_state,
                                        chunk_states=chunk_states if keep_chunk_states else None,
                                        block_v=S.ONE_PASS_BV, block_k_a=S.ONE_PASS_BKA,
                                        num_warps=S.ONE_PASS_WARPS, num_stages=S.ONE_PASS_STAGES)
        return o, (ht if output_final_state else torch.empty(0, **f32)), chunk_states, intermediates
    ht = torch.empty(s["NSEQ"], HV, K, V, **f32) if output_final_state else torch.empty(0, **f32)
    o = torch.empty(B, T, HV, V, device=q.device, dtype=v.dtype)
    if s["NSEQ"] * HV == 0:
        return o, ht, chunk_states, intermediates
    # the forward forms nothing that nothing reads (settings.SKIP_UNREAD): a one-chunk
    # sequence's leaving state that nothing keeps; and where it keeps nothing, for
    # packed sequences without initial states, the first chunks' U' (their U, read
    # there by the output kernel rather than copied by the scan), and the intra-chunk
    # stage's Qg, W and Kr where nothing reads them
    unread_skips = bool(S.SKIP_UNREAD) and not keep_intermediates
    first_from_u = unread_skips and s["IS_VARLEN"] and h0 is None
    if NC > 0 and T > 0:
        with _range("kda_op::fwd::intra"):
            kept = _intermediates_views(intermediates, layout) if keep_intermediates else None
            x = _intra_fwd(q, k, v, g, beta, scale, s, store_tm=keep_intermediates, out=kept, gate=gate,
                           qg_first=not unread_skips or h0 is not None, w_first=not first_from_u,
                           kr_last=not unread_skips or not s["COMPACT_STATES"] or output_final_state,
                           solve_u=not keep_intermediates)
    else:  # T == 0: the scan only copies the initial state through
        x = {name: torch.empty(0, **f32) for name in ("gam", "aqk", "w", "u", "qg", "kr")}
    kept_up = keep_intermediates and NC > 0 and T > 0
    _scan_and_output(x, h0, kept["up"] if kept_up else None, o, ht if output_final_state else None,
                     chunk_states if keep_chunk_states else None, s, q, first_from_u=first_from_u)
    return o, ht, chunk_states, intermediates


def _scan_and_output(x: dict, h0: Optional[Tensor], up: Optional[Tensor], o: Tensor, ht: Optional[Tensor],
                     chunk_states: Optional[Tensor], s: dict, q: Tensor, first_from_u: bool = False) -> None:
    """Stages 2 and 3 from the intra-chunk stage's ``x``: the scan that writes the output
    (settings.FUSED_OUTPUT, where _fused_output_launch says), else the scan and the output
    kernel, which pass the chunk states through memory (``chunk_states``, or a buffer of
    this call's own). ``up``: where U' is kept, else None (a buffer of its own where the
    output kernel reads it). ``first_from_u``: packed sequences without h0, whose first
    chunks' U' the output reads as U. Without a chunk (T = 0) the scan only copies the
    initial state through."""
    prec = _dot_precision(q.dtype)
    has_chunks = s["NC"] > 0 and s["T"] > 0
    launch = _fused_output_launch(s, x) if has_chunks else None
    if launch is None and x.get("tm_solve") is not None:
        raise AssertionError("Tm alone was formed for a scan that does not write the output (_solve_u_serves)")
    if launch is not None:
        # U' and the chunk states only where kept
        with _range("kda_op::fwd::state_scan_output"):
            _state_output_fwd(x, h0, up, chunk_states, ht, o, s, prec, launch, traced=False)
        return
    states = chunk_states if chunk_states is not None else _new_chunk_states(q, s)
    if up is None:
        up = torch.empty(s["B"], s["T"], s["HV"], s["V"], device=q.device, dtype=residual_dtype(q.dtype))
    with _range("kda_op::fwd::state_scan"):
        _state_scan_fwd(x, h0, up, states, ht, s, prec, traced=False, first_up=not first_from_u,
                        skip_unkept_state=bool(S.SKIP_UNREAD))
    if has_chunks:
        with _range("kda_op::fwd::output"):
            _output_fwd(x, up, states, o, s, prec, traced=False, has_h0=h0 is not None, first_from_u=first_from_u)


def _new_chunk_states(q: Tensor, s: dict, empty: bool = False) -> Tensor:
    """An uninitialised chunk-state buffer [B, NCS, HV, K, V] in the dtype the kernels keep
    them in (``empty``: [0], for a caller that keeps none)."""
    shape = (0,) if empty else (s["B"], s["NCS"], s["HV"], s["K"], s["V"])
    return torch.empty(shape, device=q.device, dtype=chunk_states_dtype(q.dtype, _SERVES))


def _one_pass_serves(q: Tensor, s: dict, gate: Optional[tuple]) -> bool:
    """Whether the forward runs in one launch (settings.ONE_PASS_FWD, one_pass_fwd.py):
    on fixed-length bf16 inputs with K <= 128 and g given (what it was built for: no
    packed sequences nor in-kernel gate yet; fp32 operands spill 4.9 KB at sm_90a), where
    its programs (B * HV * V blocks, each walking a whole sequence) number at least
    ONE_PASS_MIN_PROGRAMS_PER_SM an SM. The caller keeps no intermediates."""
    if S.ONE_PASS_FWD not in (0, 1):
        raise ValueError(f"settings.ONE_PASS_FWD: expected 0 or 1, got {S.ONE_PASS_FWD!r}")
    if not S.ONE_PASS_FWD:
        return False
    programs = s["B"] * s["HV"] * _cdiv(s["V"], S.ONE_PASS_BV)
    return (gate is None and not s["IS_VARLEN"] and q.dtype == torch.bfloat16 and s["K"] <= 128
            and programs >= S.ONE_PASS_MIN_PROGRAMS_PER_SM * _sm_count(q.device))


# The fused scan's V-block floor on a GPU, below any FUSED_OUTPUT_MIN_BV: in V blocks of 32 its
# sm_90 build (Triton 3.6; H100 and H200, 2026-12-06, profiling/fused_scan_diff.py) gives
# wrong outputs and states, rows 16.. of each chunk on (the rows of warps 1-3), differing from
# run to run, at every size tried (K 48 to 128, V 40 to 128), and an illegal memory access at
# K = V = 128; the same kernel in V blocks of 64 gave the scan-then-output's bits (K 32 to 128,
# V 40 to 256). The defaults fuse only at 64 (FUSED_OUTPUT_MIN_BV); this keeps a lowered
# setting from reaching the broken build. The interpreter runs V blocks of 32 (its tests'
# small sizes). profiling/mma_chain_repro.py holds the pattern alone (benchmarks/NOTES.md).
_FUSED_OUTPUT_DEVICE_MIN_BV = 64


def _fused_output_launch(s: dict, x: dict) -> Optional[tuple[int, int]]:
    """Whether the forward scan writes the output itself (settings.FUSED_OUTPUT,
    state_output_fwd.py), and if so at how many warps and pipeline stages; None where not.
    It does where its V block is at least FUSED_OUTPUT_MIN_BV, i.e. where its programs
    fill the device (where they are few, the output's dots would lengthen each chunk's step
    of a latency-bound scan), and on bf16 operands (bf16 inputs) with K <= 128, what it was
    built for: on fp32 operands it spills 0.6-7 KB (sm_90a, TF32 dots), and at K = 256 with
    fp16 inputs it needs more shared memory than the H200 has. On a GPU never below V
    blocks of 64 (_FUSED_OUTPUT_DEVICE_MIN_BV).
    Where its programs outnumber FUSED_OUTPUT_MIN_PROGRAMS_PER_SM an SM it takes
    FUSED_OUTPUT_WARPS / _STAGES; at one an SM or fewer the fused step, longer than the
    scan's, sets the time (timed, settings.py): fused there only under FUSED_OUTPUT_ONE_WAVE,
    at FUSED_OUTPUT_ONE_WAVE_WARPS / _STAGES. A sequence count that stays symbolic (the
    export op) counts as one, as for the V block: no guard."""
    if S.FUSED_OUTPUT not in (0, 1):
        raise ValueError(f"settings.FUSED_OUTPUT: expected 0 or 1, got {S.FUSED_OUTPUT!r}")
    if S.FUSED_OUTPUT_ONE_WAVE not in (0, 1):
        raise ValueError(f"settings.FUSED_OUTPUT_ONE_WAVE: expected 0 or 1, got {S.FUSED_OUTPUT_ONE_WAVE!r}")
    nseq = s["NSEQ"] if isinstance(s["NSEQ"], int) else 1
    programs = nseq * s["HV"] * _cdiv(s["V"], s["BV_SCAN_FWD"])
    min_bv = S.FUSED_OUTPUT_MIN_BV if _INTERPRET else max(S.FUSED_OUTPUT_MIN_BV, _FUSED_OUTPUT_DEVICE_MIN_BV)
    if not (S.FUSED_OUTPUT and s["BV_SCAN_FWD"] >= min_bv and x["w"].dtype == torch.bfloat16 and s["BK"] <= 128):
        return None
    if programs > S.FUSED_OUTPUT_MIN_PROGRAMS_PER_SM * _sm_count(x["w"].device):
        return S.FUSED_OUTPUT_WARPS or s["SCAN_FWD_WARPS"], S.FUSED_OUTPUT_STAGES
    if S.FUSED_OUTPUT_ONE_WAVE:
        return S.FUSED_OUTPUT_ONE_WAVE_WARPS, S.FUSED_OUTPUT_ONE_WAVE_STAGES
    return None


def _stand_in(tensor: Tensor, traced: bool) -> Tensor:
    """What a launch passes for a pointer its kernel will not touch (an absent h0, ht, slots,
    ...): ``tensor`` itself, or under tracing a one-element tensor of its own. Functionalised,
    every pointer that may flow to a store is cloned and written back on its own (inductor and
    torch.export see the scans' stores to ht through scan_ends, which takes h0, ht and slots);
    a stand-in that aliases a tensor the kernel does write then writes its unchanged clone
    back over it. On the GPU (thirty-third session) the compiled export op's final states came
    out as uninitialised memory that way: slots stood in as ht."""
    return torch.empty(1, device=tensor.device, dtype=tensor.dtype) if traced else tensor


def _state_output_fwd(x: dict, h0: Optional[Tensor], up: Optional[Tensor], chunk_states: Optional[Tensor],
                      ht: Optional[Tensor], o: Tensor, s: dict, prec: str, launch: tuple[int, int], traced: bool,
                      slots: Optional[Tensor] = None, v_first: bool = False) -> None:
    """Stages 2 and 3 in one launch (state_output_fwd.py): the scan over chunks
    writing ``o``, and where given (not None) U' into ``up``, the chunk states into
    ``chunk_states`` (for packed sequences with zeros in the slots past the last
    one's, as _state_scan_fwd) and the final states into ``ht``. ``slots``: h0 and ht
    are one state pool, read and written at those slots; a negative slot outputs
    zeros."""
    T, HV, K, V, NC = s["T"], s["HV"], s["K"], s["V"], s["NC"]
    store_states = chunk_states is not None
    warps, stages = launch  # _fused_output_launch's
    # U' from Tm here (_solve_u_serves): x's W is Kb and its U is V
    solve = dict(beta=x["beta"], tm=x["tm_solve"], SOLVE_U=True) if x.get("tm_solve") is not None else {}
    _kernel(kda_state_output_fwd_kernel, traced)[(_cdiv(V, s["BV_SCAN_FWD"]), s["NSEQ"] * HV)](
        x["kr"], x["w"], x["u"], x["gam"], x["qg"], x["aqk"], _stand_in(o, traced) if h0 is None else h0,
        _stand_in(o, traced) if up is None else up,
        _stand_in(o, traced) if chunk_states is None else chunk_states, _stand_in(o, traced) if ht is None else ht, o,
        *s["VL_SEQ"], T, NC, s["H"], HV, _stand_in(o, traced) if slots is None else slots,
        K=K, V=V, BT=BT, BK=s["BK"], BV=s["BV_SCAN_FWD"],
        HAS_H0=h0 is not None, DOT_PREC=prec, STORE_HT=ht is not None, STORE_STATES=store_states,
        STORE_UP=up is not None, BF16_DOTS=s["SCAN_BF16_DOTS"], OUTPUT_BF16_DOTS=s["OUTPUT_BF16_DOTS"],
        INTERPRET=_INTERPRET, IS_VARLEN=s["IS_VARLEN"], POOL=slots is not None, V_FIRST=v_first,
        COMPACT_STATES=store_states and s["COMPACT_STATES"], GLAST_AHEAD=bool(S.FUSED_OUTPUT_GLAST_AHEAD),
        num_warps=warps, num_stages=stages, **solve,
    )
    if s["IS_VARLEN"] and store_states:
        _zero_unused_state_slots(chunk_states, s, traced)


def _state_scan_fwd(x: dict, h0: Optional[Tensor], up: Tensor, chunk_states: Tensor, ht: Optional[Tensor],
                    s: dict, prec: str, traced: bool, slots: Optional[Tensor] = None, v_first: bool = False,
                    first_up: bool = True, skip_unkept_state: bool = False) -> None:
    """Stage 2: the scan over chunks (state_fwd.py) into up, chunk_states and ht
    (None: not stored); for packed sequences, zeros into the chunk-state slots past
    the last one's. ``slots``: h0 and ht are one state pool, read and written at
    those slots. ``first_up=False`` (packed sequences, no h0): the rows of each
    sequence's first chunk in up are not written (the output reads U there).
    ``skip_unkept_state``: a one-chunk sequence forms no state that nothing keeps."""
    B, T, HV, K, V, NC = s["B"], s["T"], s["HV"], s["K"], s["V"], s["NC"]
    ht_or_stand_in = _stand_in(chunk_states, traced) if ht is None else ht
    _kernel(kda_state_fwd_kernel, traced)[(_cdiv(V, s["BV_SCAN_FWD"]), s["NSEQ"] * HV)](
        x["kr"], x["w"], x["u"], x["gam"], h0 if h0 is not None else _stand_in(ht_or_stand_in, traced), up,
        chunk_states, ht_or_stand_in, *s["VL_SEQ"], T, NC, s["H"], HV,
        _stand_in(ht_or_stand_in, traced) if slots is None else slots,
        K=K, V=V, BT=BT, BK=s["BK"], BV=s["BV_SCAN_FWD"],
        HAS_H0=h0 is not None, STORE_HT=ht is not None, DOT_PREC=prec, BF16_DOTS=s["SCAN_BF16_DOTS"], INTERPRET=_INTERPRET,
        IS_VARLEN=s["IS_VARLEN"], POOL=slots is not None, V_FIRST=v_first, COMPACT_STATES=s["COMPACT_STATES"],
        FIRST_UP=first_up, SKIP_UNKEPT_STATE=skip_unkept_state, GLAST_AHEAD=bool(S.SCAN_GLAST_AHEAD),
        num_warps=s["SCAN_FWD_WARPS"], num_stages=s["SCAN_FWD_STAGES"],
    )
    if s["IS_VARLEN"]:
        _zero_unused_state_slots(chunk_states, s, traced)


def _zero_unused_state_slots(chunk_states: Tensor, s: dict, traced: bool) -> None:
    """Packed sequences: zeros into the chunk-state slots past the last sequence's."""
    row = s["HV"] * s["K"] * s["V"]
    blocks = min(16, _cdiv(row, 1024))
    _kernel(kda_zero_slots_kernel, traced)[(s["NCS"], _cdiv(row, 1024 * blocks))](
        chunk_states, s["FIRST_UNUSED_STATE"], row, BLOCK=1024, BLOCKS=blocks, num_warps=4,
    )


def _output_fwd(x: dict, up: Tensor, chunk_states: Tensor, o: Tensor, s: dict, prec: str, traced: bool,
                slots: Optional[Tensor] = None, has_h0: bool = True, first_from_u: bool = False) -> None:
    """Stage 3: the output (output_fwd.py) into o; ``slots``: zeros for the
    sequences whose pool slot is negative (padding); ``has_h0``: False where no
    sequence has an initial state (the first chunks' zero states are not read);
    ``first_from_u``: the first chunks' U' read from U (the scan's first_up=False)."""
    B, T, HV, K, V, NC = s["B"], s["T"], s["HV"], s["K"], s["V"], s["NC"]
    bv_out = S.BV_OUTPUT or s["BV"]
    _kernel(kda_output_fwd_kernel, traced)[(_cdiv(V, bv_out), NC, B * HV)](
        x["qg"], x["aqk"], up, x["u"], chunk_states, o, *s["VL_CHUNK"], T, NC, s["H"], HV,
        _stand_in(o, traced) if slots is None else slots,
        K=K, V=V, BT=BT, BK=s["BK"], BV=bv_out,
        DOT_PREC=prec, BF16_DOTS=s["OUTPUT_BF16_DOTS"], INTERPRET=_INTERPRET, IS_VARLEN=s["IS_VARLEN"],
        POOL=slots is not None, HAS_H0=has_h0 or slots is not None, FIRST_FROM_U=first_from_u,
        num_warps=S.OUTPUT_WARPS,
    )


def kda_chunk_pool_triton(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float], pool: Tensor,
    ssm_state_indices: Tensor, state_v_first: bool = False, gate: Optional[tuple] = None,
    cu_seqlens: Optional[Tensor] = None,
) -> Tensor:
    """``kda_op::chunk_kda_pool_`` on the chunked kernels: ``o``, each sequence's
    initial state read from its slot of ``pool`` (contiguous, fp32) by the scan and
    its final state written back there, in place: no gather or scatter around the
    kernels. A negative slot: a padding sequence (zero state, zero output, nothing
    written)."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    s = _sizes(q, v, cu_seqlens=cu_seqlens)
    B, T, HV, K, V, NC = s["B"], s["T"], s["HV"], s["K"], s["V"], s["NC"]
    scale = K**-0.5 if scale is None else float(scale)
    f32 = dict(device=q.device, dtype=torch.float32)
    slots = ssm_state_indices.contiguous()
    o = torch.empty(B, T, HV, V, device=q.device, dtype=v.dtype)
    if s["NSEQ"] * HV == 0:
        return o
    prec = _dot_precision(q.dtype)
    if NC > 0 and T > 0:
        x = _intra_fwd(q, k, v, g, beta, scale, s, store_tm=False, gate=gate, solve_u=True)
        launch = _fused_output_launch(s, x)
        if launch is not None:  # neither chunk states nor U' (settings.FUSED_OUTPUT)
            _state_output_fwd(x, pool, None, None, pool, o, s, prec, launch, traced=False, slots=slots,
                              v_first=state_v_first)
            return o
    else:  # T == 0: the scan only passes the initial states through
        x = {name: torch.empty(0, **f32) for name in ("gam", "aqk", "w", "u", "qg", "kr")}
    chunk_states = _new_chunk_states(q, s)
    up = torch.empty(B, T, HV, V, device=q.device, dtype=residual_dtype(q.dtype))
    _state_scan_fwd(x, pool, up, chunk_states, pool, s, prec, traced=False, slots=slots, v_first=state_v_first)
    if NC > 0 and T > 0:
        _output_fwd(x, up, chunk_states, o, s, prec, traced=False, slots=slots)
    return o


def kda_fwd_triton_export(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    scale: Optional[float], initial_state: Optional[Tensor], gate: Optional[tuple] = None,
    cu_seqlens: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The chunked forward as host code that torch.export and inductor can trace
    (the body of ``kda_op::chunk_kda_fwd_export``): ``(o, final_state,
    chunk_states)``. Every launch goes through ``wrap_triton`` and nothing branches
    on a size that may stay symbolic: always the chunked kernels (no recurrent
    routing of short sequences), the scans' V block chosen for one sequence, no
    profiler ranges, nothing kept for the backward. Needs T >= 1 and B * HV >= 1.
    The same kernels with the same settings as ``kda_fwd_triton`` (up to the scans'
    V block), so the same numbers."""
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    s = _sizes(q, v, scan_batch=1, cu_seqlens=cu_seqlens, has_initial_state=initial_state is not None, traced=True)
    B, T, HV, K, V, NC = s["B"], s["T"], s["HV"], s["K"], s["V"], s["NC"]
    scale = K**-0.5 if scale is None else float(scale)
    f32 = dict(device=q.device, dtype=torch.float32)
    h0 = None if initial_state is None else initial_state.contiguous()
    prec = _dot_precision(q.dtype)

    chunk_states = _new_chunk_states(q, s)
    ht = torch.empty(s["NSEQ"], HV, K, V, **f32)
    o = torch.empty(B, T, HV, V, device=q.device, dtype=v.dtype)
    x = _intra_fwd(q, k, v, g, beta, scale, s, store_tm=False, traced=True, gate=gate)
    launch = _fused_output_launch(s, x)
    if launch is not None:  # the scan writes the output (settings.FUSED_OUTPUT)
        _state_output_fwd(x, h0, None, chunk_states, ht, o, s, prec, launch, traced=True)
        return o, ht, chunk_states
    up = torch.empty(B, T, HV, V, device=q.device, dtype=residual_dtype(q.dtype))
    _state_scan_fwd(x, h0, up, chunk_states, ht, s, prec, traced=True)
    _output_fwd(x, up, chunk_states, o, s, prec, traced=True, has_h0=h0 is not None)
    return o, ht, chunk_states


def kda_prep_fwd_triton(q: Tensor, k: Tensor, beta: Tensor, qk_l2norm: bool, beta_scale: float):
    """``kda_op::kda_prep_fwd`` in one launch (prep.py): q/k rows to unit l2 norm
    and ``beta_scale * sigmoid(beta)``, each where asked."""
    q, k, beta = (x.contiguous() for x in (q, k, beta))
    B, T, H, K = q.shape
    G = beta.shape[2] // H
    f32 = dict(device=q.device, dtype=torch.float32)
    if qk_l2norm:
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        q_rstd, k_rstd = torch.empty(B, T, H, **f32), torch.empty(B, T, H, **f32)
    else:  # fresh empties: op outputs must not alias each other
        q_out, k_out, q_rstd, k_rstd = (q.new_empty(0) for _ in range(4))
    beta_out = torch.empty_like(beta) if beta_scale > 0 else q.new_empty(0)
    R = B * T * H
    if R > 0:
        kda_prep_fwd_kernel[(_cdiv(R, S.PREP_ROWS),)](
            q, k, beta, q_out, k_out, beta_out, q_rstd, k_rstd, R, L2NORM_EPS, float(beta_scale),
            K=K, G=G, BK=_pow2(K), BR=S.PREP_ROWS, BB=_pow2(S.PREP_ROWS * G), L2NORM=qk_l2norm, SIGMOID=beta_scale > 0,
            num_warps=S.PREP_WARPS,
        )
    return q_out, k_out, beta_out, q_rstd, k_rstd
