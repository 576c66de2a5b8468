"""A serving loop on a state pool: continuous batching of a small KDA language model.

    python -m kda_op.serve_demo [--requests 24] [--slots 8] [--device cuda] [--seed 0]

Requests arrive at random steps with prompts of different lengths and ask for
different numbers of new tokens (greedy). Each step packs the prompts of newly
admitted requests (prefill) beside the last token of every running one (decode)
into one sequence batch (``cu_seqlens``) and runs the model once on it; every
request keeps its states in its own slot of the layers' pools
(``KDALanguageModel.new_pools``), read and written in place by the kernels
(``chunk_kda`` / ``fused_recurrent_kda`` with ``ssm_state_indices``). A request
that finishes frees its slot for the next one. Steps of decode tokens only run
through the recurrent kernel; on CUDA they are captured once in a CUDA graph of
the largest batch (rows past the running requests point at a scratch slot) and
replayed. The same requests are then served one at a time (prefill, then one
token per step, with plain states), and the tokens of every request must agree.
Prints tokens/s of both.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time
from typing import Optional

import torch

from .nn import KDALanguageModel


@dataclasses.dataclass
class Request:
    rid: int
    arrival: int  # the step at which it may be admitted
    prompt: list[int]
    max_new_tokens: int
    generated: list[int] = dataclasses.field(default_factory=list)
    slot: Optional[int] = None


def make_requests(n: int, vocab: int, seed: int, max_prompt: int = 24, max_new: int = 10) -> list[Request]:
    rng = random.Random(seed)
    reqs, t = [], 0
    for rid in range(n):
        t += rng.choice([0, 0, 1, 2])  # bursts and gaps
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, max_prompt))]
        reqs.append(Request(rid, t, prompt, rng.randint(1, max_new)))
    return reqs


class _DecodeGraph:
    """A CUDA graph of one decode step of ``batch`` rows (CUDA only): replayed with
    the running requests' tokens and slots copied into its static inputs, the rest
    of the rows on the scratch slot."""

    def __init__(self, model: KDALanguageModel, pools, batch: int, scratch: int, device):
        self.ids = torch.zeros(1, batch, dtype=torch.long, device=device)
        self.slots = torch.full((batch,), scratch, dtype=torch.int64, device=device)
        self.cu = torch.arange(batch + 1, device=device)
        self.scratch = scratch
        step = lambda: model.forward_pooled(self.ids, pools, self.slots, self.cu, decode=True)  # noqa: E731
        step()  # compile the kernels before capture
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = step()

    def __call__(self, ids: list[int], slots: list[int]) -> torch.Tensor:
        n = len(ids)
        pad = len(self.slots) - n
        self.ids.copy_(torch.tensor([ids + [0] * pad]))
        self.slots.copy_(torch.tensor(slots + [self.scratch] * pad))
        self.graph.replay()
        return self.logits[0, :n]


def serve(model: KDALanguageModel, requests: list[Request], num_slots: int, device,
          use_graph: Optional[bool] = None) -> dict:
    """Continuous batching over ``num_slots`` slots (one more, the scratch slot of
    the decode graph, is allocated). Fills every request's ``generated``; returns
    counts of steps by kind and the tokens generated."""
    use_graph = (torch.device(device).type == "cuda") if use_graph is None else use_graph
    pools = model.new_pools(num_slots + 1, device)
    scratch = num_slots
    free = list(range(num_slots))
    waiting = sorted(requests, key=lambda r: (r.arrival, r.rid))
    running: list[Request] = []
    graph = None
    stats = dict(steps=0, mixed_steps=0, decode_steps=0, tokens=0)
    step_no = 0
    with torch.no_grad():
        while waiting or running:
            admitted = []
            while waiting and free and waiting[0].arrival <= step_no:
                r = waiting.pop(0)
                r.slot = free.pop(0)
                for pool in pools:  # a new request starts from zero states
                    for part in pool:
                        if part is not None:
                            part[r.slot].zero_()
                admitted.append(r)
            batch = running + admitted
            step_no += 1
            if not batch:
                continue
            seqs = [[r.generated[-1]] for r in running] + [r.prompt for r in admitted]
            slots = [r.slot for r in batch]
            if not admitted:  # decode tokens only
                if use_graph:
                    graph = graph or _DecodeGraph(model, pools, num_slots, scratch, device)
                    last = graph([s[0] for s in seqs], slots)
                else:
                    ids = torch.tensor([[s[0] for s in seqs]], device=device)
                    cu = torch.arange(len(seqs) + 1, device=device)
                    last = model.forward_pooled(ids, pools, torch.tensor(slots, device=device), cu, decode=True)[0]
                stats["decode_steps"] += 1
            else:
                lengths = [len(s) for s in seqs]
                ids = torch.tensor([[t for s in seqs for t in s]], device=device)
                cu = torch.tensor([0] + lengths, device=device).cumsum(0)
                logits = model.forward_pooled(ids, pools, torch.tensor(slots, device=device), cu)
                last = logits[0, cu[1:] - 1]  # each sequence's last token
                stats["mixed_steps"] += int(bool(running))
            stats["steps"] += 1
            next_tokens = last.argmax(-1).tolist()
            running = []
            for r, tok in zip(batch, next_tokens):
                r.generated.append(tok)
                stats["tokens"] += 1
                if len(r.generated) == r.max_new_tokens:
                    free.append(r.slot)
                else:
                    running.append(r)
    return stats


def serve_alone(model: KDALanguageModel, request: Request, device) -> list[int]:
    """The request by itself: prefill its prompt, then one token per step, with the
    model's plain states (no pool)."""
    out = []
    with torch.no_grad():
        logits, states = model(torch.tensor([request.prompt], device=device))
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        while len(out) < request.max_new_tokens:
            logits, states = model(torch.tensor([[tok]], device=device), states, decode=True)
            tok = int(logits[0, -1].argmax())
            out.append(tok)
    return out


