"""Host helpers shared by the forward (fwd.py), the backward (bwd.py) and
decoding (decode.py): dot precisions, the offset and grid checks, block sizes
(_sizes), the kernel wrapper for traced host code, and the layout of the kept
intermediates. Tuning settings are read from settings.py at every call.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from typing import Optional

import torch
import triton
from torch import Tensor
from torch.profiler import record_function

from .._compat import fences_wgmma_after_cp_async, profiler_enabled
from .._contract import varlen_chunk_slots, varlen_state_slots, intermediates_layout, scan_operand_dtype
from . import settings as S
from .settings import BC, BT, MAX_SPLIT
from .varlen_index import kda_varlen_index_kernel


# Under Triton's interpreter (CPU CI) bf16 dots are emulated (_dot.py).
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


# The host code's integer helpers and profiler ranges, in plain Python: triton.cdiv and
# triton.next_power_of_2 are Triton constexpr functions (Triton 3.9: about 2 us a call
# against 0.02), and an idle record_function costs about 8 us; with some 30 and 10 of
# them in a forward and backward on short packed sequences (host-bound), 0.14 ms of
# host time a step on the development machine.
def _cdiv(a, b):
    """ceil(a / b) for integers (SymInts too, for the traced export op)."""
    return -(-a // b)


def _pow2(n):
    """The least power of two >= n for n >= 1 (0 for 0), as triton.next_power_of_2."""
    if not isinstance(n, int):  # a SymInt (traced): Triton's own arithmetic
        return triton.next_power_of_2(n)
    return 0 if n == 0 else 1 << (n - 1).bit_length()


def _range(name: str):
    """A profiler range (``torch.profiler.record_function``) while a profiler runs,
    else nothing (profiling/ reads the ranges; an idle range costs host time)."""
    return record_function(name) if profiler_enabled() else contextlib.nullcontext()


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: 3xTF32 keeps products at about fp32 accuracy on the tensor
    # cores. bf16/fp16 inputs: plain TF32 (10-bit mantissa) is already finer than
    # the inputs and outputs.
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _fast_exp() -> bool:
    """The FAST_EXP constexpr of the kernels that take it (_math.exp): settings.FAST_EXP,
    never under the interpreter, which cannot run inline PTX."""
    return bool(S.FAST_EXP) and not _INTERPRET


def _cp_async_wgmma_fenced() -> bool:
    """Whether the kernels may take the forms in which a wgmma reads a tile that
    cp.async wrote with no fence of the kernel's own before it
    (settings.SCAN_AQK_ROW_MASK, INTRA_BWD_BF16_DAQK): under the interpreter (no
    proxies), or where Triton fences them itself (_compat.fences_wgmma_after_cp_async:
    Triton >= 3.9)."""
    return _INTERPRET or fences_wgmma_after_cp_async()


def _steep_dot_precision(dtype: torch.dtype) -> str:
    return S.STEEP_DOT_PREC_FP32 if dtype == torch.float32 else _dot_precision(dtype)


def _check_offsets(T: int, HV: int, K: int, V: int) -> None:
    """The kernels move each pointer in 64-bit to its chunk (chunk-parallel
    kernels) or, inside their loops, to each chunk or token (the scans and the
    recurrent kernel), and offset within that in 32-bit: one chunk spans
    BT * HV * max(K, V, BT) elements, which must stay below 2^31, and T must fit
    the kernels' int32 length arguments. Refuse, rather than wrap around, past
    either. Bounds on T alone, so that under torch.export (the export op) they
    are a plain range of the sequence length."""
    if not BT * HV * max(K, V, BT) < 2**31:
        raise ValueError(
            f"HV * max(K, V, {BT}) = {HV} * {max(K, V, BT)} is too large for the CUDA kernels "
            f"({BT} rows of it must stay below 2^31 elements)"
        )
    if not T < 2**31:
        raise ValueError(f"T = {T} rows: the CUDA kernels take lengths below 2^31; split the sequence, carrying the state")


def _check_grid(B: int, HV: int, T: Optional[int]) -> None:
    """Refuse, with what to do, a launch whose grid the GPU would reject (T: None
    for the recurrent kernel, whose grid does not count chunks). Bounds on B and T
    alone, as in _check_offsets."""
    if not B <= S.MAX_GRID_YZ // HV:
        raise ValueError(
            f"B * HV = {B} * {HV} exceeds {S.MAX_GRID_YZ}, the CUDA kernels' limit on "
            f"sequences times value heads per call; split the batch"
        )
    if T is not None and not T <= S.MAX_GRID_YZ * BT:
        raise ValueError(
            f"T = {T} is more than {S.MAX_GRID_YZ} chunks of {BT}; split the sequence, carrying the state"
        )


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    # The interpreter (CPU tensors), or fake CUDA tensors traced on a machine
    # without CUDA: the H200's, so that CPU CI takes the H200's choices.
    return 132


def _scan_block_v(B: int, HV: int, V: int, device: torch.device, bv_min: int, per_sm: int = 1) -> int:
    """The scans' V block: from ``bv_min``, doubled while the programs
    (B * HV * V blocks) overflow one wave (``per_sm`` programs on each SM) and a
    bigger block still splits V."""
    wave = (S.SCAN_SMS or _sm_count(device)) * per_sm
    bv = bv_min
    while bv < min(S.BV_SCAN_MAX, _pow2(V)) and B * HV * _cdiv(V, bv) > wave:
        bv *= 2
    return bv


def scan_bwd_warps(bv: int, bk: int) -> int:
    """The fused backward scan's warps at V block ``bv`` and K block ``bk``: settings.SCAN_BWD_WARPS
    where set, else SCAN_BWD_WARPS_BV16 at a V block of 16 and BK <= 128 (eight warps faulted
    there on the H200; at BK = 256 four spill) and SCAN_WARPS otherwise."""
    return S.SCAN_BWD_WARPS or (S.SCAN_BWD_WARPS_BV16 if bv == 16 and bk <= 128 else S.SCAN_WARPS)


def bf16_dup(packed: bool) -> bool:
    """Whether settings.BF16_DUP asks for dU' in bf16 (0 never, 1 fixed-length inputs
    only, 2 packed sequences too), where the fused backward scan's dots take bf16 operands."""
    if S.BF16_DUP not in (0, 1, 2):
        raise ValueError(f"settings.BF16_DUP: expected 0, 1 or 2, got {S.BF16_DUP!r}")
    return S.BF16_DUP == 2 or (S.BF16_DUP == 1 and not packed)


