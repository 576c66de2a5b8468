"""Tuning settings and fixed constants of the Triton kernels' host code.

The upper-case tuning settings (warps, block sizes, stages, the bf16-dot and
cache-hint options, RECURRENT_*) are module-level so that benchmarks
(benchmarks/bench_kernels.py, bench_chunk_kda.py --variants, bench_decode.py
--settings, kernel_resources.py --set) and tests can try other values. The host
code (fwd.py, bwd.py, decode.py, _host.py) reads them through this module at
every call, so ``settings.NAME = value`` takes effect at the next call. BT, BC,
MAX_SPLIT, MAX_GRID_YZ and STEEP_DOT_PREC_FP32 are fixed constants, not tuning
settings.
"""

from .._contract import CHUNK_SIZE

BT = CHUNK_SIZE  # chunk length of the kernels = the chunk length of the saved states
BC = 16  # sub-block length inside a chunk, on its steep path (intra_a_fwd.py)
# A chunk is split at its middle row when exp(+-(gam_i - gam_mid)) stays within
# exp(60) (fp32 overflows past exp(88)); steeper chunks take the sub-block path.
MAX_SPLIT = 60.0
# Warps per program of the intra-chunk kernels. These and the other upper-case
# settings here are module-level so that benchmarks/bench_kernels.py can time
# (and check) other values. Four warps where the H200 measured them faster than
# eight (bench_kernels.py, B1-T8192-H16 bf16, 2026-11-30, ms per call, 8 -> 4):
# intra_a_fwd 0.65 -> 0.41, intra_wu_fwd 1.11 -> 0.72, intra_bwd_w 0.87 -> 0.59,
# intra_bwd 0.27 -> 0.26; intra_bwd_a 0.44 at 4, 0.46 at 8.
INTRA_A_FWD_WARPS = 4
INTRA_WU_FWD_WARPS = 4
# ... and two for bf16 inputs with K <= 128: intra_wu_fwd 0.36 -> 0.23 ms, forward
# 1.12 -> 0.99 ms (same H200 run, B1-T8192-H16; max rel diff of o, final state and
# grads to four warps 3e-5). Not at fp32 or K = 256, where two warps spill
# kilobytes (benchmarks/kernel_resources.py).
INTRA_WU_FWD_WARPS_BF16 = 2
# A cap on intra_wu_fwd's registers per thread on its two-warp bf16 path (None: the
# compiler's choice, 210 forward-only, four CTAs an SM). H200, same process, layer-style:
# 168 (108 B spilled, six CTAs) took it 0.347 -> 0.331 ms at B2-T8192-H8-HV32 and 0.095 ->
# 0.092 at B1-T8192-H16 (2026-12-04, one-block inverses); beside DIAG_INV_BLOCKS = 4
# (2026-12-04, 25th session, kernels by GPU time) B2 forward 1.563 -> 1.551 ms wall,
# varlen-2048x1-64 intra_wu_fwd 0.982 -> 0.909, forward 3.866 -> 3.798 ms wall. 128 (536 B
# spilled) 0.414 ms, slower.
INTRA_WU_FWD_MAXNREG = 168
INTRA_BWD_W_WARPS = 8  # with BKS_W = 64; at 4 warps it spilled 2.4 KB
# A cap on intra_bwd_w's registers per thread (None: the compiler's choice, 234 at eight
# warps: one CTA an SM; see INTRA_BWD_W_STAGES for the caps timed).
INTRA_BWD_W_MAXNREG = None
# ... the pipeline stages of its V loop (2: the second V block's loads issued ahead), and
# its V block (None: the backward's BV). Under Triton < 3.9 two stages pass S0 and dS_C
# through registers (STATES_IN_REGISTERS), as its bf16 dots would otherwise read cp.async
# tiles unfenced (kernel_resources.py --check-fences). H100 (2026-12-07, forty-third
# session, ours alone, two rounds, kernels by GPU time, the fenced form): kda_intra_bwd_w
# 1.880 -> 1.818 ms at B2-T8192-H8-HV32 layer-style (step 7.437 -> 7.378), 3.678 -> 3.569
# at B8-T8192-H16 (12.276 -> 12.171). Slower the same session: V blocks of 32 at two stages
# (2.037 / 4.026 ms, unfenced) or four (1.791 / 3.563, unfenced), of 128 (1.809 / 3.630);
# K slices of 32 at 128 registers (two CTAs an SM: 1.895 / 3.705, and twice the dTm shares);
# a slice of 64 or 128 walked in sub-slices of 32 (3.1-6.9 ms: spills under the cap).
# 2 -> 3 on 2026-12-07 (forty-sixth session) for 16-bit inputs: with dU' in bf16 (BF16_DUP)
# a stage takes 40 KB of shared memory (139 KB at three, one CTA an SM by its 220
# registers either way), so both V blocks of 64 (V = 128) are in flight from the start.
# H100 (ours alone, two rounds, kernels by GPU time): kda_intra_bwd_w 1.514 -> 1.337 ms at
# B2-T8192-H8-HV32 layer-style (step 6.504 -> 6.329), 3.036 -> 2.664 at B8-T8192-H16 (11.608
# -> 11.236), 0.421 -> 0.383 at varlen-mixed-T8192, varlen-2048x1-64 even (13.92 ms).
# sm_90a: no unfenced wgmma (kernel_resources.py --check-fences). fp32 inputs keep
# INTRA_BWD_W_STAGES_FP32 (three stages there: 229 KB of shared memory, 1.2 KB spilled; untimed).
INTRA_BWD_W_STAGES = 3
INTRA_BWD_W_STAGES_FP32 = 2
INTRA_BWD_W_BV = None
# intra_bwd_w's q, k and gam slices loaded before its V loop (1: in flight while it runs)
# instead of after it (0), bf16 / fp16 inputs. sm_90a, Triton 3.6, bf16: 223 registers
# against 236, no spill either way (fp32 inputs keep 0: 1.4 KB of spills). H100 (2026-12-07,
# forty-fourth session, ours alone, two rounds, kernels by GPU time): kda_intra_bwd_w 1.765 ->
# 1.633 ms at B2-T8192-H8-HV32 layer-style (step 7.341 -> 7.219), 3.486 -> 3.255 at
# B8-T8192-H16 (12.147 -> 11.929).
INTRA_BWD_W_EARLY_QKG = 1
INTRA_BWD_WARPS = 8  # 4 -> 8 on 2026-12-03 (see INTRA_BWD_BF16_DAQK)
# intra_bwd's register cap (None: the compiler's choice) and the pipeline stages of its V
# loop. Uncapped at three stages it took 233 registers and 128 KB of shared memory at eight
# warps: one CTA an SM. Capped at 128 with two stages (100 B spilled, 104 KB): two. H100
# (2026-12-07, forty-third session, ours alone, two rounds, kernels by GPU time):
# kda_intra_bwd 1.828 -> 1.622 ms at B8-T8192-H16, step 12.532 -> 12.355 ms; B2-T8192-H8-HV32
# step 6.512 -> 6.416, layer-style 7.553 -> 7.464 (one stage: 1.622, 6.422, 7.472).
INTRA_BWD_MAXNREG = 128
INTRA_BWD_STAGES = 2
INTRA_BWD_A_WARPS = 4
# A register cap on the per-chunk backward through the A's where it takes the split chunks
# alone (INTRA_BWD_A_ONE_LAUNCH's two launches; None: no cap). Three CTAs an SM at four warps
# need at most 168 registers: it takes 168 at the defaults, 182 with DIRECT_DQ_DK (two CTAs
# an SM; 165 and no spill under a cap of 168), 206 with fla's softplus gate (20 B spilled
# under the cap); sm_90a, Triton 3.6, benchmarks/kernel_resources.py, 2026-12-04. On the
# H200 (2026-12-05, ours alone, B8-T8192-H16, DIRECT_DQ_DK on): kda_intra_bwd_a 3.169 ms
# uncapped, 2.540 capped (2.662 at the old defaults); step 12.854 -> 12.221 ms.
INTRA_BWD_A_MAXNREG = 168
# How intra_wu_fwd.py gets row i of the diagonal blocks in each of the 15 steps of
# its forward substitution: 0 cut out of the blocks in registers (a cross-warp
# reduction), 1 loaded again from A_kk. On the H200 (bf16, B1-T8192-H16, two
# warps): intra_wu_fwd 0.229 -> 0.190 ms, forward 0.999 -> 0.958 ms, outputs
# bitwise the same (bench_kernels.py, 2026-11-30).
TM_ROW_LOADS = 1
# exp by the 2^x unit with subnormals flushed (_math.exp: MUFU.EX2 alone, where
# tl.exp's subnormal fix-ups cost three more instructions an exp) in the intra-chunk
# kernels: the forward's A's (row programs or per chunk) and W/U, the backward's A's
# (row programs where INTRA_BWD_A_ROWS_FAST_EXP too, or the split chunks per chunk) and
# its pass through W; the steep paths keep tl.exp. Never under the interpreter (inline
# PTX). On the H200 (2026-12-03, ours alone, B2-T8192-H8-HV32 layer-style): forward 1.862
# -> 1.829 ms (intra_wu_fwd 0.516 -> 0.470), intra_bwd_w 1.872 -> 1.807; but
# kda_intra_bwd_a_rows 1.990 -> 2.688: its registers went 161 -> 174 at four warps, two
# CTAs an SM instead of three (see INTRA_BWD_A_ROWS_MAXNREG).
FAST_EXP = 1
# The inverses of the diagonal blocks of I + diag(beta) A_kk in a launch of their own
# (diag_inv.py: one single-warp program per 16-row block, DIAG_INV_WARPS), which
# intra_wu_fwd.py merges into Tm with dots instead of running the substitution for the
# four blocks in each chunk's program. fla splits its solve so (a program per diagonal
# block, then the merge). The same substitution in the row programs of the forward A's
# (four warps) cost them 0.49 ms at B2-T8192-H8-HV32 for 0.13 off intra_wu_fwd (twenty-first
# session). On the H200 (2026-12-03, ours alone, layer-style, with INTRA_A_ROWS_WARPS = 2):
# forward 1.651 -> 1.605 ms at B2-T8192-H8-HV32 (intra_wu_fwd 0.470 -> 0.347, the launch
# 0.070), 0.577 -> 0.567 at B1-T8192-H16 (0.125 -> 0.095, 0.020); at two warps a block
# the launch took 0.190 ms at B2.
INTRA_DIAG_INV_KERNEL = 1
DIAG_INV_WARPS = 1
# ... and its blocks per program (1, 2 or 4), whose substitutions run side by side on one
# warp: H200 (2026-12-04, same process, layer-style) kda_diag_inv 0.070 -> 0.039 ms at
# B2-T8192-H8-HV32 with 4 (forward 1.600 -> 1.569 ms; 2: 0.042; 4 at two warps 0.123),
# 0.020 -> 0.013 at B1-T8192-H16.
DIAG_INV_BLOCKS = 4
# intra_wu_fwd's V block for U = Tm diag(beta) V (None: the common BV, 64 at K <=
# 128). On the H200 (bf16, bench_kernels.py, 2026-11-30, seventh session)
# intra_wu_fwd 0.625 -> 0.601 ms at B2-T8192-H8-HV32 and 0.182 -> 0.171 at
# B1-T8192-H16 at 32; 16 the same within noise (0.607 / 0.170). 2026-12-03 (with the
# diagonal-inverse launch): 64 took it 0.344 -> 0.372 ms at B2.
INTRA_WU_BV = 32
# ... and its K slices for W = Tm diag(beta) (K * exp(gam)) (None: the whole K in
# one, BK). H200 (2026-12-03, bf16, B2-T8192-H8-HV32 layer-style, ours alone, same
# process): 32 took intra_wu_fwd 0.582 -> 0.514 ms, forward 1.926 -> 1.857 (at four
# warps 0.665). sm_90a (two warps, Triton 3.6): 255 registers both ways, spills 620 ->
# 744 B: the slices' shorter live ranges, not the count, pay. 2026-12-03 (with the
# diagonal-inverse launch): 64 took it 0.344 -> 0.437 ms at B2.
INTRA_WU_BK = 32
# intra_a_fwd (the A's, Qg, Kr): K slices of BKA (bounded shared memory at any
# K); a cap on its registers per thread (None: the compiler's choice, 255 at every
# BKA; 168 lets three CTAs share an SM). On the H200 (bf16, bench_kernels.py,
# 2026-11-30) the kernel in one pass over K at BKA = 16 with the cap of 168 beat
# the former two passes at BKA = 64: intra_a_fwd 0.204 -> 0.197 ms at
# B1-T8192-H16, forward 2.416 -> 2.365 ms at B2-T8192-H8-HV32; the A's changed by
# 4e-4 (relative; the K slices' order of summation). Two passes at BKA = 32 or 16
# were slower (0.238, 0.252 ms), as was the cap of 128 (0.217). The two-pass form
# is gone (commit history). With gam from its own launch (INTRA_GAM_KERNEL) the
# K slices carry less: BKA = 32 took intra_a_fwd 0.424 -> 0.385 ms at B2 and
# 0.126 -> 0.114 at B1, forward 1.723 -> 1.688 and 0.590 -> 0.580 ms (H200,
# bench_kernels.py, 2026-11-30, seventh session).
BKA = 32
INTRA_A_FWD_MAXNREG = 168
# intra_a_fwd's test for a steep chunk: the spread of gam around the middle row
# kept elementwise over the K slices and reduced across warps once (1), instead
# of once per slice (0); the same result (bitwise, tests). On the H200
# (2026-11-30, same process): forward 1.898 -> 1.870 ms at B2-T8192-H8-HV32, 0.636
# -> 0.627 at B1-T8192-H16. Tried the same day and dropped: two programs per chunk
# with one A each (intra_a_fwd 0.714 -> 1.27 ms at B2), two pipeline stages
# (0.714 -> 0.776), eight warps (0.195 -> 0.232 at B1).
# 2 (gam on chip, INTRA_A_GAM_ON_CHIP): each row's largest over the slice (a reduction
# inside each warp), one cross-warp reduction after the loop, the same value: 16 fp32
# registers fewer live through the K loop than the tile (sm_90a, Triton 3.6, cap 168:
# spills 136/152 -> 20/24 B). On an H100 (2026-12-06, ours alone, kernels by GPU time):
# intra_a_fwd 1.048 -> 0.987 ms at B8-T8192-H16, forward 2.455 -> 2.395 ms; B2-T8192-H8-HV32
# 1.453 -> 1.423; B1-T32768-H16 1.760 -> 1.729. The loop where gam is read does not use it.
INTRA_A_SPREAD_TILE = 2
# intra_a_fwd with gam read (INTRA_GAM_KERNEL): a K loop per path (split at the middle
# row, block references, none; _a_slices), the path known before the loop, instead of one
# loop branching on it around its dots (1); the same values (bitwise under the
# interpreter, tests; the default path compiles to the same SASS as before). sm_90a (Triton
# 3.6, bf16, K = 128, the cap of 168): the split loop 1203 -> 617 instructions a K slice,
# its loads now taken by the pipeliner (async copies; shared 16 -> 49 KB, still three CTAs
# an SM) and no spill inside it (48 LDL a slice before). The form timed (its first, 851
# instructions a slice, also without spills) differed from this one only in where the
# middle row of gam is loaded. Timed on an H100 (2026-12-05, thirty-second session, ours
# alone, two rounds, kernels by GPU time): kda_intra_a_fwd 1.092 -> 0.833 ms at B8-T8192-H16 (forward 3.092 ->
# 2.826 ms, step 12.48 -> 12.23), 0.493 -> 0.405 at B2-T8192-H8-HV32 (forward 1.710 ->
# 1.619), 0.558 -> 0.432 at B1-T32768-H16 (2.065 -> 1.930); two or four stages gained less.
# On packed sequences mixed (varlen-mixed-T8192: forward kernels 0.570 -> 0.530 ms, step's
# 1.944 -> 1.968; the packed launch of that form spilled 1.7 KB, this one 136 B). The CUDA
# failures once blamed on it (thirty-second session) were the backward scan's (thirty-third:
# the defaults failed alike). Again on an H100 (2026-12-06): forward 3.085 -> 2.806 ms at
# B8, 1.709 -> 1.601 at B2, 2.061 -> 1.922 at B1-T32768. On since; test_cuda.py passed whole
# under it on the H200 the same day.
INTRA_A_MODE_LOOPS = 1
INTRA_A_FWD_STAGES = 3  # Triton's default, as launched before the setting (2 and 4: slower, above)
# gam = cumsum(g) in a launch of its own (gam_fwd.py, K blocks of BKG, GAM_WARPS
# warps) before intra_a_fwd, which then reads gam and its middle and last rows
# (1), instead of forming them per K slice with a cross-warp scan and two
# cross-warp reductions (0), the work that set intra_a_fwd's time (two programs
# per chunk, each with that work, took twice as long). Costs one more read of g.
# On the H200 (bf16, bench_kernels.py, 2026-11-30, seventh session, at BKA =
# 16): intra_a_fwd 0.679 -> 0.424 ms plus gam_fwd 0.132 at B2-T8192-H8-HV32,
# forward 1.846 -> 1.726 ms; B1-T8192-H16 0.623 -> 0.599. BKG = 32 (gam_fwd
# 0.149 ms at B2), 128 (0.133) and four warps (0.131) no better than 64. o
# differs from 0's by up to 5e-4 (relative; the GPU's scans associate
# differently; bitwise the same under the interpreter). Tried the same day and
# dropped: without a kernel of its own, gam formed again in intra_wu_fwd from g
# when nothing is kept (forward 1.846 -> 2.054 ms).
INTRA_GAM_KERNEL = 1
BKG = 64
# Where the forward keeps nothing and applies no gate, on bf16 inputs (fwd._gam_on_chip_serves): gam formed
# inside intra_a_fwd by tl.cumsum as INTRA_GAM_KERNEL = 0 does, but stored only as each
# chunk's last row (the scans' decay; a steep chunk's every row, for the steep launch), and
# Kb = diag(beta) K exp(gam) stored in the scans' operand dtype (bf16 for bf16 inputs) for
# intra_wu_fwd's W, which then reads neither K nor gam (1); or gam through memory as
# INTRA_GAM_KERNEL says (0). H100 (2026-12-06, ours alone, kernels by GPU time): forward
# 2.755 -> 2.462 ms at B8-T8192-H16 (gam_fwd's 0.36 ms gone, intra_a_fwd 0.81 -> 1.06,
# intra_wu_fwd 0.77 -> 0.60), 1.591 -> 1.451 at B2-T8192-H8-HV32, 1.907 -> 1.765 at
# B1-T32768-H16. Tried the same day and slower: the cumsum as three bf16 dots with the
# lower-triangular ones (exact products; B8 forward 2.787 ms: the [64, 64] operand spilled,
# 284 B), and Kb in fp32 (3.439 ms). Kb in bf16 rounds W's right-hand side as W itself is
# stored (o's error to the fp64 reference unchanged in the tests); chunks steep past
# MAX_SPLIT go to the steep launch (no block references in intra_a_fwd without gam_fwd's
# spreads).
INTRA_A_GAM_ON_CHIP = 1
# Two warps: four and eight took gam_fwd 0.083 -> 0.097 / 0.126 ms at B1-T8192-H16
# (layer flags) and 1.34 -> 1.98 ms (eight) at 2048 packed sequences of 1-64 tokens
# (H200, 2026-12-01, same process).
GAM_WARPS = 2
# With fla's gate in the kernel and every log decay <= 0 by its form, intra_a_fwd
# reads the spreads that choose its path off rows of gam (ROW_SPREADS), and gam_fwd
# skips its reductions (1); 0: gam_fwd's reductions always. The same paths.
GAM_ROW_SPREADS = 1
# K slices of the forward's steep path (intra_a_fwd.py)
BKS = 32
# K slices of the backward through the states and W (intra_bwd_w.py), one program
# each; each slice writes its own [C, C] share of dTm (fp32), which intra_bwd.py
# sums: K / BKS_W shares, live at the backward's peak (1.0 GiB at B8-T8192-H16 with
# 4 of them). 32 -> 64 (with 8 warps below) for that memory: 0.5 GiB less; the
# kernel's spills at bf16, K = 128 492 -> 88 bytes (kernel_resources.py).
BKS_W = 64
# intra_bwd_w's dO S0^T on bf16 operands where both are stored in bf16 (bf16 inputs
# and chunk states): the same products as TF32's (bf16 values are exact in both), fp32
# accumulation. H200 (2026-12-03, Triton 3.6, ours alone, layer-style, same process):
# kda_intra_bwd_w 2.205 -> 2.092 ms at B2-T8192-H8-HV32 and 0.562 -> 0.534 at
# B1-T8192-H16 (measured on a reordering of the kernel's tail, since dropped, which had
# taken it 2.086 -> 2.205). Its V block at 32 instead of 64 took it to 2.903 / 0.735.
INTRA_BWD_W_BF16_DQG = 1
# ... and its U' dS_C^T on bf16 operands where U' and dS_C are both stored in bf16
# (BF16_RESIDUALS, BF16_DSTATES): the same products again. H200 (2026-12-03, Triton 3.6,
# ours alone, layer-style, same process): kda_intra_bwd_w 2.039 -> 1.865 ms at
# B2-T8192-H8-HV32, 0.520 -> 0.475 at B1-T8192-H16. (dU' S0^T with dU' rounded to bf16
# on top, as fla's dv, was timed the same day: 1.892, no gain; dropped.)
INTRA_BWD_W_BF16_DKR = 1
# intra_bwd's dO U'^T on bf16 operands where dO and U' are both bf16: the same products
# as at TF32, fewer registers (sm_90a at four warps: 1.3 KB of spills -> 1.0). H200
# (2026-12-03, as above): kda_intra_bwd 1.034 -> 0.892 ms at B2, 0.269 -> 0.231 at B1;
# with INTRA_BWD_WARPS = 8 as well 0.868 / 0.225 (eight warps alone: 0.895 / 0.232).
# Under Triton 3.6-3.8 off whatever it says here, as SCAN_AQK_ROW_MASK below (its dO U'^T
# wgmma read both tiles straight from cp.async, unfenced), and U' then passes through
# registers on every dtype (intra_bwd.py UP_IN_REGISTERS), which fp16 inputs needed too.
INTRA_BWD_BF16_DAQK = 1
# dS_C, the grad of each chunk's leaving state (the backward's [NC, HV, K, V]
# buffer, also the prep kernel's Qg^T dO of the chunk), in bf16 for bf16 inputs
# instead of fp32, as fla keeps its dh in the input dtype: half its bytes (0.5
# GiB less at B8-T8192-H16, 1.5 GiB at 2048 packed sequences of 16 heads).
# Each chunk's entry is rounded once where it is stored; the reverse scan carries
# dS in fp32 registers, so the rounding does not accumulate over the chunks.
# fp32 and fp16 inputs keep fp32. 0 restores fp32.
BF16_DSTATES = 1
# dU', the grad of the residuals U' = U - W S0 (the backward's [B, T, HV, V] buffer that
# the fused scan writes and intra_bwd_w / intra_bwd read), in bf16 where the fused scan
# rounds it to bf16 for its own dot W^T dU' (SCAN_BWD_BF16_DOTS: bf16 inputs), as fla
# keeps its dv2 in the input dtype, instead of fp32: half its bytes in all three kernels.
# Its readers only take it into dots, which rounded it to TF32 before (10-bit mantissa;
# bf16 has 8): intra_bwd_w's dU' S0^T on bf16 operands where S0 is bf16 too, intra_bwd's
# two dots TF32 on the rounded values. 1: fixed-length inputs only, 2: packed sequences
# too, 0: fp32. H100 (2026-12-07, forty-sixth session, ours alone, two rounds, kernels by
# GPU time, 2 then): B2-T8192-H8-HV32 layer-style step 6.737 -> 6.609 ms (state_bwd_fused
# 0.660 -> 0.587, intra_bwd_w 1.637 -> 1.537, intra_bwd 0.825 -> 0.874), B8-T8192-H16 11.890
# -> 11.661, peak 3.26 -> 3.14 GiB at B2; packed, varlen-mixed-T8192 2.046 -> 2.019 but
# varlen-2048x1-64 14.113 -> 14.555 (intra_bwd 2.622 -> 3.086 ms), hence 1. intra_bwd
# converts dU' to fp32 for its TF32 dots (sm_90a: LDS 79 -> 113 a thread, the tile through
# shared memory for Tm^T dU'); Tm split in two bf16 parts for bf16 dots there spilled 232 B
# (a 706-instruction loop against 582): not kept.
BF16_DUP = 1
# K slices of the backward through the A's, one program each: BKD_A on the
# common path, BKD on the steep one (whose exact diagonal holds [BC, BC, BKD]).
BKD_A = 32
# The backward through the A's (intra_bwd_a.py) in one launch whose programs take
# their chunk's path by its steep flag (1), instead of two launches, one per kind
# of chunk, whose programs for the other kind's chunks read the flag and return (0:
# half of 394k programs at 2048 packed sequences of 1-64 tokens, 16 heads; an idle
# launch of 49k such programs cost 0.31 ms in the forward, H200). Needs BKD_A ==
# BKD. sm_90a: the one launch takes the steep variant's 255 registers (the common
# one 248) at four warps, the same occupancy. H200 (2026-12-02, fla's layer flags,
# same process): forward+backward at 2048 packed sequences 22.18 -> 21.75 ms,
# varlen-mixed-T8192 (host-bound) 5.25 -> 5.22; its GPU tests passed (grads bitwise
# the two launches', fla's layer flags against fla, test_cuda).
# 2 (the default since 2026-12-04): one launch for packed sequences only. Since the
# common variant fell to 168 registers (three CTAs an SM against the one launch's
# two, 255 registers with 0.6 KB of spills), two launches are faster on fixed-length
# sequences: H200 (twenty-sixth session, ours alone, standard inputs, two rounds)
# kda_intra_bwd_a 1.590 -> 1.331 ms at B2-T8192-H8-HV32 (forward+backward 6.600 ->
# 6.343 ms), 3.180 -> 2.678 at B8-T8192-H16 (13.257 -> 12.722). Packed sequences
# keep the one launch, where the idle programs of a second launch cost most (not
# re-timed since the registers fell). Fla's bounded gate takes the row programs
# (INTRA_BWD_A_ROW_PROGRAMS) and neither launch.
INTRA_BWD_A_ONE_LAUNCH = 2
# The block-reference path of the backward through the A's (every chunk with fla's
# gate at lower_bound -5) with each 16-row block's dots on its own rows of dA (1): four
# [BT, BT] x [BT, BKD] dots' work a program where the dots on every row with the other
# blocks' rows zeroed take sixteen (0). kda_intra_bwd_a was 8.79 of a 21.95 ms step at
# 2048 packed sequences of 1-64 tokens (H200, 2026-12-02). sm_90a, bf16, the gate's
# steep variant: HGMMA 128 -> 16 (the [16, 64] x [64, BKD] dots take mma.sync: HMMA 128
# -> 192), 15776 -> 16056 instructions, spills 1816 / 2048 -> 1640 / 2280 B, shared
# memory 57 -> 25 KB; the one launch likewise. H200 (2026-12-02, seventeenth session,
# ours alone, fla's layer flags, three rounds): forward+backward at 2048 packed sequences
# of 1-64 tokens 21.30 -> 20.90 ms (kda_intra_bwd_a 8.78 -> 8.38 ms of GPU time),
# B2-T8192-H8-HV32 layer-style 9.045 -> 8.987, varlen-mixed-T8192 0.731 -> 0.715 ms of
# kda_intra_bwd_a; its GPU tests passed (grads against the masked dots and the
# reference, fla's layer flags against fla, compiled training under it).
# OFF since 2026-12-03: compute-sanitizer (memcheck) reports invalid reads in this
# path (intra_bwd_a.py, dA_qk's rows of a block; addresses far outside any allocation,
# from a garbage column register in one warp: sm_90a, Triton 3.6), and on the H200
# test_cuda's bf16 strong-decay case faulted (illegal memory access) with it on; with
# it off the sanitizer reports 0 errors on the same case and test_cuda's cases pass.
# The inputs it was built for (fla's bounded gate) now take INTRA_BWD_A_ROW_PROGRAMS.
INTRA_BWD_A_ROW_BLOCK_DOTS = 0
# Where every chunk can take block references (fla's gate with lower_bound <= 0 and
# BC / 2 * |lower_bound| < MAX_SPLIT, as fla's layer trains), the backward through the
# A's as one program per 16-row block and a second launch for dg's reverse sum over
# the chunk (1, intra_bwd_a_rows.py; fla's intra backward runs one program per 16-row
# sub-chunk too), instead of one program per chunk (0). Built for the GVA shape with
# fla's layer flags, where kda_intra_bwd_a took 2.695 ms of an 8.95 ms step against
# fla's 1.658 (H200, 2026-12-03); sm_90a (bf16, K = 128, Triton 3.6): see
# benchmarks/NOTES.md. H200 (2026-12-03, bf16, fla's layer flags, B2-T8192-H8-HV32, same
# process): forward+backward 9.034 -> 8.646 ms (kda_intra_bwd_a 2.712 -> rows 2.028 +
# dg 0.307); MAXNREG=168 8.709, eight warps 11.793. Its CUDA tests passed (grads against
# the per-chunk path and the reference; fla's layer against fla).
INTRA_BWD_A_ROW_PROGRAMS = 1
# ... its warps per program, a cap on its registers per thread (None: the compiler's
# choice), and whether it takes FAST_EXP. sm_90a, bf16, K = 128, Triton 3.6, four warps:
# 161 registers with tl.exp (three CTAs an SM), 174 with FAST_EXP (two: 65536 / (128 *
# 176)); capped at 168 it keeps three, no spills, and FAST_EXP's instructions (1080
# against 1184). H200 (2026-12-03, ours alone, B2-T8192-H8-HV32 layer-style):
# kda_intra_bwd_a_rows 2.685 ms uncapped, 2.001 capped, 2.050 capped without FAST_EXP
# (step 8.053 / 7.389 / 7.435 ms). (At 192 registers, before, the cap cost 0.06 ms a step.)
# 168 -> 128 on 2026-12-07 (forty-second session): four CTAs an SM instead of three, 112 B
# spilled (sm_90a, bf16, K = 128, Triton 3.6). H100, B2-T8192-H8-HV32 layer-style beside fla
# in one process (two rounds): kda_intra_bwd_a_rows 2.071 -> 1.869 ms, forward+backward 7.744
# -> 7.574 ms (fla 9.028: 0.86x -> 0.84x); ours alone, the packed rows' steps 2.355 -> 2.291 ms
# (varlen-mixed-T8192) and 16.695 -> 16.103 (varlen-2048x1-64); their GPU tests passed under it.
# Slower: K slices of 16 (BKD_A; the step 9.76 ms), one program walking a chunk's row blocks
# (2.080 ms; removed). Timed 2026-12-07 (forty-fourth session, H100, B2-T8192-H8-HV32
# layer-style, ours alone, 1.865 ms here) and removed (the code is at 80e41d4): the block's dA
# columns and dq / dk / d(gam) rows loaded at the start (EARLY_LOADS: 2.896 ms, 280 B spilled);
# one program per key head summing its G value heads' dq, dk so that gva_reduce does not run
# (GVA: 2.568 ms at this cap, 2.070 at 168 with gva_reduce's 0.20 ms saved: the step 7.357
# against 7.341 ms, the peak the same).
# Two warps (with SUB_BLOCKS below, at the cap of 96): its [BC, BKD] tiles are small. H100
# (2026-12-07, forty-fifth session, ours alone, two rounds, kernels by GPU time,
# B2-T8192-H8-HV32 layer-style), kda_intra_bwd_a_rows with SUB_BLOCKS: 1.916 ms at four warps
# (cap 128), 1.687 (cap 96), 1.600 (cap 80); at two warps 1.404 (cap 128, no spill), 1.406
# (cap 96, 76 B spilled), 1.520 (cap 80), 1.583 (cap 168); at one warp 1.461. The packed rows
# at two warps: varlen-2048x1-64 3.621 (cap 128) / 3.465 (cap 96), varlen-mixed-T8192 0.372 /
# 0.369 (1.883, 5.062, 0.492 ms before, the one-dot form at four warps, cap 128). The one-dot
# form (SUB_BLOCKS = 0) was timed at four warps and a cap of 128.
# Four with K slices of 64 (INTRA_BWD_A_ROWS_BKD, forty-sixth session).
INTRA_BWD_A_ROWS_WARPS = 4
# The row programs' K slice (None: BKD_A). sm_90a, Triton 3.6, bf16, fla's bounded gate: 64
# at eight warps takes 174 registers uncapped (no spill, one CTA an SM), 128 capped (64 B
# spilled, two CTAs an SM, the occupancy of 32 at four warps) with half the programs, each
# loading the block's dA rows and columns once for 64 columns of K instead of 32. H100
# (2026-12-07, forty-fourth session, ours alone, B2-T8192-H8-HV32 layer-style, two rounds):
# kda_intra_bwd_a_rows 1.867 -> 1.889 ms capped, 2.891 uncapped: not on. With SUB_BLOCKS
# (below) 64 at four warps capped at 128: 126 registers, no spill (fp32 inputs 48 B). H100
# (2026-12-07, forty-sixth session, ours alone, two rounds, kernels by GPU time; two warps,
# K slices of 32, cap 96 before): kda_intra_bwd_a_rows 1.399 -> 1.337 ms at B2-T8192-H8-HV32
# layer-style (step 6.737 -> 6.662), 3.450 -> 3.320 at varlen-2048x1-64 (14.113 -> 13.982),
# 0.374 -> 0.355 at varlen-mixed-T8192; 16 at one warp, capped at 128: 1.966 / 4.755 / 0.532.
INTRA_BWD_A_ROWS_BKD = 64
INTRA_BWD_A_ROWS_MAXNREG = 128
INTRA_BWD_A_ROWS_FAST_EXP = 1
# The row programs' sums over the chunk's rows walked BC rows at a time, only over the row
# blocks where dA can be nonzero (1: the block's rows over the blocks up to its own, its
# columns over those from its own on; five [BC, BKD] tiles of Q, K, gam and their exps a
# program, from L1 in turn), instead of one dot each over all BT rows with the rest masked
# (0: eight). Aimed at what ncu found the kernel bound by (below). sm_90a, Triton 3.6, bf16,
# fla's bounded gate: 124 registers and no spill uncapped under the cap of 128 (112 B now), 920
# SASS instructions against 1,176 (LDS 74 + LDSM 2 against 133, STS 21 against 45, HMMA 8 a
# loop pass); no spill at a cap of 96 (five CTAs an SM), 12 B at 80 (six). Built 2026-12-07
# (forty-fourth session); on since the forty-fifth (H100, ours alone, two rounds, kernels by
# GPU time, B2-T8192-H8-HV32 layer-style): kda_intra_bwd_a_rows 1.883 -> 1.404 ms at two warps
# (see INTRA_BWD_A_ROWS_WARPS), the step 7.217 -> 6.760 ms; varlen-2048x1-64 step 15.519 ->
# 14.024 (cap 96), varlen-mixed-T8192 3.315 -> 3.113 (host-bound rounds).
INTRA_BWD_A_ROWS_SUB_BLOCKS = 1
# The row programs' dots stay TF32 on bf16 inputs. ncu (H100, 2026-12-07, B2-T8192-H8-HV32
# layer-style) finds the kernel bound by L1 / shared memory (L1/TEX throughput 77%, DRAM 37%;
# sm_90a: 133 LDS, 45 STS a thread, most of them the TF32 operands' way into the dots, and
# 112 B of spills); bf16 operands would halve that (85 LDS + 6 LDSM, 39 STS, 96 B spilled) but
# d(gam) sums terms that cancel (Q T_q + K (T_k - T_kj)): under the interpreter, fla's bounded
# gate, bf16 inputs, against the fp64 reference, dg's error 2.1e-3 -> 4.3e-2 and dA_log's,
# ddt_bias's 2.6e-3 -> 0.20 (dq, dk 3.6e-3 -> 4.3e-3). Built and removed the forty-fourth session.
# ... and its second launch (dg's reverse sum over each chunk, the gate's backward):
# K slices and warps per program. H200 (2026-12-03, B2-T8192-H8-HV32 layer-style, ours
# alone): 0.306 ms at 32 / four warps, 0.223 at 32 / two (forward+backward 8.549 ->
# 8.465), 0.271 at 64 / four, 0.414 at 128 / eight. Its bytes take ~0.13.
DG_OF_CHUNK_BK = 32
DG_OF_CHUNK_WARPS = 2
# 16 -> 32 on the H200 (2026-12-01, bf16, fla's layer flags, where most chunks are
# steep): forward+backward 4.747 -> 3.751 ms at B1-T8192-H16 (fla 3.72), o the same.
BKD = 32
# The forward's steep A's (intra_a_fwd.py's steep kernel): one program per row
# block of BC rows (1; four per chunk, more programs in flight) or one per chunk
# looping over its blocks (0). Steep chunks are the common case with fla's layer
# gate (lower_bound = -5: gates near -2.5 per token on average), where the looping
# form took 0.415 of a 1.0 ms forward at B1-T8192-H16 (H200, 2026-12-01).
STEEP_FWD_ROW_PROGRAMS = 1
# The steep launches (the forward's above, the backward's through the A's where it is a
# launch of its own: INTRA_BWD_A_ONE_LAUNCH) as work lists (1; _indexing.work_list_*): a
# 1-D grid of WORK_LIST_PER_SM programs an SM (WORK_LIST_PROGRAMS: None counts the
# device's SMs; a number: that many programs in all), each reading its share of the flags
# WORK_LIST_BLOCK at a time and forming the flagged items, instead of one program per item
# (0). At the standard inputs (fp32 log decays, the host cannot bound the gate) almost no
# chunk is steep, yet the launches run: the forward's 32768 programs that only read their
# flag took 0.059 ms at B2-T8192-H8-HV32 and 0.117 at B8-T8192-H16 (H200, 2026-12-04),
# the backward's as many again. On the H200 (2026-12-05, ours alone, kernels by GPU time):
# the forward's steep launch 0.116 -> 0.005 ms at B8-T8192-H16, kda_intra_bwd_a 2.662 ->
# 2.552; forward 3.003 -> 2.902 ms, step 12.696 -> 12.492 (B2-T8192-H8-HV32: 1.494 ->
# 1.448, 6.314 -> 6.234; B1-T32768-H16: 1.986 -> 1.942, 8.081 -> 7.984).
STEEP_WORK_LIST = 1
WORK_LIST_PER_SM = 8
WORK_LIST_PROGRAMS = None
WORK_LIST_BLOCK = 64
# Steep chunks whose gam strays at most MAX_SPLIT from the middle row of each
# BC-row block (gates down to about -7.5 per token: fla's safe_gate range, its
# layer's -5) take those middle rows as references for the whole row block, the
# diagonal block included, instead of the first row for the columns before it and
# a split or exact pairs for the diagonal block (1), in one pass without a branch
# per K slice; the backward then runs the common path's dots, four per block. The
# others go as before (0: always as before). On the H200 (2026-12-01, bf16, fla's
# layer flags, B1-T8192-H16, in one process): forward 1.049 -> 0.880 ms, forward +
# backward 3.841 -> 3.200 (fla 3.59-4.13 wall; intra_bwd_a 1.206 -> 0.734 ms,
# the forward's steep A's 0.471 -> 0.300), o the same to 4e-3 of fla's: on.
STEEP_BLOCK_REFS = 1
# ... and in the forward, such chunks (every block within MAX_SPLIT of its middle
# row, as gam_fwd.py measures it before intra_a_fwd runs) take those references in
# the common kernel (1: four dots a K slice instead of the split's one, no steep
# launch for them) rather than in the steep launch (0). With fla's layer gate
# (lower_bound -5) nearly every chunk is steep and every one of them qualifies:
# the steep launch took 0.30 of a 0.87 ms forward (GPU time, B1-T8192-H16) and 3.06
# of 11.9 at 2048 packed sequences of 1-64 tokens (H200, 2026-12-01). Untimed.
INTRA_A_BLOCK_REFS = 1
# ... and where every chunk can take them (fla's bounded gate, as fla's layer trains:
# _host._gate_bounds_every_block), the A's, Qg and Kr by one program per 16-row block
# whose dots cover its own rows (1, intra_a_fwd_rows.py), instead of one program per
# chunk whose block-reference dots run over every row with the other blocks' rows
# zeroed (0: four times the dots' work). Built for B2-T8192-H8-HV32 layer-style, where
# intra_a_fwd took 0.758 ms against 0.507 on the standard inputs. H200 (2026-12-03,
# bf16, same process, with INTRA_BWD_A_ROW_PROGRAMS): forward 1.978 -> 1.937 ms
# (kda_intra_a_fwd 0.760 -> rows 0.718); with K slices of 32: 2.028 (0.814).
INTRA_A_ROW_PROGRAMS = 1
# ... its K slices, warps, pipeline stages and register cap (None: the compiler's
# choice). sm_90a (bf16, K = 128, Triton 3.6): K slices of 16 at four warps, three
# stages: 128 registers, no spills, 15 KB shared (four CTAs an SM); of 32: 252
# registers (one stage: 255 and spills; a cap of 128: 192 B spilled).
INTRA_A_ROWS_BK = 16
# Two warps (2026-12-03, H200, ours alone, layer-style, FAST_EXP): kda_intra_a_fwd_rows
# 0.733 -> 0.556 ms at B2-T8192-H8-HV32 (forward 1.829 -> 1.651), 0.195 -> 0.152 at
# B1-T8192-H16; two warps with two stages 0.588; one warp 0.551 (within noise). (At
# four warps ncu found its L1 80% busy and a quarter of the warp slots taken, bound by
# registers.)
INTRA_A_ROWS_WARPS = 2
INTRA_A_ROWS_STAGES = 3
# 128 registers (two warps, sm_90a, Triton 3.6: 144 -> 126, no spills; eight CTAs an SM
# instead of seven): H200 (2026-12-04, same process, layer-style) kda_intra_a_fwd_rows
# 0.554 -> 0.540 ms in the forward and 0.576 -> 0.544 in the backward's recompute at
# B2-T8192-H8-HV32 (forward+backward 7.467 -> 7.435 ms), 0.152 -> 0.148 at B1-T8192-H16.
INTRA_A_ROWS_MAXNREG = 128
# (One program per two row blocks, the columns' rows of K and gam loaded once for both,
# 96 such rows a chunk instead of 176: slower on the H200 at every setting tried,
# 2026-12-04, B2-T8192-H8-HV32 forward 1.559 -> 1.693 ms at four warps, 1.669 capped at
# 128 registers, 1.888 at eight warps, 1.642 at two; removed, benchmarks/NOTES.md.)
# 1: in a forward that keeps nothing on bf16 inputs (fla's layer flags at inference), the
# row programs also store Kb = diag(beta) K exp(gam) into W's buffer for intra_wu_fwd's W
# (fwd._rows_kbg_serves), as intra_a_fwd does with gam on chip: intra_wu_fwd then reads
# neither K nor gam (fp32) nor forms exp(gam) again. At B2-T8192-H8-HV32 that is 0.27 GB of
# gam and 0.03 GB of K (0.13 GB as loaded: four value heads a key head) read against 0.27 GB
# of Kb written and read: little; at one value head a key head (B1-T8192-H16, packed rows)
# 6 bytes an element read against 4. Built 2026-12-06 (thirty-ninth session). On an H100
# (fortieth session): ours alone, kernels by GPU time at B2 layer-style, the row kernel
# 0.541 -> 0.577 ms and intra_wu_fwd 0.374 -> 0.316 (the forward's kernels 1.578 -> 1.555);
# beside fla in one process, the forward 1.615 -> 1.589 ms (0.87x -> 0.86x fla's 1.854), the
# step unchanged (it keeps its intermediates: the setting does not apply); 2048 packed
# sequences of 1-64 tokens 3.40 -> 3.28 ms. Its CUDA tests (the row, gate, packed and layer
# cases of test_fla_options and test_triton_kernels, the hand-Kb test among them) passed.
INTRA_A_ROWS_KBG = 1
# 1 (with INTRA_A_ROWS_KBG): the row programs also form gam from the raw gate themselves
# (intra_a_fwd_rows.py's GAM_ON_CHIP), each program its chunk's whole gam a K slice at a
# time, so that gam_fwd does not run and gam never goes through memory but each chunk's last
# row (the scans' decay): at B2-T8192-H8-HV32 layer-style gam_fwd's 0.13 GB of raw gate read
# and 0.27 GB of gam written, and the row programs' 0.27 GB of gam read (0.13 GB of raw gate
# instead), are gone. Built 2026-12-06 (thirty-ninth session); timed on an H100 (fortieth
# session, ours alone, kernels by GPU time): the row kernel 0.577 -> 2.231 ms at B2 layer-style
# (its 64-row cumsum and row selections a K slice, 5,408 SASS instructions against 2,480),
# the forward 1.569 -> 3.068 ms wall, 3.28 -> 7.63 ms at 2048 packed sequences: off.
INTRA_A_ROWS_GAM_ON_CHIP = 0
# With INTRA_A_BLOCK_REFS, the steep launch not run where no chunk can need it (fwd._no_steep_launch:
# fla's bounded gate with |lower_bound| <= 7.375, block references on), instead of
# always (0). On the H200 (2026-12-01, same process, fla's layer flags, 2048 packed
# sequences of 1-64 tokens): forward 6.921 -> 6.664 ms, forward+backward 22.507 ->
# 22.247 (the launch's 0.309 ms of exits gone; 0.015 ms at varlen-mixed).
SKIP_IDLE_STEEP_LAUNCH = 1
# The scans: one program per (V block of BV_SCAN, batch * value head), sequential
# over chunks. SCAN_WARPS spread the [BK, BV_SCAN] fp32 state; they prefetch the
# next chunk (two stages) where BK <= 128, which fits the H200's 227 KB of shared
# memory at fp32 (the backward scan: 156 KB at BK = 128, 270 KB at 256 by compiling).
BV_SCAN = 16  # 32 -> 16 on the H200: forward scan 0.39 -> 0.35 ms, backward scan even (B1-T8192-H16, bf16)
# ... but only where W and Kr are bf16 (bf16 inputs). With fp32 W and Kr (fp32 and
# fp16 inputs) the first forward at BV_SCAN = 16 hit an illegal memory access on
# the H200 (2026-11-30; every fp32 and fp16 CUDA test, while bf16 passed; no
# device time was left to confirm the cause in isolation). At 32 every CUDA test
# had passed earlier that day, and a V block of 16 is the one earlier seen to
# give a wrong dk under fp32 (see _sizes).
BV_SCAN_FP32_OPERANDS = 32
# ... the smallest of those, doubled up to BV_SCAN_MAX, that keeps the scan's
# programs within one wave (one per SM): a scan program is a serial chain, so a
# second wave doubles the scan's time. At B2-T8192-H8-HV32 (64 heads) a V block of
# 16 made 512 programs, four waves on the H200's 132 SMs: forward 3.6 ms where
# fla took 1.76 (2026-11-30). SCAN_SMS: None counts the device's SMs; under the
# interpreter (CPU CI), the H200's 132.
BV_SCAN_MAX = 64
SCAN_SMS = None
SCAN_WARPS = 8
SCAN_STAGES = 2  # where BK <= 128; one stage above
# (SCAN_BWD_PREFETCH, 2026-12-02 and -03: the backward scan beside the prep kernel with each
# chunk's operands loaded a chunk ahead, or all at the top of the chunk, gained at B1 and
# faulted with bf16 inputs at a V block of 16 (illegal memory access; compute-sanitizer
# found no access outside an allocation); removed once the fused scan below took its
# place. benchmarks/NOTES.md has its history.)
# ... but SCAN_STAGES_WIDE_BF16 at BK = 256 with bf16 operands (bf16 inputs). On the
# H200 (Triton 3.6) test_cuda.py's bf16 case at K = 256 gave o 7.3e-2 off the fp64
# reference in every run at one stage (a call of the thirteenth session and twice in
# the fourteenth's first, deterministically) and passed in the five runs at two stages
# between them, though benchmarks/kernel_resources.py found the scans' SASS the same at
# one, two or three stages there (sm_90a: the pipeliner does not take their loads);
# one stage in the forward scan was also wrong at K = 64 / 128 (SHORT_SEQ_CHUNKS
# below). fp32 operands keep one stage at BK = 256 (shared memory), and pass.
SCAN_STAGES_WIDE_BF16 = 2
# The backward scan with its parallel part inside (state_bwd.py's fused kernel), as
# fla's dh kernel: each chunk forms A_qk^T dO and Qg^T dO itself instead of reading them
# from the prep kernel (whose Qg^T dO shared dS_C's slot, so each chunk passed a barrier
# between reading and overwriting it); the prep kernel then runs only where the forward
# kept no U'. Its dots on bf16 operands where Qg, Kr, W, A_qk and dO are bf16
# (SCAN_BWD_BF16_DOTS: dS_C and dU' rounded to bf16 on entering them, as fla; dS carried
# in fp32). Its V block: at least BV_SCAN_BWD_MIN, doubled to one wave of SCAN_BWD_PER_SM
# programs an SM; SCAN_BWD_STAGES where the operands are bf16 and BK <= 128 (one stage
# otherwise: shared memory; test_cuda.py's bf16 case at K = 256 passed so on the H200). H200 (2026-12-03, Triton 3.6, ours alone, layer-style, same
# process): state_bwd_prep + state_bwd 0.373 + 0.725 -> 0.626 ms at B2-T8192-H8-HV32 (V
# block 64), step 8.478 -> 8.006 ms; 0.095 + 0.496 -> 0.461 at B1-T8192-H16 (V block 32).
# With TF32 dots 1.003 ms at B2, with two programs an SM (V block 32) 0.990. A V block of
# 16 (BV_SCAN_BWD_MIN = 16 at B1) hit an illegal memory access on its first call, as the
# other scans did at 16 (BV_SCAN_FP32_OPERANDS, the prefetch above); the interpreter's
# bounds check finds no access outside its tensors. 0: the scan beside the prep kernel.
SCAN_BWD_FUSED = 1
# ... its bf16 dots only where dS_C is stored in bf16 too (BF16_DSTATES): with fp32 dS_C
# (BF16_DSTATES = 0, bf16 A_qk, fp32 U' and states; a non-default mix) they gave an illegal
# memory access or wrong dv / dbeta (0.28 / 0.17 off the fp64 reference) on the H200
# (2026-12-03 and -04, Triton 3.6, K = V = 32, test_triton_bf16_inputs_match_reference's
# bf16_dots7), where compute-sanitizer found no access outside an allocation and the
# interpreter gives 3.4e-3; TF32 dots there (and the unfused scan) pass. Cause not found.
SCAN_BWD_BF16_DOTS = 1
BV_SCAN_BWD_MIN = 32
SCAN_BWD_PER_SM = 1
SCAN_BWD_STAGES = 2
SCAN_BWD_WARPS = None  # None: SCAN_BWD_WARPS_BV16 at a V block of 16, SCAN_WARPS above (_host.scan_bwd_warps)
# ... at a V block of 16 (BV_SCAN_BWD_MIN = 16: every SM busy where the heads are few) and
# BK <= 128 (at 256 four warps spill 272 B; sm_90a, Triton 3.6), four warps: on the H200 (2026-12-05, ours alone, B1-T32768-H16, one process per variant) it ran
# without a fault (at eight warps it faulted, above), its grads within 5e-5 of the V block
# of 32's (norm-relative), kda_state_bwd_fused 1.845 -> 1.598 ms, step 7.758 -> 7.489 ms
# (four warps at 32: 1.745 ms, step 7.621). ncu of the V block of 32 (eight warps, 64
# programs: half the SMs): 10 cycles between a warp's instructions, a third of them waiting
# on loads; 9.5% of the SMs' compute, 10% of DRAM. BV_SCAN_BWD_MIN stays 32 until the GPU
# tests have run at 16 (KDA_TEST_SETTINGS="BV_SCAN_BWD_MIN=16").
SCAN_BWD_WARPS_BV16 = 4
# The scans' loads that the pipeliner leaves on each chunk's path (sm_90a SASS, Triton 3.6,
# benchmarks/kernel_resources.py --sass, 2026-12-05): the chunk's last row of gam (two LDG a
# thread, loaded just before its use, in both scans) and, in the fused backward scan, A_qk
# under its causal mask (16 LDG.U16 a thread, element by element). SCAN_GLAST_AHEAD (1):
# gam's row loaded a chunk ahead, carried into the next chunk. SCAN_AQK_ROW_MASK (1): A_qk
# loaded under its row mask alone (vectorised; the pipeliner then takes it into shared
# memory, 123 -> 131 KB at a V block of 32) and its upper triangle zeroed after the load;
# the backward loop 555 -> 493 instructions. ncu of the backward scan at B1-T32768-H16
# (2026-12-05): a third of the warps' stall cycles wait on such loads. Built 2026-12-05
# after the session's device time (the interpreter's tests: the same values): 0 until timed
# (an earlier prefetch of the backward scan's tiles faulted on the H200, SCAN_BWD_PREFETCH).
# On the H200 (2026-12-05, thirtieth session, ours alone, two rounds, bench_chunk_kda.py
# --kernels), both on: kda_state_bwd_fused 1.822 -> 1.247 ms (B1-T32768-H16) and 1.270 -> 0.889 ms
# (B8-T8192-H16), 0.630 -> 0.457 (B2-T8192-H8-HV32); forward+backward 7.703 -> 6.993 ms,
# 11.959 -> 11.557, 6.198 -> 6.009; forward 1.943 -> 1.802 at B1-T32768-H16: on.
# Under Triton 3.6-3.8 the host leaves SCAN_AQK_ROW_MASK off whatever it says here
# (_host._cp_async_wgmma_fenced): the A_qk tile then feeds A_qk^T dO from registers, and
# those Triton versions put no proxy fence between the dO tile that cp.async wrote and that
# wgmma (sm_90a TTGIR; Triton 3.9 does): on an H100 the backward gave dh0 with NaN in a
# column (T = 9, bf16). Its share of the gain above was not timed apart from the loads ahead.
SCAN_GLAST_AHEAD = 1
SCAN_AQK_ROW_MASK = 1
# SCAN_GLAST_AHEAD in the fused backward scan (its own setting since 2026-12-05): off. On an
# H100 (torch 2.11, Triton 3.6; thirty-third session, run_gpu.sh cuda-bisect) test_cuda.py's
# short_sequences[9-bf16] (T = 9, h0 and dht) gave dh0 with NaN down one column under the
# defaults (SCAN_AQK_ROW_MASK already left off by the host there) and passed with the row of gam
# loaded where it is used. The interpreter gives the same bits either way and the kernel's
# TTGIR has the same fences and waits either way: the cause is not found. The gain it gave
# the backward scan (thirtieth session, with SCAN_AQK_ROW_MASK) is given up until it is.
# On again (2026-12-06) where profiling/bwd_scan_diff.py found it right on an H100: the NaN came
# only with one-chunk sequences in V blocks of 32 (T = 9 and 40; T = 65 to 300 right, and every
# T in V blocks of 64), so the host takes it only outside that (bwd._bwd_scan_loads_glast_ahead).
# Worth 0.22 ms of B1-T32768-H16's step on an H100 (thirty-third session, same process).
SCAN_BWD_GLAST_AHEAD = 1
# The forward scan alone (None: as above): its warps, stages (bf16 operands and
# BK <= 128 only; see _sizes) and V block (before the doubling to one wave); and
# how many of its programs one SM runs at once, for the V block's choice (a wave =
# SMs x SCAN_FWD_PER_SM). On the H200 (bf16 dots, 2026-11-30): three stages
# 0.282 -> 0.208 ms at B1-T8192-H16 (fla's scan: 0.199) and 0.472 -> 0.426 at
# B2-T8192-H8-HV32 (fla's: 0.298); forward at B2 with four warps 2.119 ms against
# 2.127 (noise), with four warps and two programs per SM (V block 32) 2.246.
SCAN_FWD_WARPS = None
SCAN_FWD_STAGES = 3
BV_SCAN_FWD = None
SCAN_FWD_PER_SM = 1
# Packed sequences of at most SHORT_SEQ_CHUNKS chunks on average (T <= that * BT * N,
# known on the host without a sync; not under tracing, where T stays symbolic): the
# scans' V block is chosen from the N sequences, not from B = 1 (at 2048 sequences of
# 16 heads a V block of 16 makes 262144 one-chunk programs, one per SM at a time).
# On the H200 (2026-12-01, same process, varlen-2048x1-64,
# fla's layer flags): state_fwd 3.43 -> 2.13 ms, state_bwd 0.81 -> 0.25, forward
# 10.14 -> 8.89 ms, forward+backward 26.29 -> 24.60 (V blocks 16 -> 64); varlen-mixed
# (ten sequences of 8192 tokens: 13 chunks each on average) is not short. Their own
# warps and stages (knobs removed in the fourteenth session) never helped: four warps
# at one stage (state_fwd 3.41 -> 2.04 ms at 2048 sequences of 1-64
# tokens, H200, 2026-12-01) gave wrong results or an
# illegal memory access on the H200 (Triton 3.6, bf16) as soon as a sequence had more
# than one chunk; a probe of the scan alone found one stage broken at K = 64 and 128
# with four or eight warps, three stages right at either (the interpreter cannot show
# it; fp32 at K = 256, which takes one stage too, passes the CUDA tests).
SHORT_SEQ_CHUNKS = 2
# ... and for such sequences the intra-chunk forward kernels (intra_a_fwd, intra_wu_fwd)
# take the chunks of at most SHORT_TILE rows in launches of their own on [SHORT_TILE,
# SHORT_TILE] tiles (a quarter of the dots' work, half the rows), which the launches
# at BT skip (0: every chunk on [BT, BT] tiles). At 2048 packed sequences of 1-64
# tokens half the chunks are that short; there the two kernels took 4.45 of a 6.91 ms
# forward on [64, 64] tiles (fla: 5.55 in all). On the H200 (2026-12-01, same process,
# fla's layer flags): intra_wu_fwd 2.307 -> 2.131 ms, intra_a_fwd 2.191 -> 2.052,
# forward 6.719 -> 6.385 ms (fla 5.606), forward+backward 22.475 -> 22.109; varlen-mixed
# (not short) the same.
SHORT_TILE = 32
# ... in launches of their own (2: the launches at BT skip those chunks, and each
# launch's programs for the other's chunks only return), or in one launch per
# kernel whose programs pick the tile by their chunk's rows (1: no program only
# returns; sm_90a registers and occupancy are those of the [BT, BT] path either
# way, intra_a_fwd 168 registers at four warps, intra_wu_fwd 255 at two). 1 was
# written in the fifteenth session without a device; on the H200 (2026-12-02, same
# process) it was slower: forward at 2048 packed sequences 6.545 -> 6.679 ms (with
# SKIP_UNREAD and the one-launch backward: 5.415 -> 5.638), so 2 stays.
SHORT_TILE_LAUNCHES = 2
# The forward forms nothing that nothing reads: 1 = a one-chunk packed sequence
# whose leaving state nothing keeps (compact chunk states, no final state: training)
# loads no Kr and forms no state; and where the forward keeps no intermediates
# (inference, or a forward under no_grad), for packed sequences without initial
# states, the output kernel reads each sequence's first chunk's U' from U (the same
# values: S0 = 0 there), so the scan does not copy U to U' there; intra_wu_fwd stores
# no W there (the scan reads none: U' = U) and intra_a_fwd no Qg for first chunks
# (the output skips Qg S0 there) and, with compact chunk states and no final state, no
# Kr for last chunks. At 2048 packed sequences of 1-64 tokens (every one a single
# chunk) the forward under no_grad then leaves out U', W, Qg and Kr whole (about 1.1 GB
# of bf16 writes) and the scan's every program (state_fwd took 1.10 ms, H200). On the
# H200 (2026-12-02, fla's layer flags, same process): forward at 2048 packed sequences
# 6.545 -> 5.415 ms (fla 5.57), forward+backward 22.18 -> 21.73; its GPU tests passed
# (bitwise the forward that writes everything, the byte-pattern check, fla's layer).
SKIP_UNREAD = 1
# The backward's dS_C buffer (bf16 or fp32 [slots, HV, K, V], live at the backward's
# peak) for packed sequences without dh0 and dht (training): 1 = each sequence one slot
# fewer than its chunks (chunk c's Qg^T dO put in chunk c - 1's slot), T // 64 slots in
# all, instead of one per chunk slot (T // 64 + N): 1.45 -> 0.50 GiB at 2048 sequences of
# 1-64 tokens (16 heads, bf16; the step's peak by profiling/memory_budget.py's tracker
# 10.10 -> 9.35 GiB). The same grads bitwise (tests, on the H200 too). On the H200
# (2026-12-01, same process, varlen-2048x1-64): peak 9.70 -> 8.95 GiB (fla 8.57),
# forward+backward 22.898 -> 22.917 ms (noise).
COMPACT_DSTATES = 1
# bf16 inputs: the forward scan's (SCAN_) and the output's (OUTPUT_) dots take bf16
# operands, the state and U' rounded to bf16 as they enter them (fp32
# accumulation, fp32 state throughout), as fla's forward does; 0 keeps TF32 dots.
# On the H200 (B1-T8192-H16, 2026-11-30, bench_kernels.py): the output kernel
# 0.199 -> 0.091 ms with o within 3.3e-3 (relative) of the TF32 one, the level of
# its own bf16 rounding (o's relative difference to fla stays 4.0e-3): on. The
# scan 0.357 -> 0.282 ms (0.208 with three stages; B2: 0.664 -> 0.426), the fp32
# final state's relative difference to fla's 2.5e-3 -> 3.1e-3 (B2 2.4e-3 ->
# 2.9e-3) and to the fp64 reference on the same bf16-rounded inputs 0.9e-3 ->
# 2.0e-3 (interpreter with the GPU's round-to-nearest, _dot.py, T = 512, K = V =
# 64; o unchanged at 2.9e-3): below bf16's own rounding (3.9e-3), as in fla, whose
# scan rounds the same operands: on (since 2026-11-30; 0 restores TF32 dots).
SCAN_BF16_DOTS = 1
OUTPUT_BF16_DOTS = 1
# The same for intra_wu_fwd's W = Tm (...) and U = Tm (...) (W is stored in bf16
# anyway): on the H200 (2026-11-30) forward 2.416 -> 2.371 ms at B2 for a 3.3e-3
# change of the grads: off. (bf16 dots in the backward scan, tried the same day,
# hit an illegal memory access on the H200 and were removed.)
WU_BF16_DOTS = 0
# The output kernel's V block (None: the common BV) and warps per program: 8 -> 4
# warps 0.199 -> 0.130 ms (same run; 0.091 -> 0.074 with bf16 dots). A V block of
# 128 (one program per chunk) was slower: 0.206.
BV_OUTPUT = None
OUTPUT_WARPS = 4
# The forward scan writes the output itself (state_output_fwd.py; 1) where its V block is at
# least FUSED_OUTPUT_MIN_BV, i.e. where its programs fill the device (B8-T8192-H16 and
# B2-T8192-H8-HV32: V block 64); 0: the scan then the output kernel. It saves the output
# kernel (0.350 ms of B8-T8192-H16's 2.889 ms forward on the H200, 2026-12-05), U' and the
# chunk states' reads, and, in a forward that keeps nothing (no grad; the pool's prefill),
# their writes too: 1.5 KB a token and head at K = V = 128. The third session's output inside
# the scan at B1-T8192-H16 (V block 16, the scan latency bound) took the scan 0.35 -> 0.67 ms
# for the output's 0.07: hence the V-block floor. Built 2026-12-05 without a device
# (interpreter tests; compiled for sm_90a): 0 until timed.
# On the H200 (2026-12-05, thirtieth session, ours alone, two rounds): B8-T8192-H16 forward
# 2.909 -> 2.639 ms (the fused scan 0.709 ms against the scan's 0.613 and the output's 0.354),
# forward+backward 11.959 -> 11.940; but B2-T8192-H8-HV32 forward 1.448 -> 1.519 (0.563 against
# 0.306 + 0.184), where the scan's 128 programs (V block 64) are one an SM: the fused chunk
# step, longer, is then on the critical path with nothing beside it. Hence on where the
# programs outnumber FUSED_OUTPUT_MIN_PROGRAMS_PER_SM an SM (strictly; B8's 256 at V block 64,
# two CTAs an SM), as well as the V-block floor.
# On a GPU the V block is at least 64 whatever FUSED_OUTPUT_MIN_BV says
# (fwd._FUSED_OUTPUT_DEVICE_MIN_BV: at 32 its sm_90 build computes wrong rows).
FUSED_OUTPUT = 1
FUSED_OUTPUT_MIN_BV = 64
FUSED_OUTPUT_MIN_PROGRAMS_PER_SM = 1
# On bf16 operands with K <= 128 only (fwd._fused_output_launch). Its warps (None: the forward
# scan's) and pipeline stages. Compiled for sm_90a (Triton 3.6, bf16, K = V = 128, V block
# 64): four warps at one stage take 255 registers and 72 KB of shared memory, so two CTAs an
# SM (B8-T8192-H16's 256 programs in one wave); eight warps 251 registers (one CTA), two
# stages 144 KB (one CTA).
FUSED_OUTPUT_WARPS = 4
FUSED_OUTPUT_STAGES = 1
# Where the fused scan's programs are no more than FUSED_OUTPUT_MIN_PROGRAMS_PER_SM an SM
# (B2-T8192-H8-HV32: 128 programs of V block 64 on 132 SMs), 1 fuses there too, at warps and
# stages of its own. Each SM then holds one program whatever the configuration, so it may
# take eight warps and two pipeline stages (the next chunk's tiles in flight as async copies
# while this chunk's dots run), which the many-programs case cannot afford (two CTAs an SM
# need four warps and one stage). The thirtieth session's fused scan at B2 (four warps, one
# stage) lost to the scan then the output (0.563 against 0.306 + 0.184 ms, H200): its loop
# issues a chunk's five tile loads in three groups split by barriers and waits on them before
# the chunk's first dot (sm_90a SASS). Compiled here (Triton 3.6, bf16, K = V = 128, V block
# 64, the forward that keeps nothing): eight warps and two stages take 255 registers, no
# spills, 144 KB of shared memory; the loop 640 instructions a warp (816 at four warps, one
# stage), 12 global loads in it (50: the rest are async copies now). At B2 it would drop the
# chunk states' and U''s round trips through memory (roofline.kernel_costs: the fused scan
# 1.15 GB against the scan and output's 1.55, of the forward's ~3.4).
# Timed 2026-12-06 (thirty-ninth session, H100, ours alone, kernels by GPU time,
# benchmarks/NOTES.md): at B2-T8192-H8-HV32 the fused scan at four warps and two stages took
# 0.436 ms against the scan then the output's 0.331 + 0.244; the forward 1.420 -> 1.282 ms
# (eight warps and two stages: 0.471, forward 1.317; eight warps and one stage: 0.584, no
# gain), the step 6.617 -> 6.544 (its kept forward fused at 0.505). B8 and B1-T32768 do not
# take it (B8: 256 programs; B1: V blocks of 32) and did not change. Four warps and two
# stages at sm_90a (Triton 3.6, bf16, K = V = 128, V block 64): 254-255 registers, 0-8 B of
# spills, 144-152 KB of shared memory.
FUSED_OUTPUT_ONE_WAVE = 1
FUSED_OUTPUT_ONE_WAVE_WARPS = 4
FUSED_OUTPUT_ONE_WAVE_STAGES = 2
# The fused scan's chunk-ahead load of gam's last row (1; SCAN_GLAST_AHEAD's for this
# kernel). In its sm_90a SASS (Triton 3.6, bf16, K = V = 128, V block 64) that load, left
# where it is used, issues after the output's stores and its wait sits on each chunk's chain
# before the state update. Built 2026-12-05 without a device (the interpreter's tests: the
# same bits). H100 (2026-12-06, ours alone): kda_state_output_fwd 0.763 -> 0.730 ms at B8
# (forward 2.806 -> 2.773 with INTRA_A_MODE_LOOPS); B2 and B1 do not take this kernel. Off:
# on the H200 (2026-12-06) its test (test_triton_scan_writing_the_output_loads_gam_ahead_to_the_same_bits,
# K = 48, V = 40, V blocks of 32) found o's bits changed with it, and its process hit an illegal
# memory access in the case without h0 that keeps nothing (which of the two forms, not known).
# That was the V blocks of 32 (fwd._FUSED_OUTPUT_DEVICE_MIN_BV), wrong either way. On again
# (2026-12-06, H100): in V blocks of 64, profiling/fused_scan_diff.py's bv64 grid (K 32 to 128,
# V 40 to 256, partial last chunks, with and without h0) gave the bits of the load where it
# is used and of scan-then-output, the same from run to run; B8-T8192-H16 forward 2.783 ->
# 2.747 ms (the fused scan 0.760 -> 0.724), step 12.661 -> 12.634 (ours alone, two rounds).
FUSED_OUTPUT_GLAST_AHEAD = 1
# Where the scan that writes the output serves a forward that keeps no intermediates (no grad,
# recompute_in_backward=True: its chunk states then come from this form) and Kb is handed
# on in W's buffer (INTRA_A_GAM_ON_CHIP, INTRA_A_ROWS_KBG; bf16 inputs), that scan forms
# U' = U - W S as Tm (diag(beta) V - Kb S) itself (1): intra_wu_fwd then forms Tm alone and
# stores it in bf16 (8 KB a chunk and head) instead of reading Kb and V and writing W and U
# (64 KB at K = V = 128); the scan reads Kb, V and Tm instead of W and U, one more dot a
# chunk. The same sums in another order, Tm rounded to bf16 as fla keeps its inverse.
# On an H100 (2026-12-07, ours alone, two rounds, bench_chunk_kda.py --kernels): forward
# B8-T8192-H16 2.420 -> 2.219 ms (intra_wu_fwd 0.613 -> 0.298, the fused scan 0.732 ->
# 0.838), B2-T8192-H8-HV32 1.289 -> 1.179 (0.318 -> 0.155; 0.434 -> 0.491), B2 layer-style
# 1.585 -> 1.496; B1-T32768-H16 (no fused scan there) and the training step unchanged; o
# within 3.3e-3 of the W/U scan's at B2 and B8 (relative norm), the final state 2.9e-3.
FUSED_OUTPUT_SOLVE_U = 1
# The whole forward in one launch (one_pass_fwd.py; 1): one program per (V block, sequence *
# value head) walks its chunks and forms gam, the A's, Tm, U', the output and the state on
# chip, reading q, k, v, g, beta and writing o (and the chunk states where kept), instead of
# the six launches that pass gam, the A's, W, U, Qg, Kr and U' through memory (0). Used by
# a forward that keeps no intermediates (no grad, or recompute_in_backward) on fixed-length
# bf16 inputs with K <= 128 and g given (no in-kernel gate), where its programs fill the
# device: B * HV * (V / ONE_PASS_BV) >= ONE_PASS_MIN_PROGRAMS_PER_SM programs an SM (each
# walks a whole sequence, so fewer would leave SMs idle). Built 2026-12-05 without a
# device (interpreter tests; sm_90a compiles with Triton 3.6: 255 registers and 0.6-1.6 KB
# of spills). Timed on the H200 the same day (its first version, standard inputs, no grad):
# B8-T8192-H16 24.5 ms at V block 32 and eight warps against the six launches' 2.91 (8.4x
# slower; o within 3.3e-3 of theirs), and an illegal memory access at V block 32 with four
# warps (cause not established; the other configurations were not reached): off, a
# prototype to profile (benchmarks/ONE_PASS_STATUS.md). ONE_PASS_BV: its V block (each V block forms the chunk's A's
# and Tm again); ONE_PASS_BKA: the K slices of the A's; its warps and stages.
ONE_PASS_FWD = 0
ONE_PASS_BV = 32
ONE_PASS_BKA = 32
ONE_PASS_WARPS = 8
ONE_PASS_STAGES = 1
ONE_PASS_MIN_PROGRAMS_PER_SM = 1
# The forward's intra-chunk stage in one launch (intra_fused_fwd.py: gam, the A's, Tm, W,
# U, Qg and Kr of a chunk in one program; A_kk, gam and the diagonal inverses stay on
# chip) instead of four (gam_fwd, intra_a_fwd, diag_inv, intra_wu_fwd), where the forward
# keeps no intermediates (1), or also where it keeps them and in the backward's recompute
# (2: then also storing gam, A_kk and Tm), or not (0). Not on short packed sequences (their
# tiles); with fla's in-kernel gate only where INTRA_FUSED_WITH_GATE (timed slower there,
# below). Chunks too steep to split at the middle row take block references here (a second
# pass over K, with INTRA_A_BLOCK_REFS); steeper ones go to the steep launch and
# intra_wu_fwd's ONLY_STEEP launch (neither runs under fla's bounded gate). At
# B8-T8192-H16 (bf16, K = V = 128) the four launches took 1.92 of a 2.64 ms forward (H200,
# 2026-12-05) moving about 5.3 KB a token and head; this one moves 2.4.
# INTRA_FUSED_DIAG_INV: the diagonal blocks' inverses by forward substitution (0) or by
# the product (I - D)(I + D^2)(I + D^4)(I + D^8) in batched fp32 dots (1), for 16-bit
# inputs only: with nearly parallel keys its terms (up to C(15, 8) = 6435) cancel, and
# fp32 inputs' o then strays 2e-4 from the fp64 reference against 3e-6 by substitution
# (interpreter, 2026-12-05); bf16 inputs round far coarser.
# INTRA_FUSED_BKA / BK / BV: the K slices of the A's and of W, the V blocks of U.
# INTRA_FUSED_BLOCK_REFS: the kernel's own block references (flag 1 chunks) with fla's
# gate only (1: its chunks mostly need them), always (2) or never (0: such chunks to the
# steep launch). At sm_90a (bf16, K = V = 128, four warps) the branch takes the kernel from
# 252 registers and no spills to 255 and 20 B; at eight warps capped at 128, 0 -> 588 B.
# Timed on an H100 (2026-12-05, the only card lent that session; ours alone, two rounds,
# kernels by GPU time, benchmarks/NOTES.md): the first version (substitution, 252
# registers, one stage) was slower than the four launches (B8-T8192-H16 2.640 against
# 2.305 ms; B2-T8192-H8-HV32 1.300 against 1.10); the inverse product, a cap of 168
# registers (three CTAs an SM, 108 B spilled; bf16 and fp16 inputs only: fp32 ones spill
# 3.3 KB under it) and two stages, the values below, make it
# faster: the no-grad forward 3.095 -> 2.944 ms at B8 (-4.9%; the stage 2.305 -> 2.155) and
# 1.712 -> 1.678 at B2 (-2.0%). K slices of 64 with the cap: slower (3.51 ms at B8); eight
# warps capped at 128: 4.64 ms. With fla's gate (layer-style B2, the first version) the
# stage took 2.38 ms against the four launches' 1.11 (the block references' second pass),
# hence INTRA_FUSED_WITH_GATE = 0. INTRA_FUSED_FWD = 2 (the first version) made the
# training step slower (12.53 -> 13.15 ms at B8). Off until the H200 confirms the gain with
# the whole CUDA suite under it (the fused stage's own CUDA tests passed on the H100).
INTRA_FUSED_FWD = 0
INTRA_FUSED_WITH_GATE = 0
INTRA_FUSED_BLOCK_REFS = 1
INTRA_FUSED_DIAG_INV = 1
INTRA_FUSED_BKA = 32
INTRA_FUSED_BK = 32
INTRA_FUSED_BV = 32
INTRA_FUSED_WARPS = 4
INTRA_FUSED_STAGES = 2
INTRA_FUSED_MAXNREG = 168
# Where the scan forms U' from Tm (FUSED_OUTPUT_SOLVE_U serves: a forward that keeps nothing,
# bf16 inputs, not traced) and the intra-chunk stage would run as intra_a_fwd with gam on chip,
# diag_inv and intra_wu_fwd's Tm-only launch, the fused stage in its TM_ONLY form instead (1):
# one program a chunk and head forms gam, the A's and Tm on chip and writes Qg, Kr, Kb, A_qk and
# Tm (bf16), so neither A_kk (fp32, 16 KB a chunk and head at BT = 64) nor the diagonal inverses
# pass through memory and two launches go. Not with fla's in-kernel gate unless
# INTRA_FUSED_WITH_GATE, not on short packed sequences' tiles (intra_fused_fwd's own terms).
# Its launch takes INTRA_FUSED_TM_ONLY_WARPS / _STAGES / _MAXNREG (None: no cap). Compiled for
# sm_90a (Triton 3.6, bf16, K = V = 128): four warps capped at 168 registers spill 152 B (241
# registers uncapped, no spills; eight warps capped at 128, none). Timed on an H100 (2026-12-07,
# forty-second session, ours alone, two rounds, kernels by GPU time): slower than the three
# launches it replaces. B8-T8192-H16 forward 2.173 -> 2.332 ms (the fused launch 1.497 against
# intra_a_fwd 0.991 + Tm 0.300 + diag_inv 0.069), B2-T8192-H8-HV32 1.184 -> 1.252 (0.743
# against 0.479 + 0.157 + 0.040); eight warps capped at 128: 2.725 / 1.456. Without its stores of
# Qg, Kr and Kb (the scan forming them, since removed) the launch still took 1.185 ms at B8: its
# A's and Tm alone cost more than intra_a_fwd's tuned loop with every store. Off.
INTRA_FUSED_TM_ONLY = 0
INTRA_FUSED_TM_ONLY_WARPS = 4
INTRA_FUSED_TM_ONLY_STAGES = 2
INTRA_FUSED_TM_ONLY_MAXNREG = 168
# Rows (of K) per program of the GVA reduction of dq and dk (gva_reduce.py)
GVA_ROWS = 32
# Where each key head has one value head (G = 1: nothing to sum), the backward through the
# A's (intra_bwd_a.py, intra_bwd_a_rows.py: the last stage to touch dq and dk) writes the
# op's dq (scaled) and dk in the inputs' dtype itself, and gva_reduce does not run (1); 0:
# fp32 dq, dk per value head, then gva_reduce. gva_reduce at G = 1 only scales and casts, yet
# moves 3x the bytes of dq and dk: 0.369 ms of a 12.65 ms step at B8-T8192-H16 (H200,
# 2026-12-04, profiling/ROOFLINE.md), about 1.6 GB. On the H200 (2026-12-05, ours alone, with
# INTRA_BWD_A_MAXNREG = 168; without the cap the split launch falls to two CTAs an SM and
# the step is slower): step 12.696 -> 12.185 ms at B8-T8192-H16, 8.081 -> 7.821 at
# B1-T32768-H16, unchanged at B2-T8192-H8-HV32 (G = 4). With STEEP_WORK_LIST too: 12.001,
# 7.736 and 6.211 ms (forward 2.901, 1.939, 1.446).
DIRECT_DQ_DK = 1
# Sequences up to this length (decode steps and short prompts through chunk_kda)
# run token by token in one launch, the state on chip (recurrent_fwd.py), instead
# of the six launches of the chunked forward; their one chunk's boundaries are the
# initial and the final state.
RECURRENT_MAX_T = 16
# The recurrent kernel's V block (at most; at least 16) and warps per program:
# 90% of the copy ceiling at B = 256 and 83% at B = 64 (HV = 32, K = V = 128) on
# the H200 with these; benchmarks/bench_decode.py --settings times others. Timed
# and slower (graph replay at B = 64, 2026-11-30): BV 64 (80.9 us vs 75.7), BV 16
# (88.2 vs 75.8), eight warps (81.4), two warps (78.9), BV 16 with two (76.6).
# The pool step (POOL mode, bench_pool.py, 2026-12-01) is slower under every other
# value tried too: BV 16, BV 64 at 8 warps, a register cap of 128 or 96, the stream
# hints (benchmarks/RESULTS_pool.md); so were persistent programs prefetching the next
# tile's slot and state, and caps of 64 or 80 (2026-12-04, RESULTS_decode.md).
RECURRENT_BV = 32
RECURRENT_WARPS = 4
# A cap on its registers per thread (None: the compiler's 150, i.e. three CTAs of
# four warps per SM). 128 (28 B of spills) lets four share an SM; timed on the H200
# (2026-11-30): B = 64 graph replay 76.2 -> 81.2 us, slower.
RECURRENT_MAXNREG = None
# Cache hints on the recurrent kernel's state traffic (recurrent_fwd.py): timed
# slower (81.2 vs 75.7 us at B = 64, 2026-11-30).
RECURRENT_STREAM_HINTS = 0
# Cache hints on its inputs and output (recurrent_fwd.py): q, k, g evict-last (the
# other V blocks' programs read them again), v and o evict-first, as fla's decode
# kernel sets them (fla 0.6.0, fused_recurrent.py). On the H200 (bench_decode.py,
# CUDA graph replay, 2026-11-30, seventh session): B = 64 76.1 -> 72.7 us (fla
# 74.2-74.4), B = 256 278.4 -> 269.7 us; the same bits. With them, two warps
# (73.4), BV 64 (74.9) and BV 16 (82.7) were slower at B = 64.
RECURRENT_INPUT_HINTS = 1

# The steep-path kernels (kda_intra_a_fwd_steep_kernel, kda_intra_bwd_a_kernel with
# STEEP) on fp32 inputs use IEEE fp32 dots. Measured on the H200 (triton 3.6,
# strong-decay inputs of tests/test_cuda.py, every chunk forced steep): 3xTF32
# gave exactly the errors of plain TF32 there (o 3.8e-2 relative to the fp64
# reference, A_kk 1.3), IEEE 3.6e-7; the interpreter 3e-7. Steep chunks are rare,
# so the slower FMA dots cost little. bf16/fp16 inputs keep TF32 (errors 2e-3,
# the level of bf16 outputs).
STEEP_DOT_PREC_FP32 = "ieee"

# CUDA grids allow at most 65535 programs along their second and third axes, where
# the kernels put B * HV (and, in the backward's K-sliced kernels, the chunks).
MAX_GRID_YZ = 65535
# prep.py (fla's q/k l2 norm and beta sigmoid, one launch each way): rows of q
# and k per program and warps. Not timed yet.
PREP_ROWS = 16
PREP_WARPS = 4
