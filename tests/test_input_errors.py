"""Bad input raises a TypeError or ValueError that names the argument, before any
kernel runs."""

from __future__ import annotations

import pytest
import torch

from inputs import make_inputs
from kda_op import chunk_kda


def _good(**overrides):
    inputs = make_inputs(B=2, T=5, H=2, G=2, K=4, V=3, dtype=torch.float32)
    inputs.update(overrides)
    return inputs


def _call(inputs, **kwargs):
    return chunk_kda(
        inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
        initial_state=inputs["initial_state"], **kwargs,
    )


def test_good_inputs_pass():
    o, ht = _call(_good(), output_final_state=True)
    assert o.shape == (2, 5, 4, 3) and ht.shape == (2, 4, 4, 3)


CASES = [
    # (description, overrides, exception, words the message must hold)
    ("q rank", dict(q=torch.randn(2, 5, 8)), ValueError, ["q", "4-D"]),
    ("k rank", dict(k=torch.randn(2, 5, 2, 4, 1)), ValueError, ["k", "4-D"]),
    ("v rank", dict(v=torch.randn(2, 5, 12)), ValueError, ["v", "4-D"]),
    ("g rank", dict(g=torch.randn(2, 5, 16)), ValueError, ["g", "4-D"]),
    ("beta rank", dict(beta=torch.rand(2, 5, 4, 1)), ValueError, ["beta", "3-D"]),
    ("initial_state rank", dict(initial_state=torch.randn(2, 4, 12)), ValueError, ["initial_state", "4-D"]),
    ("k shape", dict(k=torch.randn(2, 5, 2, 5)), ValueError, ["k", "q's shape"]),
    ("v batch", dict(v=torch.randn(3, 5, 4, 3)), ValueError, ["v", "B=2"]),
    ("v length", dict(v=torch.randn(2, 6, 4, 3)), ValueError, ["v", "T=5"]),
    ("HV not a multiple of H", dict(v=torch.randn(2, 5, 3, 3), g=torch.randn(2, 5, 3, 4), beta=torch.rand(2, 5, 3), initial_state=None), ValueError, ["HV", "multiple", "H=2"]),
    ("g shape", dict(g=torch.randn(2, 5, 2, 4)), ValueError, ["g", "[B, T, HV, K]"]),
    ("beta shape", dict(beta=torch.rand(2, 5, 2)), ValueError, ["beta", "[B, T, HV]"]),
    ("initial_state shape", dict(initial_state=torch.randn(2, 4, 3, 4)), ValueError, ["initial_state", "[B, HV, K, V]"]),
    ("K of 0", dict(q=torch.randn(2, 5, 2, 0), k=torch.randn(2, 5, 2, 0), g=torch.randn(2, 5, 4, 0), initial_state=None), ValueError, ["K"]),
    ("V of 0", dict(v=torch.randn(2, 5, 4, 0), initial_state=None), ValueError, ["V"]),
    ("q integer dtype", dict(q=torch.ones(2, 5, 2, 4, dtype=torch.int64)), TypeError, ["q", "torch.int64"]),
    ("g bool dtype", dict(g=torch.ones(2, 5, 4, 4, dtype=torch.bool)), TypeError, ["g", "torch.bool"]),
    ("beta integer dtype", dict(beta=torch.ones(2, 5, 4, dtype=torch.int32)), TypeError, ["beta", "torch.int32"]),
    ("initial_state integer dtype", dict(initial_state=torch.ones(2, 4, 4, 3, dtype=torch.int32)), TypeError, ["initial_state", "torch.int32"]),
    ("q/v dtypes differ", dict(v=torch.randn(2, 5, 4, 3, dtype=torch.float64)), TypeError, ["q, k and v", "float64"]),
    ("q not a tensor", dict(q=[[1.0]]), TypeError, ["q", "list"]),
    ("beta on meta device", dict(beta=torch.rand(2, 5, 4, device="meta")), ValueError, ["beta", "device"]),
    ("initial_state on meta device", dict(initial_state=torch.randn(2, 4, 4, 3, device="meta")), ValueError, ["initial_state", "device"]),
]


@pytest.mark.parametrize("what,overrides,exc,words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises(what, overrides, exc, words):
    with pytest.raises(exc) as info:
        _call(_good(**overrides))
    for word in words:
        assert word in str(info.value), f"{what}: {word!r} not in {info.value}"


def test_bad_scale_and_flag():
    with pytest.raises(TypeError, match="scale"):
        _call(_good(), scale="0.5")
    with pytest.raises(ValueError, match="scale"):
        _call(_good(), scale=float("nan"))
    with pytest.raises(TypeError, match="output_final_state"):
        _call(_good(), output_final_state=1)
    with pytest.raises(TypeError, match="recompute_in_backward"):
        _call(_good(), recompute_in_backward=1)


def test_checks_run_before_any_kernel(monkeypatch):
    """A bad input never reaches the op."""
    import kda_op.api as api

    calls = []
    monkeypatch.setattr(api.torch.ops.kda_op, "chunk_kda_fwd", lambda *a: calls.append(a))
    with pytest.raises(ValueError):
        _call(_good(beta=torch.rand(2, 5, 2)))
    assert calls == []