def intra_bwd_w_stages(dtype: torch.dtype) -> int:
    """intra_bwd_w.py's pipeline stages for inputs of ``dtype``: settings.INTRA_BWD_W_STAGES,
    INTRA_BWD_W_STAGES_FP32 for fp32 inputs (wider tiles: shared memory)."""
    return S.INTRA_BWD_W_STAGES_FP32 if dtype == torch.float32 else S.INTRA_BWD_W_STAGES


def _work_list(n_items, device: torch.device) -> Optional[tuple]:
    """The 1-D grid of a work-list launch over ``n_items`` items (settings.STEEP_WORK_LIST),
    or None where the setting is off (the full grid then). At most one program per item
    (``n_items`` may be symbolic under tracing: torch.sym_min keeps it so)."""
    if S.STEEP_WORK_LIST not in (0, 1):
        raise ValueError(f"settings.STEEP_WORK_LIST: expected 0 or 1, got {S.STEEP_WORK_LIST!r}")
    if not S.STEEP_WORK_LIST:
        return None
    programs = S.WORK_LIST_PROGRAMS or (S.SCAN_SMS or _sm_count(device)) * S.WORK_LIST_PER_SM
    if not (isinstance(programs, int) and programs >= 1):
        raise ValueError(f"settings.WORK_LIST_PROGRAMS / WORK_LIST_PER_SM: expected a positive count of programs, "
                         f"got {programs!r}")
    if S.WORK_LIST_BLOCK not in (16, 32, 64, 128, 256):
        raise ValueError(f"settings.WORK_LIST_BLOCK: expected a power of two from 16 to 256, got {S.WORK_LIST_BLOCK!r}")
    return (torch.sym_max(1, torch.sym_min(n_items, programs)),)


def _kernel(fn, traced: bool):
    """``fn``, or for host code that torch.export and inductor trace into (the
    export op), ``fn`` wrapped so the launch is captured as a graph node and every
    parameter is passed (``_EveryArgument``). Outside tracing the wrapped kernel
    launches as it is."""
    if traced:
        from .._compat import wrap_triton

        return _EveryArgument(wrap_triton(fn), fn)
    return fn


@functools.lru_cache(maxsize=None)
def _parameters(fn) -> tuple:
    """``(name, has_default, default)`` of each of ``fn``'s parameters, in order."""
    import inspect

    return tuple((p.name, p.default is not p.empty, p.default)
                 for p in inspect.signature(fn.fn).parameters.values())


