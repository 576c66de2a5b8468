"""fused_recurrent_kda: the decoding path (issue: decode kernel).

CPU: the op against the naive oracle (values and grads), opcheck, compile of a
decode loop. The Triton kernel against the reference on DEVICE (Triton's
interpreter on CPU tensors when there is no GPU). GPU-only: CUDA graph capture
and replay of a decode loop with static buffers."""

from __future__ import annotations

import os

import pytest
import torch

from inputs import make_inputs
from naive import naive_kda
from kda_op import chunk_kda, fused_recurrent_kda
from kda_op.reference import kda_forward_reference

NAMES = ("q", "k", "v", "g", "beta")
FP64_TOL = dict(rtol=1e-9, atol=1e-10)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [(T, G, h0) for T in (1, 2, 7, 64) for G in (1, 2, 4) for h0 in (True, False)]


def _leaves(inputs):
    return {n: x.detach().clone().requires_grad_(True) for n, x in inputs.items() if x is not None}


@pytest.mark.parametrize("T,G,with_h0", CASES)
def test_matches_naive_values_and_grads(T, G, with_h0):
    inputs = make_inputs(B=2, T=T, H=2, G=G, K=8, V=6, with_initial_state=with_h0, seed=T * 10 + G)
    do = torch.randn(2, T, 2 * G, 6, dtype=torch.float64)
    dht = torch.randn(2, 2 * G, 8, 6, dtype=torch.float64)
    results = []
    for fn in (fused_recurrent_kda, None):
        leaves = _leaves(inputs)
        args = [leaves[n] for n in NAMES]
        if fn is None:
            o, ht = naive_kda(*args, initial_state=leaves.get("initial_state"))
        else:
            o, ht = fn(*args, initial_state=leaves.get("initial_state"), output_final_state=True)
        torch.autograd.backward((o, ht), (do, dht))
        results.append((o, ht, {n: x.grad for n, x in leaves.items()}))
    (o, ht, grads), (o_ref, ht_ref, grads_ref) = results
    torch.testing.assert_close(o, o_ref, **FP64_TOL)
    torch.testing.assert_close(ht, ht_ref, **FP64_TOL)
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], **FP64_TOL, msg=lambda m: f"d{name}: {m}")


def test_same_checks_as_chunk_kda():
    inputs = make_inputs(B=2, T=3, H=2, G=2, K=8, V=6)
    args = [inputs[n] for n in NAMES]
    with pytest.raises(ValueError, match="beta"):
        fused_recurrent_kda(*args[:4], torch.rand(2, 3, 2, dtype=torch.float64))
    o, ht = fused_recurrent_kda(*args, initial_state=inputs["initial_state"])
    assert ht is None and o.shape == (2, 3, 4, 6)


@pytest.mark.parametrize("with_h0", [True, False])
def test_opcheck(with_h0):
    inputs = make_inputs(B=2, T=5, H=2, G=2, K=8, V=6, dtype=torch.float32,
                         with_initial_state=with_h0, requires_grad=True)
    args = tuple(inputs[n] for n in NAMES) + (None, inputs["initial_state"])
    torch.library.opcheck(
        torch.ops.kda_op.fused_recurrent_kda_fwd.default, args,
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


def _decode_step(q, k, v, g, beta, state):
    o, new_state = fused_recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
    return o, new_state


def _decode(step, tokens, state):
    outs = []
    for t in range(tokens["q"].shape[1]):
        o, state = step(*(tokens[n][:, t : t + 1] for n in NAMES), state)
        outs.append(o)
    return torch.cat(outs, dim=1), state


def test_compiled_decode_loop_matches_prefill():
    """Token-by-token decoding, compiled with fullgraph=True, carries the state
    exactly as one chunked call over the whole sequence."""
    torch._dynamo.reset()
    inputs = make_inputs(B=3, T=9, H=2, G=2, K=8, V=6, dtype=torch.float32, seed=1)
    step = torch.compile(_decode_step, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        o, state = _decode(step, inputs, inputs["initial_state"])
    o_ref, state_ref = chunk_kda(*(inputs[n] for n in NAMES), initial_state=inputs["initial_state"],
                                 output_final_state=True)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, state_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="no GPU and TRITON_INTERPRET is not set")
@pytest.mark.parametrize("T,G,with_h0", CASES)
def test_triton_recurrent_kernel_matches_reference(T, G, with_h0):
    pytest.importorskip("triton")
    from kda_op.triton_kernels import kda_recurrent_fwd_triton

    inputs = make_inputs(B=2, T=T, H=2, G=G, K=24, V=40, dtype=torch.float32, with_initial_state=with_h0, seed=T + G)
    args = [inputs[n].to(DEVICE) for n in NAMES]
    h0 = inputs["initial_state"].to(DEVICE) if with_h0 else None
    o, ht = kda_recurrent_fwd_triton(*args, None, h0)
    o_ref, ht_ref, _ = kda_forward_reference(*(x.cpu() for x in args), None, None if h0 is None else h0.cpu())
    # fp32 on both sides, the same order of operations per token.
    torch.testing.assert_close(o.cpu(), o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ht.cpu(), ht_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="no GPU and TRITON_INTERPRET is not set")
@pytest.mark.parametrize("setting", ["RECURRENT_INPUT_HINTS", "RECURRENT_STREAM_HINTS"])
def test_triton_recurrent_cache_hints_change_no_result(setting, monkeypatch):
    """The recurrent kernel's cache-hint options (settings.py) give bitwise the
    results of the defaults, with an initial state and a ragged V block."""
    pytest.importorskip("triton")
    from kda_op.triton_kernels import kda_recurrent_fwd_triton, settings

    inputs = make_inputs(B=2, T=3, H=2, G=2, K=24, V=40, dtype=torch.float32, seed=17)
    args = [inputs[n].to(DEVICE) for n in NAMES]
    h0 = inputs["initial_state"].to(DEVICE)
    monkeypatch.setattr(settings, setting, 0)
    want = kda_recurrent_fwd_triton(*args, None, h0)
    monkeypatch.setattr(settings, setting, 1)
    got = kda_recurrent_fwd_triton(*args, None, h0)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="no GPU and TRITON_INTERPRET is not set")
