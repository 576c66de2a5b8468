"""A context-parallel training step of the small KDA language model.

    torchrun --nproc-per-node 2 -m kda_op.cp_demo [--seq-len 4096] [--documents 1] [--device cuda] [--check]

Every rank builds the same model and the same token sequence (seeded), runs the
forward and backward of its contiguous slice of the sequence with the KDA layers
in context-parallel mode (``KDALanguageModel.set_context_parallel``: the
attention through ``kda_op.distributed.chunk_kda_cp``, the short convolutions
reading the previous rank's last inputs), sums the parameters' gradients over the
ranks (all_reduce, as data parallelism does) and takes an SGD step. Prints the
loss; with ``--check`` rank 0 also runs the whole sequence alone and compares the
loss and every gradient. gloo on CPU, NCCL on CUDA (one GPU per rank).
``--documents N``: the sequence is N documents of random lengths packed together
(``cu_seqlens``, the ranks' slices cutting them anywhere), each its own sequence
for the attention and the short convolutions.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .distributed import init_from_torchrun
from .nn import KDALanguageModel


def build(vocab: int, seed: int, device, dtype=torch.float32) -> KDALanguageModel:
    torch.manual_seed(seed)
    return KDALanguageModel(vocab_size=vocab, hidden_size=64, num_layers=2, num_heads=2, head_dim=16,
                            num_v_heads=4).to(device=device, dtype=dtype)


def slice_bounds(T: int, world: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s slice of T next-token positions (the first ranks take one more
    where T does not divide)."""
    base, extra = divmod(T, world)
    a = rank * base + min(rank, extra)
    return a, a + base + (rank < extra)


def _fp32_at_least(logits: torch.Tensor) -> torch.Tensor:
    """The loss in fp32 for half logits, in fp64 for fp64 ones (the tests' oracle)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def step(model: KDALanguageModel, tokens: torch.Tensor, group=None,
         cu_seqlens: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict]:
    """One context-parallel forward and backward of ``tokens`` [B, T + 1] (the same on
    every rank): returns the mean next-token loss over the whole sequence (summed over
    the ranks) and the gradients summed over the ranks. ``cu_seqlens``: the offsets
    of documents packed in the T input positions (B = 1)."""
    group = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    T = tokens.shape[1] - 1
    a, b = slice_bounds(T, world, rank)
    model.set_context_parallel(group)
    logits, _ = model(tokens[:, a:b], cu_seqlens=cu_seqlens)
    loss = F.cross_entropy(_fp32_at_least(logits.flatten(0, 1)), tokens[:, a + 1:b + 1].flatten(), reduction="sum")
    loss = loss / (tokens.shape[0] * T)  # this rank's share of the mean
    model.zero_grad(set_to_none=True)
    loss.backward()
    model.set_context_parallel(None)
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g, group=group)
        grads[name] = g
    return total, grads


def single_step(model: KDALanguageModel, tokens: torch.Tensor,
                cu_seqlens: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict]:
    """The same step on one process: the whole sequence at once."""
    logits, _ = model(tokens[:, :-1], cu_seqlens=cu_seqlens)
    loss = F.cross_entropy(_fp32_at_least(logits.flatten(0, 1)), tokens[:, 1:].flatten())
    model.zero_grad(set_to_none=True)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--documents", type=int, default=1,
                        help="pack this many documents of random lengths (cu_seqlens; needs --batch 1)")
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--check", action="store_true", help="rank 0 compares with the whole sequence alone")
    args = parser.parse_args(argv)
    device = init_from_torchrun(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(args.vocab, seed=0, device=device)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(args.vocab, (args.batch, args.seq_len + 1), generator=gen).to(device)
    cu_seqlens = None
    if args.documents > 1:
        if args.batch != 1:
            parser.error("--documents needs --batch 1 (the documents are packed along the sequence)")
        cuts = torch.randperm(args.seq_len - 1, generator=gen)[:args.documents - 1].sort().values + 1
        cu_seqlens = torch.cat([torch.tensor([0]), cuts, torch.tensor([args.seq_len])]).to(device)
    loss, grads = step(model, tokens, cu_seqlens=cu_seqlens)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p -= 0.1 * grads[name]
    rc = 0
    if rank == 0:
        docs = f", {args.documents} documents" if cu_seqlens is not None else ""
        print(f"{world} ranks, {args.seq_len} tokens ({args.seq_len // world} a rank{docs}), loss {loss.item():.4f}")
        if args.check:
            ref = build(args.vocab, seed=0, device=device)
            ref_loss, ref_grads = single_step(ref, tokens, cu_seqlens)
            worst = max(((grads[n] - g).norm() / g.norm().clamp_min(1e-30)).item() for n, g in ref_grads.items())
            print(f"one process: loss {ref_loss.item():.4f}; worst relative gradient difference {worst:.1e}")
            rc = int(abs(loss.item() - ref_loss.item()) > 1e-4 * abs(ref_loss.item()) or worst > 1e-3)
    dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    sys.exit(main())
