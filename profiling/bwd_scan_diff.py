"""Where the fused backward scan's load of gam's row a chunk ahead (settings.SCAN_BWD_GLAST_AHEAD)
changes the grads, case by case.

On an H100 (2026-12-05, Triton 3.6) tests/test_cuda.py's T = 9 bf16 case gave dh0 with NaN down
one column with that load on; under the interpreter the bits are equal either way. The forward
scan that writes the output showed a like failure (wrong rows, from run to run) only in V
blocks of 32 (profiling/fused_scan_diff.py, 2026-12-06). This runs chunk_kda's forward and
backward (bf16, K = V = 128, an initial state and dht) over sequence lengths, the backward
scan's V block (32 or 64, through BV_SCAN_BWD_MIN) and the load ahead off and on, each case in
a process of its own, and prints for each the grads' error to the fp64 reference, whether any
is not finite, and the largest difference between two runs of the same case.

    [BWD_SCAN_T="9 40 172 300"] python profiling/bwd_scan_diff.py [--jobs 6] [--one I]
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "profiling"))

NAMES = ("q", "k", "v", "g", "beta", "initial_state")
# T, the backward scan's V block floor, the load ahead
LENGTHS = tuple(int(t) for t in os.environ.get("BWD_SCAN_T", "9 40 172 300").split())
CASES = list(itertools.product(LENGTHS, (32, 64), (0, 1)))
SHAPE = dict(B=3, H=2, G=2, K=128, V=128)  # test_cuda.py's short-sequence case


def run_one(i: int) -> str:
    import torch

    from inputs import make_inputs
    from kda_op import chunk_kda
    from kda_op.reference import kda_backward_reference, kda_forward_reference
    from kda_op.triton_kernels import settings

    T, bv, ahead = CASES[i]
    settings.BV_SCAN_BWD_MIN = bv
    settings.SCAN_BWD_GLAST_AHEAD = ahead
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = make_inputs(T=T, **SHAPE, dtype=torch.bfloat16, with_initial_state=True, seed=T + 1)
    gen = torch.Generator().manual_seed(T + 2)
    B, HV, K, V = SHAPE["B"], SHAPE["H"] * SHAPE["G"], SHAPE["K"], SHAPE["V"]
    do = torch.randn(B, T, HV, V, generator=gen).to(torch.bfloat16)
    dht = torch.randn(B, HV, K, V, generator=gen)

    def fwd_bwd():
        leaves = {n: x[n].to(dev).detach().clone().requires_grad_(True) for n in NAMES}
        o, ht = chunk_kda(*(leaves[n] for n in NAMES[:5]), initial_state=leaves["initial_state"],
                          output_final_state=True)
        torch.autograd.backward((o, ht), (do.to(dev), dht.to(dev)))
        return [leaves[n].grad.detach().cpu().double() for n in NAMES]

    runs = [fwd_bwd(), fwd_bwd()]
    args = [x[n].double() for n in NAMES[:5]]
    h0 = x["initial_state"].double()
    _, _, cs = kda_forward_reference(*args, None, h0)
    want = kda_backward_reference(*args, None, h0, cs, do.double(), dht.double())
    errs, bad = [], []
    for n, got, w in zip(NAMES, runs[0], want):
        errs.append(f"{n} {((got - w).norm() / w.norm()).item():.1e}")
        if not torch.isfinite(got).all():
            cols = (~torch.isfinite(got)).flatten(0, -2).any(0).nonzero().flatten().tolist()
            bad.append(f"{n} not finite in {len(cols)} columns")
    rep = max((a - b).abs().max().item() for a, b in zip(*runs))
    return (f"case {i:2d} T={T:3d} BV>={bv} ahead={ahead}: " + ", ".join(errs)
            + f"; run-to-run {rep:.1e}" + ("; " + "; ".join(bad) if bad else ""))


if __name__ == "__main__":
    from _per_process import main

    sys.exit(main(__doc__, CASES, run_one, __file__, jobs=6))
