"""A minimal kernel of the fused forward scan's failing pattern, to tell a Triton fault from ours.

In state_output_fwd.py, U' = U - W S is formed by a wgmma (its accumulator in registers),
rounded to bf16, and fed as the B operand of the next two dots (A_qk U', Kr^T U'). In V
blocks of 32 (N = 32: a 64-byte swizzled tile) on sm_90 (Triton 3.6) the rows of U' from
the second warp on came out wrong, from run to run (profiling/fused_scan_diff.py,
2026-12-06); in V blocks of 64 (128-byte swizzle) right. This kernel does only that:
X = A B (M x N, fp32 in registers), then Y = tril(C) X (X in bf16 as the B operand), over
``LOOPS`` chunks that carry nothing between them but reuse the shared memory, and prints
for each N, warp count and loop count the largest error of Y to torch's product of the same
bf16 operands, of which rows, and whether two runs agree.

    python profiling/mma_chain_repro.py          # on a GPU; the interpreter for the harness
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# the kernels' bf16 dot: tl.dot on bf16 operands on the GPU; the same rounding in fp32 under
# the interpreter, which multiplies bf16 bit patterns (triton-lang/triton#11584)
from kda_op.triton_kernels._dot import dot_bf16  # noqa: E402


@triton.jit
def mma_chain_kernel(a, b, c, out, LOOPS, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
                     INTERPRET: tl.constexpr):
    # chunk i: X_i = A_i B_i (M x K by K x N), Y_i = tril(C_i) bf16(X_i) (M x M by M x N)
    o_m = tl.arange(0, M)
    o_k = tl.arange(0, K)
    o_n = tl.arange(0, N)
    causal = o_m[:, None] >= o_m[None, :]
    for i in range(LOOPS):
        b_a = tl.load(a + i * M * K + o_m[:, None] * K + o_k[None, :])
        b_b = tl.load(b + i * K * N + o_k[:, None] * N + o_n[None, :])
        b_x = dot_bf16(b_a, b_b, INTERPRET)
        b_c = tl.where(causal, tl.load(c + i * M * M + o_m[:, None] * M + o_m[None, :]), 0.0)
        b_y = dot_bf16(b_c, b_x, INTERPRET)
        tl.store(out + i * M * N + o_m[:, None] * N + o_n[None, :], b_y)


def check(N: int, warps: int, loops: int, M: int = 64, K: int = 128, seed: int = 0) -> str:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(loops, M, K, generator=gen).to(dev, torch.bfloat16)
    b = (torch.randn(loops, K, N, generator=gen) / K**0.5).to(dev, torch.bfloat16)
    c = torch.randn(loops, M, M, generator=gen).to(dev, torch.bfloat16)
    want = torch.tril(c.float()) @ (a.float() @ b.float()).to(torch.bfloat16).float()
    runs = []
    for _ in range(2):
        out = torch.empty(loops, M, N, device=dev, dtype=torch.float32)
        mma_chain_kernel[(1,)](a, b, c, out, loops, M=M, K=K, N=N, INTERPRET=dev == "cpu", num_warps=warps)
        runs.append(out.cpu())
    err = (runs[0] - want.cpu()).abs()
    bad_rows = (err.amax(dim=(0, 2)) > 1e-2 * want.abs().max().item()).nonzero().flatten().tolist()
    rows = f"{bad_rows[0]}..{bad_rows[-1]} ({len(bad_rows)})" if bad_rows else "-"
    return (f"N={N:3d} warps={warps} loops={loops}: max err {err.max().item():.2e} "
            f"(of {want.abs().max().item():.1e}), wrong rows {rows}, runs agree {torch.equal(*runs)}")


def main() -> int:
    for N, warps, loops in itertools.product((16, 32, 64), (4, 8), (1, 3)):
        try:
            print(check(N, warps, loops), flush=True)
        except Exception as e:  # a fault ends the CUDA context: report it and stop
            print(f"N={N:3d} warps={warps} loops={loops}: FAILED {type(e).__name__}: {e}"[:300], flush=True)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
