"""The serving loop (``python -m kda_op.serve_demo``): continuous batching on the
state pools gives every request the tokens it gets served alone (greedy)."""

from __future__ import annotations

import pytest
import torch

from kda_op import serve_demo


def _check_serving(device, use_graph):
    vocab = 48
    model = serve_demo.build_model(vocab, seed=3, device=device)
    reqs = serve_demo.make_requests(14, vocab, seed=5)
    stats = serve_demo.serve(model, reqs, num_slots=4, device=device, use_graph=use_graph)
    # more requests than slots: slots were freed and reused; steps mixed prefill
    # (new requests) with decode (running ones), and some decoded only
    assert len(reqs) > 4 and stats["mixed_steps"] > 0 and stats["decode_steps"] > 0, stats
    tokens = [t for r in reqs for t in r.generated]
    assert stats["tokens"] == len(tokens) == sum(r.max_new_tokens for r in reqs)
    assert len(set(tokens)) > 5  # not a degenerate model: the comparison below means something
    for r in reqs:
        assert r.generated == serve_demo.serve_alone(model, r, device), r.rid


def test_continuous_batching_equals_serving_each_request_alone():
    _check_serving("cpu", use_graph=False)


def test_demo_main_runs_and_agrees(capsys):
    assert serve_demo.main(["--device", "cpu", "--requests", "10", "--slots", "3"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "the same tokens as served alone" in out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_continuous_batching_with_the_decode_graph_equals_serving_alone():
    _check_serving("cuda", use_graph=True)
