"""Where a training step's memory goes, without a GPU: every buffer the Triton host
code allocates (forward that keeps its intermediates, then the backward from them),
with its lifetime, so the peak and what is live at it can be read per stage.

    python profiling/memory_budget.py [--T 256] [--heads 1] [--head-dim 128] [--scale-to B8-T8192-H16] [--recompute]
    python profiling/memory_budget.py --scale-to B2-T8192-H8-HV32   # GVA

Runs kda_fwd_triton / kda_bwd_triton under Triton's interpreter on CPU tensors at a
small shape (the host code allocates the same buffers as on CUDA; the sizes are
exact), records each allocation through torch.empty / empty_like / zeros /
zeros_like with the line of kda_op that made it, and frees through weak
references. The inputs, dO and the op outputs are held as autograd holds them
(inputs and the saved chunk states and intermediates until the backward ends).
Every buffer here scales with B * T * HV (chunk states with B * T / 64 * HV), so
``--scale-to`` multiplies the figures by the token-heads of a target shape (bf16,
K = V as given). Not the CUDA caching allocator's view: fragmentation and its
rounding come on top (torch.cuda.memory_stats on the GPU).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import traceback
import weakref

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402


class Tracker:
    def __init__(self):
        self.live = {}  # id -> (bytes, site, stage)
        self.now = 0
        self.peak = 0
        self.peak_set = []
        self.stage = "setup"
        self.by_stage_peak = collections.OrderedDict()

    def site(self) -> str:
        for frame in reversed(traceback.extract_stack()[:-3]):
            if "kda_op" in frame.filename:
                return f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.line.strip()[:70]}"
        return "outside kda_op"

    def add(self, t: torch.Tensor, site: str = None) -> torch.Tensor:
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            return t
        key = id(t)
        nbytes = t.numel() * t.element_size()
        self.live[key] = (nbytes, site or self.site(), self.stage)
        self.now += nbytes
        if self.now > self.peak:
            self.peak = self.now
            self.peak_set = sorted(self.live.values(), key=lambda x: -x[0])
        self.by_stage_peak[self.stage] = max(self.by_stage_peak.get(self.stage, 0), self.now)
        weakref.finalize(t, self._free, key)
        return t

    def _free(self, key):
        nbytes = self.live.pop(key)[0]
        self.now -= nbytes


def _run(T: int, H: int, K: int, recompute: bool = False, G: int = 1) -> Tracker:
    """One forward (keeping its intermediates unless ``recompute``) and backward at
    B1-T-H with G value heads per key head (HV = G * H), tracked."""
    from kda_op.triton_kernels import kda_bwd_triton, kda_fwd_triton

    tr = Tracker()
    real = {name: getattr(torch, name) for name in ("empty", "empty_like", "zeros", "zeros_like")}
    for name, fn in real.items():
        setattr(torch, name, (lambda fn: lambda *a, **kw: tr.add(fn(*a, **kw)))(fn))
    try:
        gen = torch.Generator().manual_seed(0)
        dt = torch.bfloat16
        q = torch.randn(1, T, H, K, generator=gen).to(dt)
        k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1).to(dt)
        v = torch.randn(1, T, G * H, K, generator=gen).to(dt)
        g = torch.nn.functional.logsigmoid(torch.randn(1, T, G * H, K, generator=gen)).clamp_min(-5.0)
        beta = torch.sigmoid(torch.randn(1, T, G * H, generator=gen)).to(dt)
        do = torch.randn(1, T, G * H, K, generator=gen).to(dt)
        for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("do", do)):
            tr.add(x, f"input {name}")
        tr.stage = "forward"
        o, ht, chunk_states, kept = kda_fwd_triton(q, k, v, g, beta, None, None, keep_intermediates=not recompute)
        tr.stage = "backward"
        grads = kda_bwd_triton(q, k, v, g, beta, None, None, chunk_states, do, None, kept)
        tr.stage = "after"
        del grads, o, ht
    finally:
        for name, fn in real.items():
            setattr(torch, name, fn)
    return tr


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--T", type=int, default=256, help="the smaller of the two lengths run (then 2 T)")
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--scale-to", default="B8-T8192-H16",
                        help="a shape Bb-Tt-Hh or Bb-Tt-Hh-HVv (GVA: the runs then take HV / H value heads per "
                             "key head) to scale the buffers to")
    parser.add_argument("--recompute", action="store_true",
                        help="the forward keeps nothing and the backward recomputes (recompute_in_backward=True)")
    args = parser.parse_args(argv)
    H, K, T1 = args.heads, args.head_dim, args.T
    parts = args.scale_to.split("-")
    b, t, h = (int(x[1:]) for x in parts[:3])
    G = int(parts[3][2:]) // h if len(parts) > 3 else 1
    runs = [_run(T1, H, K, args.recompute, G), _run(2 * T1, H, K, args.recompute, G)]
    # Each buffer at the peak is a * T + c bytes per head (c: per sequence, as the
    # final state; chunk states grow by T / 64): fitted from the two runs.
    def by_site(tr):  # site (with an occurrence number where a line allocates twice) -> (bytes, stage)
        seen, out = collections.Counter(), {}
        for nbytes, site, stage in tr.peak_set:
            seen[site] += 1
            out[(site, seen[site])] = (nbytes, stage)
        return out

    small, large = by_site(runs[0]), by_site(runs[1])
    if small.keys() != large.keys():
        raise SystemExit("the two runs' peaks hold different buffers: try another --T")
    fitted = []
    for key, (n1, stage) in small.items():
        site, n2 = key[0], large[key][0]
        a = (n2 - n1) / T1
        c = n1 - a * T1
        fitted.append(((a * t + c) * b * h / H, a / (H * G), site, stage))
    fitted.sort(key=lambda x: -x[0])
    total = sum(x[0] for x in fitted)
    print(f"B1-T{T1}/T{2 * T1}-H{H}" + (f"-HV{G * H}" if G > 1 else "") + f", K = V = {K}, bf16 inputs (g fp32): peak "
          f"{runs[0].peak / 2**20:.2f} / {runs[1].peak / 2**20:.2f} MiB; at {args.scale_to}: {total / 2**30:.2f} GiB "
          f"({total / (b * t * h * G):.0f} bytes per token and value head)")
    print("peak per stage at T =", T1, "(MiB):", ", ".join(f"{s} {v / 2**20:.2f}"
                                                       for s, v in runs[0].by_stage_peak.items()))
    print(f"live at the peak ({len(fitted)} buffers) at {args.scale_to}: GiB | bytes per token and value head | "
          "stage | where")
    for nbytes, per_token, site, stage in fitted:
        print(f"  {nbytes / 2**30:6.2f} | {per_token:7.0f} | {stage:8s} | {site}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
