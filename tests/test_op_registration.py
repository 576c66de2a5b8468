"""The ops as torch.library operators: opcheck and gradcheck."""

from __future__ import annotations

import pytest
import torch

from inputs import make_inputs
from kda_op import CHUNK_SIZE, chunk_kda

OPCHECK_UTILS = (
    "test_schema",
    "test_autograd_registration",
    "test_faketensor",
    "test_aot_dispatch_dynamic",
)


def _fwd_args(inputs, scale=None):
    return (
        inputs["q"],
        inputs["k"],
        inputs["v"],
        inputs["g"],
        inputs["beta"],
        scale,
        inputs["initial_state"],
    )


def test_schemas_declare_no_mutation():
    for op in (torch.ops.kda_op.chunk_kda_fwd.default, torch.ops.kda_op.chunk_kda_bwd.default):
        assert not op._schema.is_mutable, op
        assert all(a.alias_info is None for a in op._schema.arguments), op


@pytest.mark.parametrize("with_initial_state", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_forward(with_initial_state, dtype):
    inputs = make_inputs(
        B=2, T=CHUNK_SIZE + 3, H=2, G=2, K=8, V=4, dtype=dtype,
        with_initial_state=with_initial_state, requires_grad=True,
    )
    torch.library.opcheck(torch.ops.kda_op.chunk_kda_fwd.default, _fwd_args(inputs), test_utils=OPCHECK_UTILS)
    torch.library.opcheck(torch.ops.kda_op.chunk_kda_fwd.default, _fwd_args(inputs, 0.25), test_utils=OPCHECK_UTILS)
    # keep_intermediates: the reference keeps none, and the fake kernel says so
    keep_args = _fwd_args(inputs) + (True,)
    torch.library.opcheck(torch.ops.kda_op.chunk_kda_fwd.default, keep_args, test_utils=OPCHECK_UTILS)
    assert torch.ops.kda_op.chunk_kda_fwd(*keep_args)[3].shape == (0,)


@pytest.mark.parametrize("with_initial_state", [True, False])
def test_forward_without_final_state(with_initial_state):
    """output_final_state=False: the final state is empty (fake kernel, opcheck),
    everything else as with it, and the grads of the inputs through o alone the
    same as with a final state that got no grad."""
    inputs = make_inputs(
        B=2, T=CHUNK_SIZE + 3, H=2, G=2, K=8, V=4, dtype=torch.float32,
        with_initial_state=with_initial_state, requires_grad=True,
    )
    op = torch.ops.kda_op.chunk_kda_fwd.default
    kwargs = dict(output_final_state=False)
    torch.library.opcheck(op, _fwd_args(inputs), kwargs, test_utils=OPCHECK_UTILS)
    o, ht, cs, _ = op(*_fwd_args(inputs), **kwargs)
    o_full, ht_full, cs_full, _ = op(*_fwd_args(inputs))
    assert ht.shape == (0,) and ht_full.shape == (2, 4, 8, 4)
    assert torch.equal(o, o_full) and torch.equal(cs, cs_full)
    do = torch.randn_like(o)
    leaves = [x for x in inputs.values() if x is not None]
    grads = torch.autograd.grad(o, leaves, do)
    grads_full = torch.autograd.grad(o_full, leaves, do)
    for a, b in zip(grads, grads_full):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("with_initial_state", [True, False])
def test_forward_without_chunk_states(with_initial_state):
    """keep_chunk_states=False (a forward without grad): the chunk states are empty
    (fake kernel, opcheck), o and the final state as with them; where an input
    requires grad the op refuses, naming the argument. chunk_kda passes it under
    torch.no_grad only."""
    inputs = make_inputs(
        B=2, T=2 * CHUNK_SIZE + 3, H=2, G=2, K=8, V=4, dtype=torch.float32,
        with_initial_state=with_initial_state, requires_grad=True,
    )
    op = torch.ops.kda_op.chunk_kda_fwd.default
    plain = {n: (x.detach() if x is not None else None) for n, x in inputs.items()}
    kwargs = dict(keep_chunk_states=False)
    utils = tuple(u for u in OPCHECK_UTILS if u != "test_autograd_registration")  # no grad: no autograd here
    torch.library.opcheck(op, _fwd_args(plain), kwargs, test_utils=utils)
    o, ht, cs, _ = op(*_fwd_args(plain), **kwargs)
    o_full, ht_full, cs_full, _ = op(*_fwd_args(plain))
    assert cs.shape == (0,) and cs_full.shape == (2, 4, 4, 8, 4)
    assert torch.equal(o, o_full) and torch.equal(ht, ht_full)
    with pytest.raises(ValueError, match="keep_chunk_states"):
        op(*_fwd_args(inputs), **kwargs)
    with torch.no_grad():  # nothing records a backward
        assert op(*_fwd_args(inputs), **kwargs)[2].shape == (0,)

    from torch.utils._python_dispatch import TorchDispatchMode

    keep = []
    schema = op._schema
    at = [a.name for a in schema.arguments].index("keep_chunk_states")

    class Recording(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is op:  # trailing arguments at their defaults are not passed
                keep.append(args[at] if len(args) > at else (kwargs or {}).get("keep_chunk_states", True))
            return func(*args, **(kwargs or {}))

    call = dict(initial_state=inputs["initial_state"], output_final_state=True)
    qkvgb = [inputs[n] for n in ("q", "k", "v", "g", "beta")]
    with Recording():
        with torch.no_grad():
            o_no_grad, ht_no_grad = chunk_kda(*qkvgb, **call)
        o_grad, ht_grad = chunk_kda(*qkvgb, **call)
    assert keep == [False, True]
    assert torch.equal(o_no_grad, o_grad) and torch.equal(ht_no_grad, ht_grad)


@pytest.mark.parametrize("with_initial_state", [True, False])
@pytest.mark.parametrize("with_dht", [True, False])
def test_opcheck_backward(with_initial_state, with_dht):
    inputs = make_inputs(
        B=2, T=CHUNK_SIZE + 3, H=2, G=2, K=8, V=4, dtype=torch.float32,
        with_initial_state=with_initial_state,
    )
    o, ht, chunk_states, _ = torch.ops.kda_op.chunk_kda_fwd(*_fwd_args(inputs))
    assert chunk_states.shape == (2, 3, 4, 8, 4)  # two chunks: three boundaries
    do = torch.randn_like(o)
    dht = torch.randn_like(ht) if with_dht else None
    args = (*_fwd_args(inputs), chunk_states, do, dht)
    torch.library.opcheck(torch.ops.kda_op.chunk_kda_bwd.default, args, test_utils=OPCHECK_UTILS)


def test_gradcheck_tiny():
    inputs = make_inputs(B=1, T=5, H=1, G=2, K=3, V=2, requires_grad=True)

    def fn(q, k, v, g, beta, h0):
        return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)

    assert torch.autograd.gradcheck(fn, tuple(inputs.values()))


def test_gradcheck_across_chunks():
    """Two chunks, so the backward's per-chunk recomputation is exercised too."""
    inputs = make_inputs(B=1, T=CHUNK_SIZE + 3, H=1, G=1, K=2, V=2, requires_grad=True)

    def fn(q, k, v, g, beta, h0):
        return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)

    assert torch.autograd.gradcheck(fn, tuple(inputs.values()), fast_mode=True)