class _EveryArgument:
    """``launcher[grid](*args, **kwargs)`` with each parameter that the call leaves
    to its default passed explicitly, at its default. torch's traced launches need
    every one: with one left out, its mutation analysis (which tensors a kernel
    writes) fails and assumes every input written, and the kernel inductor
    compiles from the traced node did not get the defaults (torch 2.11, Triton 3.6:
    a tl.static_assert on TILE / PICK_TILE, which default to 0, failed there)."""

    def __init__(self, launcher, fn):
        self.launcher, self.fn = launcher, fn

    def __getitem__(self, grid):
        launch = self.launcher[grid]

        def run(*args, **kwargs):
            for name, has_default, default in _parameters(self.fn)[len(args):]:
                if name not in kwargs:
                    if not has_default:
                        raise TypeError(f"{self.fn.__name__}: no argument for {name!r}")
                    kwargs[name] = default
            return launch(*args, **kwargs)

        return run


# varlen_index.py's blocks: chunk slots a program, sequences an iteration
_INDEX_SLOTS = 64
_INDEX_SEQS = 128


def _varlen_index(cu_seqlens: Tensor, T: int, has_initial_state: bool = True,
                  traced: bool = False) -> tuple[Tensor, Tensor, Tensor, int, Optional[Tensor]]:
    """For N packed sequences (``cu_seqlens`` [N + 1]) on their device, without a
    host sync (so a CUDA graph can capture it): ``(chunk_index [NCB, 3] int32,
    seq_offsets [N, 2] int64, first_unused_state [1] int64, NCB, dstate_offsets
    [N + 1] int64)`` as _indexing.py reads them, NCB = ``varlen_chunk_slots(T, N)``:
    per chunk slot its sequence, its chunk in the sequence and the slot of the state
    entering it; per sequence its first chunk's global index and the slot of the
    state entering it, in the chunk states' layout (``_contract.varlen_state_offsets``);
    each sequence's first compact dS_C slot (the backward's, settings.COMPACT_DSTATES).

    One Triton launch (varlen_index.py); with ``traced`` (the export op, which
    inductor compiles) torch ops instead, some 25 of them, and no dS_C offsets (None:
    the export op has no backward)."""
    if traced:
        return (*_varlen_index_torch(cu_seqlens, T, has_initial_state), None)
    N = cu_seqlens.shape[0] - 1
    NCB = varlen_chunk_slots(T, N)
    device = cu_seqlens.device
    chunk_index = torch.empty(NCB, 3, device=device, dtype=torch.int32)
    seq_offsets = torch.empty(N, 2, device=device, dtype=torch.int64)
    first_unused = torch.empty(1, device=device, dtype=torch.int64)
    dstate_offsets = torch.empty(N + 1, device=device, dtype=torch.int64)
    # at least one program: it writes the per-sequence tensors and the first unused slot
    kda_varlen_index_kernel[(max(1, _cdiv(NCB, _INDEX_SLOTS)),)](
        cu_seqlens, chunk_index, seq_offsets, first_unused, dstate_offsets, N, NCB,
        BT=BT, BS=_INDEX_SLOTS, BN=_INDEX_SEQS, HAS_H0=has_initial_state, num_warps=4,
    )
    return chunk_index, seq_offsets, first_unused, NCB, dstate_offsets


def _varlen_index_torch(cu_seqlens: Tensor, T: int, has_initial_state: bool = True) -> tuple[Tensor, Tensor, Tensor, int]:
    """``_varlen_index``'s first four, with torch ops only (the traced export op)."""
    N = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.to(torch.int64)
    chunks = (cu[1:] - cu[:-1] + BT - 1) // BT
    chunk_offsets = torch.cat([cu.new_zeros(1), chunks.cumsum(0)])
    if has_initial_state:  # NC_n + 1 boundaries each
        state_starts = chunk_offsets + torch.arange(N + 1, device=cu.device, dtype=torch.int64)
        first_unused = state_starts[-1:]
    else:  # chunk c >= 1's entering state at the sequence's start + c
        stored = torch.cat([cu.new_zeros(1), (chunks - 1).clamp_min(0).cumsum(0)])
        state_starts = stored - 1
        first_unused = stored[-1:]
    NCB = varlen_chunk_slots(T, N)
    slots = torch.arange(NCB, device=cu.device, dtype=torch.int64)
    # the sequence whose chunks [offsets[n], offsets[n + 1]) hold the slot: offsets[0] = 0
    # counts once for every slot. Not searchsorted(offsets[1:], ...): inductor's Triton
    # lowering of searchsorted (torch 2.11) drops a sliced sequence's storage offset and
    # searched from offsets[0] (pytorch/pytorch#182343): the export op and AOTInductor
    # packages took every packed chunk as the next sequence's (illegal memory access, H200)
    n = torch.searchsorted(chunk_offsets, slots, right=True) - 1
    valid = n < N
    n_safe = n.clamp(max=max(N - 1, 0))
    c = slots - chunk_offsets.gather(0, n_safe)
    s_c = state_starts.gather(0, n_safe) + c
    chunk_index = torch.stack([torch.where(valid, n, -1), torch.where(valid, c, 0), torch.where(valid, s_c, -1)],
                              dim=1).to(torch.int32)
    seq_offsets = torch.stack([chunk_offsets[:-1], state_starts[:-1]], dim=1)
    return chunk_index.contiguous(), seq_offsets.contiguous(), first_unused, NCB