def build_model(vocab: int, seed: int, device) -> KDALanguageModel:
    torch.manual_seed(seed)
    model = KDALanguageModel(vocab_size=vocab, hidden_size=64, num_layers=2, num_heads=2, head_dim=16,
                             num_v_heads=4).to(device)
    with torch.no_grad():  # a livelier next-token distribution than the small init gives
        model.embed.weight.mul_(25.0)
    return model.eval()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    model = build_model(args.vocab, args.seed, args.device)
    reqs = make_requests(args.requests, args.vocab, args.seed)
    print(f"{len(reqs)} requests (prompts of {min(len(r.prompt) for r in reqs)}-{max(len(r.prompt) for r in reqs)} "
          f"tokens, {sum(r.max_new_tokens for r in reqs)} tokens to generate), {args.slots} slots, "
          f"on {args.device}", flush=True)
    serve(model, make_requests(2, args.vocab, args.seed + 1), args.slots, args.device)  # warm-up: compiles
    start = time.perf_counter()
    stats = serve(model, reqs, args.slots, args.device)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    batched = time.perf_counter() - start
    start = time.perf_counter()
    alone = {r.rid: serve_alone(model, r, args.device) for r in reqs}
    single = time.perf_counter() - start
    mismatched = [r.rid for r in reqs if r.generated != alone[r.rid]]
    print(f"continuous batching: {stats['tokens']} tokens in {stats['steps']} steps ({stats['mixed_steps']} mixing "
          f"prefill and decode, {stats['decode_steps']} decode only), {stats['tokens'] / batched:.0f} tokens/s")
    print(f"one request at a time: {stats['tokens'] / single:.0f} tokens/s")
    if mismatched:
        print(f"MISMATCH: requests {mismatched} generated other tokens than served alone")
        return 1
    print("every request generated the same tokens as served alone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
