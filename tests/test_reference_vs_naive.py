"""The CPU kernels (through the public function and the registered autograd)
against the independent naive loop differentiated by autograd, in fp64."""

from __future__ import annotations

import pytest
import torch

from inputs import make_inputs
from naive import naive_kda
from kda_op import CHUNK_SIZE, chunk_kda

# fp64 on both sides; only the order of the reductions differs.
FP64_TOL = dict(rtol=1e-9, atol=1e-10)
GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def _run(fn, inputs, do, dht, output_final_state):
    leaves = {n: x.detach().clone().requires_grad_(True) for n, x in inputs.items() if x is not None}
    args = [leaves.get(n) for n in ("q", "k", "v", "g", "beta")]
    o, ht = fn(*args, leaves.get("initial_state"), output_final_state)
    loss = (o * do).sum()
    if ht is not None:
        loss = loss + (ht * dht).sum()
    loss.backward()
    return o, ht, {n: x.grad for n, x in leaves.items()}


def _ours(q, k, v, g, beta, h0, output_final_state):
    return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=output_final_state)


def _naive(q, k, v, g, beta, h0, output_final_state):
    o, ht = naive_kda(q, k, v, g, beta, initial_state=h0)
    return o, (ht if output_final_state else None)


@pytest.mark.parametrize("G", [1, 2, 4])
@pytest.mark.parametrize("with_initial_state", [True, False])
@pytest.mark.parametrize("output_final_state", [True, False])
def test_forward_and_grads_match_naive(G, with_initial_state, output_final_state):
    T = 2 * CHUNK_SIZE + 9  # three chunks, the last one partial
    assert T % CHUNK_SIZE != 0
    inputs = make_inputs(B=2, T=T, H=2, G=G, K=8, V=6, with_initial_state=with_initial_state)
    do = torch.randn(2, T, 2 * G, 6, dtype=torch.float64)
    dht = torch.randn(2, 2 * G, 8, 6, dtype=torch.float64)

    o, ht, grads = _run(_ours, inputs, do, dht, output_final_state)
    o_ref, ht_ref, grads_ref = _run(_naive, inputs, do, dht, output_final_state)

    torch.testing.assert_close(o, o_ref, **FP64_TOL)
    if output_final_state:
        torch.testing.assert_close(ht, ht_ref, **FP64_TOL)
    else:
        assert ht is None
    assert set(grads) == set(grads_ref)
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], **FP64_TOL, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("T", [1, 5, CHUNK_SIZE, CHUNK_SIZE + 1])
def test_chunk_edges_match_naive(T):
    """Shorter than a chunk, exactly one chunk, and one token past it."""
    inputs = make_inputs(B=1, T=T, H=1, G=2, K=4, V=5)
    do = torch.randn(1, T, 2, 5, dtype=torch.float64)
    dht = torch.randn(1, 2, 4, 5, dtype=torch.float64)
    o, ht, grads = _run(_ours, inputs, do, dht, True)
    o_ref, ht_ref, grads_ref = _run(_naive, inputs, do, dht, True)
    torch.testing.assert_close(o, o_ref, **FP64_TOL)
    torch.testing.assert_close(ht, ht_ref, **FP64_TOL)
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], **FP64_TOL)


def test_explicit_scale_matches_naive():
    inputs = make_inputs(B=1, T=20, H=2, G=2, K=8, V=4)
    args = [inputs[n] for n in ("q", "k", "v", "g", "beta")]
    o, ht = chunk_kda(*args, scale=0.3, initial_state=inputs["initial_state"], output_final_state=True)
    o_ref, ht_ref = naive_kda(*args, scale=0.3, initial_state=inputs["initial_state"])
    torch.testing.assert_close(o, o_ref, **FP64_TOL)
    torch.testing.assert_close(ht, ht_ref, **FP64_TOL)