def _sizes(q: Tensor, v: Tensor, scan_batch: Optional[int] = None, cu_seqlens: Optional[Tensor] = None,
           has_initial_state: bool = True, traced: bool = False) -> dict:
    """Sizes and block shapes of one call. ``scan_batch`` stands in for B when the
    scans' V block is chosen (the export op: no branch on a batch size that stays
    symbolic). ``cu_seqlens``: N packed sequences (B = 1); NC is then the chunk
    slot count, NSEQ = N the per-sequence programs, NCS the chunk states' slots
    (their layout depends on ``has_initial_state``: _contract.varlen_state_slots),
    and VL_CHUNK / VL_SEQ the index tensors the chunk-parallel / per-sequence
    kernels take (_indexing.py; stand-ins that are never read otherwise), and
    DSTATE_OFFSETS the backward's compact dS_C offsets (None where traced). ``traced``: host code that
    inductor compiles (the export op): the index from torch ops (_varlen_index)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    _check_offsets(T, HV, K, V)
    _check_grid(B, HV, T)
    if cu_seqlens is None:
        varlen = dict(NC=_cdiv(T, BT), NSEQ=B, NCS=_cdiv(T, BT) + 1, IS_VARLEN=False,
                      VL_CHUNK=(q, q), VL_SEQ=(q, q), FIRST_UNUSED_STATE=None, COMPACT_STATES=False,
                      DSTATE_OFFSETS=None)
    else:
        N = cu_seqlens.shape[0] - 1
        _check_grid(N, HV, T + N * BT)
        cu = cu_seqlens.contiguous()
        chunk_index, seq_offsets, first_unused, NCB, dstate_offsets = _varlen_index(
            cu, T, has_initial_state, traced=traced)
        varlen = dict(NC=NCB, NSEQ=N, NCS=varlen_state_slots(T, N, has_initial_state), IS_VARLEN=True,
                      VL_CHUNK=(cu, chunk_index), VL_SEQ=(cu, seq_offsets),
                      FIRST_UNUSED_STATE=first_unused, COMPACT_STATES=not has_initial_state,
                      DSTATE_OFFSETS=dstate_offsets)
    # Blocks of at least 32: a wrong dk was seen on the H200 with K = 32, V = 16
    # (BV = 16) that the interpreter computed right; cause not established.
    BK = max(32, _pow2(K))
    bf16_operands = scan_operand_dtype(q.dtype) == torch.bfloat16  # the *_BF16_DOTS options apply
    # short packed sequences (settings.SHORT_SEQ_CHUNKS): the scans' V block from the
    # sequence count (not from B = 1)
    short = (cu_seqlens is not None and scan_batch is None and isinstance(T, int)
             and isinstance(varlen["NSEQ"], int) and T <= S.SHORT_SEQ_CHUNKS * BT * varlen["NSEQ"])
    scan_b = (varlen["NSEQ"] if short else B) if scan_batch is None else scan_batch
    bv_scan_min = S.BV_SCAN if bf16_operands else S.BV_SCAN_FP32_OPERANDS
    # BK = 256: one stage at fp32 operands (shared memory), SCAN_STAGES_WIDE_BF16 at bf16
    wide_stages = S.SCAN_STAGES_WIDE_BF16 if bf16_operands else 1
    fwd_stages = ((S.SCAN_FWD_STAGES or S.SCAN_STAGES) if bf16_operands else S.SCAN_STAGES) if BK <= 128 else wide_stages
    bv_scan_bwd = _scan_block_v(scan_b, HV, V, q.device, max(S.BV_SCAN_BWD_MIN, bv_scan_min), S.SCAN_BWD_PER_SM)
    return dict(
        B=B, T=T, H=H, K=K, HV=HV, V=V,
        **varlen,
        SHORT=short,
        BK=BK,
        BV=min(64 if BK <= 128 else 32, max(32, _pow2(V))),
        BV_SCAN=_scan_block_v(scan_b, HV, V, q.device, bv_scan_min),
        BV_SCAN_FWD=_scan_block_v(scan_b, HV, V, q.device, max(S.BV_SCAN_FWD or 0, bv_scan_min), S.SCAN_FWD_PER_SM),
        # the fused backward scan (settings.SCAN_BWD_FUSED): its V block and stages
        BV_SCAN_BWD=bv_scan_bwd,
        SCAN_BWD_WARPS=scan_bwd_warps(bv_scan_bwd, BK),
        SCAN_BWD_STAGES=S.SCAN_BWD_STAGES if bf16_operands and BK <= 128 else 1,
        SCAN_BWD_BF16_DOTS=bf16_operands and bool(S.SCAN_BWD_BF16_DOTS),
        SCAN_STAGES=S.SCAN_STAGES if BK <= 128 else wide_stages,
        # three stages of fp32 W and Kr (fp32 and fp16 inputs) need 240 KB of shared
        # memory at BK = 128, BV = 32: more than the H200's 227
        SCAN_FWD_STAGES=fwd_stages,
        SCAN_FWD_WARPS=S.SCAN_FWD_WARPS or S.SCAN_WARPS,
        SCAN_BF16_DOTS=bf16_operands and bool(S.SCAN_BF16_DOTS),
        OUTPUT_BF16_DOTS=bf16_operands and bool(S.OUTPUT_BF16_DOTS),
        WU_BF16_DOTS=bf16_operands and bool(S.WU_BF16_DOTS),
    )


# The layout these kernels keep: that of the CUDA device, also when the Triton
# interpreter runs them on CPU tensors (tests).
_SERVES = "cuda"


def _layout(q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor] = None) -> tuple[list, int]:
    """``kda_op._contract.intermediates_layout`` for these inputs."""
    B, T, _, K = q.shape
    num_seqs = None if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return intermediates_layout(B, T, v.shape[2], K, v.shape[3], q.dtype, _SERVES, num_seqs)


def _intermediates_views(buffer: Tensor, layout: list) -> dict:
    """The named tensors inside the flat uint8 buffer of kept intermediates."""
    views = {}
    for name, shape, dtype, offset in layout:
        nbytes = math.prod(shape) * dtype.itemsize
        views[name] = buffer[offset:offset + nbytes].view(dtype).view(shape)
    return views


def _zero_alignment_gaps(buffer: Tensor, layout: list, total: int) -> None:
    """Zero the bytes between (and after) the pieces of the kept-intermediates
    buffer, which no kernel writes: the buffer is an op output, so every byte must
    follow from the inputs (opcheck compares eager and traced runs bitwise). At
    most one small fill per piece, none where sizes are multiples of 256 bytes."""
    starts = [offset for *_, offset in layout[1:]] + [total]
    for (_, shape, dtype, offset), next_start in zip(layout, starts):
        end = offset + math.prod(shape) * dtype.itemsize
        if end < next_start:
            buffer[end:next_start].zero_()


def _gate_args(gate: Optional[tuple], g: Tensor) -> dict:
    """The kernels' arguments for fla's in-kernel gate (_gate.py). ``gate`` is
    None (g is the log decay) or ``(A_log, dt_bias, lower_bound)``: A_log [HV] or
    None (only with lower_bound), dt_bias [HV * K] or None, lower_bound a float or
    None (the softplus form). Absent pointers are passed as ``g``, never read."""
    if gate is None:
        return dict(A_log=g, dt_bias=g, lower_bound=0.0, GATE=0, HAS_A=False, HAS_BIAS=False)
    A_log, dt_bias, lower_bound = gate
    return dict(
        A_log=g if A_log is None else A_log.contiguous(),
        dt_bias=g if dt_bias is None else dt_bias.contiguous(),
        lower_bound=0.0 if lower_bound is None else float(lower_bound),
        GATE=1 if lower_bound is None else 2,
        HAS_A=A_log is not None,
        HAS_BIAS=dt_bias is not None,
    )


def _gate_bounds_every_block(ga: dict) -> bool:
    """Whether fla's bounded gate (``lower_bound * sigmoid(...)``, every log decay
    within |lower_bound| of 0) keeps gam within BC / 2 * |lower_bound| of every
    BC-row block's middle row, under MAX_SPLIT with a margin of a whole unit for
    rounding: every chunk can then take block references, whatever its spreads."""
    return ga["GATE"] == 2 and (BC // 2) * abs(ga["lower_bound"]) <= MAX_SPLIT - 1
