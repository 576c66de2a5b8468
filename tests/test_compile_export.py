"""torch.compile(fullgraph=True) and torch.export through the ops, on CPU."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

from inputs import make_inputs
from kda_op import CHUNK_SIZE, chunk_kda

NAMES = ("q", "k", "v", "g", "beta", "initial_state")
# Compiled and eager run the same kernels; inductor may fuse the casts around them.
FP32_TOL = dict(rtol=1e-5, atol=1e-5)


def kda_with_state(q, k, v, g, beta, initial_state):
    return chunk_kda(q, k, v, g, beta, initial_state=initial_state, output_final_state=True)


def _fwd_bwd(fn, inputs, seed=0):
    leaves = [inputs[n].detach().clone().requires_grad_(True) for n in NAMES]
    o, ht = fn(*leaves)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=o.dtype)
    dht = torch.randn(ht.shape, generator=gen, dtype=ht.dtype)
    torch.autograd.backward((o, ht), (do, dht))
    return o.detach(), ht.detach(), [x.grad for x in leaves]


def _assert_same(got, want):
    o, ht, grads = got
    o_ref, ht_ref, grads_ref = want
    torch.testing.assert_close(o, o_ref, **FP32_TOL)
    torch.testing.assert_close(ht, ht_ref, **FP32_TOL)
    for name, a, b in zip(NAMES, grads, grads_ref):
        torch.testing.assert_close(a, b, **FP32_TOL, msg=lambda m: f"d{name}: {m}")


def test_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    inputs = make_inputs(B=2, T=CHUNK_SIZE + 7, H=2, G=2, K=8, V=4, dtype=torch.float32)
    compiled = torch.compile(kda_with_state, fullgraph=True)
    _assert_same(_fwd_bwd(compiled, inputs), _fwd_bwd(kda_with_state, inputs))


def test_compile_dynamic_no_recompile():
    """One dynamic compile serves three sequence lengths and two batch sizes."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(kda_with_state, fullgraph=True, dynamic=True, backend=counter)
    # Sizes 0 and 1 are specialised by dynamo, and equal sizes share a symbol
    # (duck sizing), so B, T, H, HV, K and V take values distinct from each other.
    shapes = [(B, T) for B in (3, 5) for T in (7, CHUNK_SIZE + 1, 2 * CHUNK_SIZE + 3)]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for B, T in shapes:
            inputs = make_inputs(B=B, T=T, H=2, G=2, K=8, V=6, dtype=torch.float32)
            _assert_same(_fwd_bwd(compiled, inputs), _fwd_bwd(kda_with_state, inputs))
    assert counter.frame_count == 1


def test_compile_dynamic_inductor_matches_eager():
    """The default (inductor) backend with dynamic shapes, two sequence lengths."""
    torch._dynamo.reset()
    compiled = torch.compile(kda_with_state, fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for T in (9, CHUNK_SIZE + 9):
            inputs = make_inputs(B=2, T=T, H=2, G=2, K=8, V=4, dtype=torch.float32)
            _assert_same(_fwd_bwd(compiled, inputs), _fwd_bwd(kda_with_state, inputs))


class KDABlock(torch.nn.Module):
    """A small module around the op, as a model would use it."""

    def __init__(self, hidden: int = 16, heads: int = 2, group: int = 2, head_dim: int = 8):
        super().__init__()
        self.heads, self.value_heads, self.head_dim = heads, heads * group, head_dim
        self.qk = torch.nn.Linear(hidden, 2 * heads * head_dim)
        self.v = torch.nn.Linear(hidden, heads * group * head_dim)
        self.g = torch.nn.Linear(hidden, heads * group * head_dim)
        self.beta = torch.nn.Linear(hidden, heads * group)
        self.out = torch.nn.Linear(heads * group * head_dim, hidden)

    def forward(self, x: torch.Tensor, state: torch.Tensor):
        B, T, _ = x.shape
        q, k = self.qk(x).view(B, T, 2 * self.heads, self.head_dim).chunk(2, dim=2)
        k = torch.nn.functional.normalize(k, dim=-1)
        v = self.v(x).view(B, T, self.value_heads, self.head_dim)
        g = torch.nn.functional.logsigmoid(self.g(x)).view(B, T, self.value_heads, self.head_dim)
        beta = torch.sigmoid(self.beta(x))
        o, new_state = chunk_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
        return self.out(o.reshape(B, T, -1)), new_state


def test_export_dynamic_save_load(tmp_path):
    torch.manual_seed(0)
    model = KDABlock().eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    seq = torch.export.Dim("seq", min=1, max=8192)
    example = (torch.randn(2, 70, 16), torch.randn(2, 4, 8, 8))
    ep = torch.export.export(
        model, example, dynamic_shapes={"x": {0: batch, 1: seq}, "state": {0: batch}}
    )
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "kda_op.chunk_kda_fwd.default" in targets

    path = tmp_path / "kda_block.pt2"
    torch.export.save(ep, path)
    loaded = torch.export.load(path).module()
    for B, T in [(2, 70), (3, 5), (1, 2 * CHUNK_SIZE + 1)]:
        x, state = torch.randn(B, T, 16), torch.randn(B, 4, 8, 8)
        with torch.no_grad():
            y, s = loaded(x, state)
            y_ref, s_ref = model(x, state)
        assert y.shape == (B, T, 16)
        torch.testing.assert_close(y, y_ref, **FP32_TOL)
        torch.testing.assert_close(s, s_ref, **FP32_TOL)
