"""The main job, for now: KDA forward and backward through
``torch.compile(fullgraph=True)`` on the default device, checked against eager.

Run with ``python -m kda_op.demo [--device DEVICE]``; exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from kda_op import chunk_kda


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def make_inputs(B: int, T: int, H: int, G: int, K: int, V: int, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    HV = H * G
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, HV, K, generator=gen)).clamp_min(-5.0)
    beta = torch.sigmoid(torch.randn(B, T, HV, generator=gen))
    h0 = torch.randn(B, HV, K, V, generator=gen)
    return [x.to(device).requires_grad_(True) for x in (q, k, v, g, beta, h0)]


def kda(q, k, v, g, beta, h0):
    return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)


def forward_backward(fn, inputs):
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    o, ht = fn(*leaves)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(o.shape, generator=gen).to(o)
    dht = torch.randn(ht.shape, generator=gen).to(ht)
    torch.autograd.backward((o, ht), (do, dht))
    return [o.detach(), ht.detach()] + [x.grad for x in leaves]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=default_device(), help="default: cuda if present, else cpu")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=200)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    inputs = make_inputs(args.batch, args.seq_len, H=2, G=2, K=32, V=32, device=args.device)
    print(f"kda-op demo on {args.device}: B={args.batch} T={args.seq_len} H=2 HV=4 K=V=32, fp32")

    start = time.perf_counter()
    eager = forward_backward(kda, inputs)
    print(f"eager forward+backward: {time.perf_counter() - start:.2f} s")

    compiled_kda = torch.compile(kda, fullgraph=True)
    start = time.perf_counter()
    compiled = forward_backward(compiled_kda, inputs)
    print(f"compiled (fullgraph=True) forward+backward, compile included: {time.perf_counter() - start:.2f} s")

    names = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
    ok = True
    for name, a, b in zip(names, compiled, eager):
        err = (a - b).abs().max().item()
        # Same kernels on both paths; only fusions around them may reorder fp32 math.
        good = torch.allclose(a, b, rtol=1e-5, atol=1e-5)
        ok &= good
        print(f"  {name:12s} max |compiled - eager| = {err:.2e}  {'ok' if good else 'MISMATCH'}")
    print("compiled equals eager" if ok else "compiled differs from eager")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
