"""Every kernel, as the host code (fwd.py, bwd.py, decode.py) launches it, fits the
H200's shared memory (227 KB per block), checked without a GPU: Triton compiles for
sm_90a here (benchmarks/kernel_resources.py). Twice a setting (settings.py) that
the interpreter ran fine asked for more than that and failed only on the GPU (the
scans' stages: 263 KB at first; 240 KB with three forward-scan stages of fp32
operands).

The same compiles check that no wgmma may read a shared-memory tile cp.async wrote
before a proxy fence (``--check-fences``, kernel_resources.unfenced_wgmmas): under
Triton 3.6-3.8 the fused backward scan under SCAN_AQK_ROW_MASK and intra_bwd's dO U'^T
(bf16 dots, or fp16 inputs) had such wgmmas, and on the GPU the backward gave dh0 with
NaN in a column (T = 9, bf16) and an illegal address (bf16, K = 256)
(benchmarks/NOTES.md, thirty-second session); the host now avoids those forms there
(_compat.fences_wgmma_after_cp_async)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[1]
H200_SHARED_BYTES = 232448


# Each input dtype (fp16 inputs: fp32 operands with TF32 dots, the case that
# failed); K = V = 128 with the scans' V block at its smallest and at
# BV_SCAN_MAX, and 256 (the largest: one scan stage).
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("head_dim,scan_bv", [(128, None), (128, 64), (256, None)])
def test_kernels_fit_the_h200_shared_memory(dtype, head_dim, scan_bv):
    _check_shared(dtype, head_dim, scan_bv)


@pytest.mark.parametrize("options", [
    ("--bf16-residuals", "0", "--bf16-chunk-states", "0"),  # U, U' and the chunk states in fp32
    ("--set", "INTRA_A_SPREAD_TILE=0", "BF16_AQK=0", "RECURRENT_INPUT_HINTS=0"),
    ("--set", "INTRA_GAM_KERNEL=0", "BKA=16", "INTRA_WU_BV=None"),  # the sixth session's intra-chunk forward
    ("--gate", "1"),  # fla's in-kernel gate, softplus form
    ("--gate", "2"),  # ... lower-bound form
    ("--varlen", "--gate", "1"),  # packed sequences (cu_seqlens), as fla's layer trains
    ("--varlen",),  # ... without the gate: gam on chip beside the short-sequence tiles (forty-third session)
    # the backward's row-block dots (off by default), the forward's and backward's per-chunk kernels
    ("--gate", "2", "--set", "INTRA_BWD_A_ROW_BLOCK_DOTS=1", "INTRA_A_ROW_PROGRAMS=0", "INTRA_BWD_A_ROW_PROGRAMS=0",
     "INTRA_WU_BK=None"),
    ("--gate", "2", "--set", "INTRA_A_BLOCK_REFS=0"),  # the forward's steep chunks all through the steep launch
    # the steep launches as full grids, dq and dk through gva_reduce at G = 1, no register cap
    # (the defaults before 2026-12-05)
    ("--set", "STEEP_WORK_LIST=0", "DIRECT_DQ_DK=0", "INTRA_BWD_A_MAXNREG=None"),
])
def test_kernels_fit_the_h200_shared_memory_with_other_options(options):
    """bf16 inputs under the options that are not the defaults."""
    _check_shared("bf16", 128, 64, *options)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_kernels_fit_with_the_scans_loads_ahead_and_v_blocks_of_16(head_dim):
    """bf16 inputs with the scans' loads a chunk ahead and under a row mask (settings
    SCAN_GLAST_AHEAD, SCAN_BWD_GLAST_AHEAD, SCAN_AQK_ROW_MASK; the first and last on by
    default) and the backward scan's V block of
    16 (BV_SCAN_BWD_MIN; 32 by default: four warps at K = 128, eight at 256), at one
    sequence and head."""
    _check_shared("bf16", head_dim, None, "--set", "SCAN_GLAST_AHEAD=1", "SCAN_BWD_GLAST_AHEAD=1", "SCAN_AQK_ROW_MASK=1",
                  "BV_SCAN_BWD_MIN=16")


@pytest.mark.parametrize("varlen,glast_ahead", [(False, 0), (True, 0), (False, 1), (True, 1)])
def test_the_scan_writing_the_output_fits(varlen, glast_ahead):
    """settings.FUSED_OUTPUT (on by default): the forward scan that writes the output,
    as a forward that keeps its intermediates and one that keeps nothing launch it (bf16,
    K = V = 128, at its V-block floor of 64), for fixed-length and packed sequences, with
    gam's last row loaded where it is used and a chunk ahead (FUSED_OUTPUT_GLAST_AHEAD);
    both forms also at the warps and stages of the one-wave launch (FUSED_OUTPUT_ONE_WAVE);
    and forming U' from Tm (FUSED_OUTPUT_SOLVE_U: a forward that keeps nothing, with and
    without an initial state, at both launches)."""
    from kda_op.triton_kernels import settings

    out = _resources("bf16", 128, None, "--only", "state_output", "--set", "FUSED_OUTPUT=1",
                     f"FUSED_OUTPUT_GLAST_AHEAD={glast_ahead}", *(("--varlen",) if varlen else ()))
    assert out.count("kda_state_output_fwd_kernel") == 8, out
    one_wave = f"warps {settings.FUSED_OUTPUT_ONE_WAVE_WARPS} stages {settings.FUSED_OUTPUT_ONE_WAVE_STAGES}:"
    assert out.count(one_wave) == 4, out


def _check_shared(dtype, head_dim, scan_bv, *extra):
    out = _resources(dtype, head_dim, scan_bv, *extra)
    assert out.count("shared ") >= 16, out  # every kernel reported


def _resources(dtype, head_dim, scan_bv, *extra) -> str:
    """benchmarks/kernel_resources.py's report, which must find every kernel it compiles
    within the H200's shared memory."""
    # Compiling needs Triton's own jit, not the interpreter's stand-in (conftest sets
    # TRITON_INTERPRET=1 where there is no GPU): a subprocess without it.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(REPO / "benchmarks" / "kernel_resources.py"), "--dtype", dtype,
           "--head-dim", str(head_dim), "--max-shared", str(H200_SHARED_BYTES), "--check-fences"]
    if scan_bv:
        cmd += ["--scan-bv", str(scan_bv)]
    cmd += list(extra)
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    return run.stdout


def test_the_one_pass_forward_fits():
    """settings.ONE_PASS_FWD (off by default): the forward in one launch compiles for
    sm_90a at its settings' V block and warps and at a V block of 64, bf16, K = V = 128,
    within the H200's shared memory (benchmarks/one_pass_resources.py)."""
    from kda_op.triton_kernels import settings

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    bvs = sorted({settings.ONE_PASS_BV, 64})
    cmd = [sys.executable, str(REPO / "benchmarks" / "one_pass_resources.py"), "--bv", *map(str, bvs),
           "--warps", str(settings.ONE_PASS_WARPS), "--bka", str(settings.ONE_PASS_BKA)]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    assert run.stdout.count("shared") == len(bvs), run.stdout