def test_non_contiguous_inputs_and_expanded_grads():
    """Permuted-layout inputs and the stride-0 grads of .sum() (DESIGN.md section 5)."""
    inputs = make_inputs(B=2, T=CHUNK_SIZE + 3, H=2, G=2, K=8, V=6)
    permuted = {
        n: x.movedim(1, 2).contiguous().movedim(2, 1) if x.dim() == 4 and n != "initial_state" else x
        for n, x in inputs.items()
    }
    assert not permuted["q"].is_contiguous()

    def loss_of(fn, ins):
        leaves = {n: x.detach().clone().requires_grad_(True) for n, x in ins.items()}
        o, ht = fn(*(leaves[n] for n in ("q", "k", "v", "g", "beta")), leaves["initial_state"], True)
        (o.sum() + ht.sum()).backward()
        return o, ht, {n: x.grad for n, x in leaves.items()}

    o, ht, grads = loss_of(_ours, permuted)
    o_ref, ht_ref, grads_ref = loss_of(_naive, inputs)
    torch.testing.assert_close(o, o_ref, **FP64_TOL)
    torch.testing.assert_close(ht, ht_ref, **FP64_TOL)
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], **FP64_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_dtypes(dtype):
    """Output and grad dtypes follow the inputs; values match fp64 on the same
    (rounded) inputs within the output dtype's rounding."""
    inputs = make_inputs(B=1, T=CHUNK_SIZE + 5, H=2, G=2, K=8, V=6, dtype=dtype)
    upcast = {n: x.double() for n, x in inputs.items()}
    T = inputs["q"].shape[1]
    do = torch.randn(1, T, 4, 6, dtype=torch.float64)
    dht = torch.randn(1, 4, 8, 6, dtype=torch.float64)

    o, ht, grads = _run(_ours, inputs, do.to(dtype), dht, True)
    o_ref, ht_ref, grads_ref = _run(_naive, upcast, do.to(dtype).double(), dht, True)

    assert o.dtype == dtype and ht.dtype == torch.float32
    for name, grad in grads.items():
        assert grad.dtype == inputs[name].dtype, name
    # fp32: state math in fp32 (eps 1.2e-7) over ~70 steps. bf16/fp16: o and the
    # grads are rounded to the input dtype (eps 2^-8 / 2^-11) once at the end.
    tol = {
        torch.float32: dict(rtol=1e-4, atol=1e-5),
        torch.float16: dict(rtol=4e-3, atol=4e-3),
        torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
    }[dtype]
    torch.testing.assert_close(o.double(), o_ref, **tol)
    torch.testing.assert_close(ht.double(), ht_ref, rtol=1e-4, atol=1e-5)
    for name in grads:
        torch.testing.assert_close(grads[name].double(), grads_ref[name], **tol, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("with_initial_state", [True, False])
def test_empty_sequence(with_initial_state):
    inputs = make_inputs(B=2, T=0, H=2, G=2, K=4, V=3, with_initial_state=with_initial_state, requires_grad=True)
    args = [inputs[n] for n in ("q", "k", "v", "g", "beta")]
    h0 = inputs["initial_state"]
    o, ht = chunk_kda(*args, initial_state=h0, output_final_state=True)
    assert o.shape == (2, 0, 4, 3) and o.dtype == torch.float64
    expected = h0 if with_initial_state else torch.zeros(2, 4, 4, 3, dtype=torch.float64)
    torch.testing.assert_close(ht, expected, rtol=0, atol=0)
    if with_initial_state:
        assert ht.data_ptr() != h0.data_ptr()  # a fresh tensor, not an alias
        dht = torch.randn_like(ht)
        (ht * dht).sum().backward()
        torch.testing.assert_close(h0.grad, dht, rtol=0, atol=0)


def test_inputs_are_not_mutated():
    inputs = make_inputs(B=2, T=CHUNK_SIZE + 2, H=2, G=2, K=8, V=6, requires_grad=True)
    before = {n: x.detach().clone() for n, x in inputs.items()}
    args = [inputs[n] for n in ("q", "k", "v", "g", "beta")]
    o, ht = chunk_kda(*args, initial_state=inputs["initial_state"], output_final_state=True)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    before_grads = (do.clone(), dht.clone())
    torch.autograd.backward((o, ht), (do, dht))
    for name, x in inputs.items():
        assert torch.equal(x.detach(), before[name]), name
    assert torch.equal(do, before_grads[0]) and torch.equal(dht, before_grads[1])


def test_grads_when_only_the_final_state_is_used():
    """A loss on the final state alone: o gets no grad (None, not zeros, reaches
    the backward) and the grads still match the naive loop's."""
    inputs = make_inputs(B=1, T=CHUNK_SIZE + 11, H=1, G=2, K=6, V=5)
    dht = torch.randn(1, 2, 6, 5, dtype=torch.float64)

    def grads_of(fn):
        leaves = {n: x.detach().clone().requires_grad_(True) for n, x in inputs.items()}
        _, ht = fn(*(leaves[n] for n in ("q", "k", "v", "g", "beta")), leaves["initial_state"], True)
        (ht * dht).sum().backward()
        return {n: x.grad for n, x in leaves.items()}

    grads, grads_ref = grads_of(_ours), grads_of(_naive)
    assert grads_ref["q"] is None  # q reaches only o in the naive loop: no grad there
    assert torch.count_nonzero(grads["q"]) == 0  # the op returns all its grads: zeros for q
    for name in ("k", "v", "g", "beta", "initial_state"):
        torch.testing.assert_close(grads[name], grads_ref[name], **FP64_TOL, msg=lambda m: f"d{name}: {m}")