def test_triton_recurrent_final_state_over_the_initial_one():
    """The recurrent kernel's host function writing the final state into the
    initial state's own buffer (final_state_out, what the decode benchmark's
    in-place probe times) gives the o and final state of a fresh buffer, and
    refuses a buffer of the wrong shape."""
    pytest.importorskip("triton")
    from kda_op.triton_kernels import kda_recurrent_fwd_triton

    inputs = make_inputs(B=2, T=3, H=2, G=2, K=24, V=40, dtype=torch.float32, seed=19)
    args = [inputs[n].to(DEVICE) for n in NAMES]
    h0 = inputs["initial_state"].to(DEVICE)
    o_want, ht_want = kda_recurrent_fwd_triton(*args, None, h0.clone())
    state = h0.clone()
    o, ht = kda_recurrent_fwd_triton(*args, None, state, final_state_out=state)
    assert ht.data_ptr() == state.data_ptr()
    assert torch.equal(o, o_want) and torch.equal(state, ht_want)
    with pytest.raises(ValueError, match="final_state_out"):
        kda_recurrent_fwd_triton(*args, None, h0, final_state_out=h0[:, :1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_decode_graph_capture_and_replay(dtype):
    """A decode loop of 4 steps with static buffers, captured once, replayed on
    fresh tokens, equals eager decoding."""
    B, H, G, K, V, steps = 8, 2, 2, 128, 128, 4
    token = {n: x.cuda() for n, x in make_inputs(B=B, T=1, H=H, G=G, K=K, V=V, dtype=dtype, seed=0).items()}
    static = {n: token[n].clone() for n in NAMES}
    static_state = token["initial_state"].float().clone()

    def loop():
        state, outs = static_state, []
        for _ in range(steps):
            o, state = fused_recurrent_kda(*(static[n] for n in NAMES), initial_state=state, output_final_state=True)
            outs.append(o)
        return torch.cat(outs, 1), state

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        loop()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = loop()
    for seed in (1, 2):
        fresh = {n: x.cuda() for n, x in make_inputs(B=B, T=1, H=H, G=G, K=K, V=V, dtype=dtype, seed=seed).items()}
        for n in NAMES:
            static[n].copy_(fresh[n])
        static_state.copy_(fresh["initial_state"].float())
        graph.replay()
        eager = loop()
        for a, b in zip(static_out, eager):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("T,G,with_h0", CASES)
def test_cuda_public_function_matches_reference(T, G, with_h0):
    inputs = make_inputs(B=2, T=T, H=2, G=G, K=128, V=128, dtype=torch.float32, with_initial_state=with_h0, seed=T)
    args = [inputs[n].cuda() for n in NAMES]
    h0 = inputs["initial_state"].cuda() if with_h0 else None
    o, ht = fused_recurrent_kda(*args, initial_state=h0, output_final_state=True)
    o_ref, ht_ref, _ = kda_forward_reference(*(inputs[n] for n in NAMES), None, inputs["initial_state"])
    torch.testing.assert_close(o.cpu(), o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ht.cpu(), ht_ref, rtol=1e-5, atol=1e-5)
