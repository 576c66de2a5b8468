"""The main job: train a small KDA language model through
``torch.compile(model, fullgraph=True)``, then export it and run the exported
program.

Data is generated: sequences from a fixed random Markov chain whose every token
has a few likely successors, so the loss falls from ln(vocab) towards the
chain's entropy. Runs on CUDA when present, else on the CPU.

    python -m kda_op.train_demo [--steps 300] [--device cpu]
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.nn.functional as F

from kda_op.nn import KDALanguageModel


class MarkovData:
    """Token sequences from a random first-order Markov chain (seeded)."""

    def __init__(self, vocab_size: int, seed: int = 0, sharpness: float = 4.0):
        gen = torch.Generator().manual_seed(seed)
        logits = sharpness * torch.randn(vocab_size, vocab_size, generator=gen)
        self.transition = torch.softmax(logits, dim=-1)
        self.gen = gen
        p = self.transition
        # entropy rate under the uniform start (a floor for the loss, roughly)
        self.entropy = float(-(p * p.clamp_min(1e-12).log()).sum(-1).mean())

    def batch(self, batch_size: int, seq_len: int) -> torch.Tensor:
        tokens = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.transition.shape[0], (batch_size,), generator=self.gen)
        for t in range(seq_len):
            tokens[:, t + 1] = torch.multinomial(self.transition[tokens[:, t]], 1, generator=self.gen).squeeze(1)
        return tokens


def progress(step: int, total: int, loss: float, start: float, width: int = 30) -> None:
    done = int(width * step / total)
    rate = step / max(time.perf_counter() - start, 1e-9)
    line = f"\r[{'#' * done}{'.' * (width - done)}] {step}/{total} loss {loss:.3f} ({rate:.1f} steps/s)"
    end = "\n" if step == total else ""
    if sys.stderr.isatty() or step == total or step % max(1, total // 10) == 0:
        print(line if sys.stderr.isatty() else line.lstrip("\r"), end=end if sys.stderr.isatty() else "\n",
              file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    data = MarkovData(args.vocab)
    model = KDALanguageModel(args.vocab, hidden_size=64, num_layers=2, num_heads=2, head_dim=16, num_v_heads=4)
    model = model.to(args.device)
    compiled = torch.compile(model, fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    print(f"training a {sum(p.numel() for p in model.parameters())}-parameter KDA LM on {args.device}, "
          f"torch.compile(fullgraph=True); loss starts near ln({args.vocab}) = {math.log(args.vocab):.2f}, "
          f"the chain's entropy is about {data.entropy:.2f}", flush=True)

    losses = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        tokens = data.batch(args.batch, args.seq_len).to(args.device)
        logits, _ = compiled(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        progress(step, args.steps, losses[-1], start)

    window = max(1, min(20, args.steps // 5))
    first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
    print(f"mean loss of the first {window} steps {first:.3f}, of the last {window} {last:.3f}")
    ok = last < first - 0.25

    model.eval()
    batch = torch.export.Dim("batch", min=1, max=1024)
    seq = torch.export.Dim("seq", min=1, max=8192)
    example = data.batch(2, args.seq_len)[:, :-1].contiguous().to(args.device)
    program = torch.export.export(model, (example,), dynamic_shapes=({0: batch, 1: seq},))
    tokens = data.batch(3, args.seq_len // 2 + 5)[:, :-1].contiguous().to(args.device)
    with torch.no_grad():
        exported_logits, _ = program.module()(tokens)
        eager_logits, _ = model(tokens)
    err = (exported_logits - eager_logits).abs().max().item()
    same = torch.allclose(exported_logits, eager_logits, rtol=1e-4, atol=1e-4)
    print(f"exported program (dynamic batch and length) on a {tuple(tokens.shape)} batch: "
          f"max |exported - eager| = {err:.1e} {'ok' if same else 'MISMATCH'}")
    print("done" if ok and same else "FAILED: " + ("loss did not fall" if not ok else "export mismatch"))
    return 0 if ok and same else 1


if __name__ == "__main__":
    sys.exit(main())
