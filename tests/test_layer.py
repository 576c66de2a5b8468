"""kda_op.nn.KimiDeltaAttention as a drop-in for flash-linear-attention 0.6's
``fla.layers.kda.KimiDeltaAttention``: its constructor and state_dict layout, its
function against an independent plain-PyTorch composition of the layer's math
(outputs, states and parameter grads, fp64), the attention_mask path (each padded
row equals that row run alone; torch.compile of it), and, on a GPU with fla
installed, fla's own layer."""

from __future__ import annotations

import importlib
import inspect
import math
import os
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from kda_op import chunk_kda
from kda_op.nn import KimiDeltaAttention, RMSNormGated, ShortConvolution
from naive import naive_kda

HIDDEN, H, K = 24, 2, 8


def _varlen_available() -> bool:
    """Whether chunk_kda takes cu_seqlens yet (another change adds it)."""
    x = torch.randn(1, 3, 1, 4, dtype=torch.float64)
    try:
        chunk_kda(x, x, x, -torch.rand_like(x), torch.rand(1, 3, 1, dtype=torch.float64),
                  cu_seqlens=torch.tensor([0, 1, 3], dtype=torch.int32))
    except NotImplementedError:
        return False
    return True


needs_varlen = pytest.mark.skipif(
    not _varlen_available(),
    reason="the attention_mask path runs chunk_kda(cu_seqlens=...), which raises NotImplementedError until "
           "variable-length packing lands in kda_op",
)


def _layer(seed: int = 0, dtype: torch.dtype = torch.float64, **options) -> KimiDeltaAttention:
    """A small layer whose every parameter is drawn afresh (no ones, zeros or
    structured init left), in ``dtype``."""
    config = dict(hidden_size=HIDDEN, head_dim=K, num_heads=H, num_v_heads=4, expand_v=0.75, conv_size=4)
    config.update(options)
    torch.manual_seed(seed)
    layer = KimiDeltaAttention(**config).to(dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(0.5 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
            elif name == "o_norm.weight":
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 4
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) / math.sqrt(fan_in))
    return layer


def _x(B: int, T: int, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(B, T, HIDDEN, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


# -- the constructor and the state_dict contract ---------------------------------


def _fla_layout(hidden, head_dim, num_heads, num_v_heads, expand_v, conv_size, conv_bias, use_short_conv):
    """fla 0.6's ``KimiDeltaAttention`` state_dict, written out from its
    ``__init__`` (fla/layers/kda.py): name -> (shape, dtype or None for the
    default dtype). key_dim = H*K, head_v_dim = K*expand_v, value_dim =
    HV*head_v_dim, gate_dim = HV*K; f_proj and g_proj bottleneck through
    head_v_dim; the short convolutions are nn.Conv1d's (weight [D, 1, W], bias
    [D]); A_log [HV] and dt_bias [HV*K] are created fp32; o_norm is
    FusedRMSNormGated (weight only)."""
    key_dim, head_v_dim = num_heads * head_dim, int(head_dim * expand_v)
    value_dim, gate_dim = num_v_heads * head_v_dim, num_v_heads * head_dim
    layout = {
        "q_proj.weight": ((key_dim, hidden), None),
        "k_proj.weight": ((key_dim, hidden), None),
        "v_proj.weight": ((value_dim, hidden), None),
        "f_proj.0.weight": ((head_v_dim, hidden), None),
        "f_proj.1.weight": ((gate_dim, head_v_dim), None),
        "b_proj.weight": ((num_v_heads, hidden), None),
        "A_log": ((num_v_heads,), torch.float32),
        "dt_bias": ((gate_dim,), torch.float32),
        "g_proj.0.weight": ((head_v_dim, hidden), None),
        "g_proj.1.weight": ((value_dim, head_v_dim), None),
        "g_proj.1.bias": ((value_dim,), None),
        "o_norm.weight": ((head_v_dim,), None),
        "o_proj.weight": ((hidden, value_dim), None),
    }
    if use_short_conv:
        for name, dim in (("q", key_dim), ("k", key_dim), ("v", value_dim)):
            layout[f"{name}_conv1d.weight"] = ((dim, 1, conv_size), None)
            if conv_bias:
                layout[f"{name}_conv1d.bias"] = ((dim,), None)
    return layout


@pytest.mark.parametrize("config", [
    dict(hidden_size=24, head_dim=8, num_heads=2, num_v_heads=4, expand_v=0.75, conv_size=4, conv_bias=False,
         use_short_conv=True),
    dict(hidden_size=32, head_dim=16, num_heads=2, num_v_heads=2, expand_v=2, conv_size=3, conv_bias=True,
         use_short_conv=True),
    dict(hidden_size=16, head_dim=8, num_heads=1, num_v_heads=3, expand_v=1, conv_size=4, conv_bias=True,
         use_short_conv=False),
])
def test_state_dict_has_fla_06_keys_shapes_and_dtypes(config):
    layer = KimiDeltaAttention(**config)
    want = _fla_layout(config["hidden_size"], config["head_dim"], config["num_heads"], config["num_v_heads"],
                       config["expand_v"], config["conv_size"], config["conv_bias"], config["use_short_conv"])
    got = layer.state_dict()
    assert sorted(got) == sorted(want)
    for name, (shape, dtype) in want.items():
        assert tuple(got[name].shape) == shape, name
        assert got[name].dtype == (dtype or torch.get_default_dtype()), name
    # A state_dict of that layout loads strictly.
    layer.load_state_dict({name: torch.randn(shape, dtype=dtype) for name, (shape, dtype) in want.items()})


def test_fla_initialisation_and_attributes():
    layer = KimiDeltaAttention(hidden_size=32, head_dim=8, num_heads=2, num_v_heads=4, conv_bias=True)
    A = layer.A_log.detach().exp()
    assert ((A >= 1 - 1e-5) & (A <= 16 + 1e-4)).all()
    dt = F.softplus(layer.dt_bias.detach())
    assert ((dt >= 1e-4 * (1 - 1e-4)) & (dt <= 0.1 * (1 + 1e-4))).all()
    assert torch.equal(layer.o_norm.weight.detach(), torch.ones(8))
    assert layer.A_log._no_weight_decay and layer.dt_bias._no_weight_decay
    bound = 1 / math.sqrt(4)  # nn.Conv1d's: fan_in = kernel_size for a depthwise conv
    assert layer.q_conv1d.bias.abs().max() <= bound and layer.q_conv1d.weight.abs().max() <= bound
    safe = KimiDeltaAttention(hidden_size=32, head_dim=8, num_heads=2, safe_gate=True, lower_bound=-5.0)
    assert torch.equal(safe.A_log.detach(), torch.zeros(2))
    # fla's attributes
    for name, value in dict(mode="chunk", head_k_dim=8, head_v_dim=8, key_dim=16, value_dim=32, gate_dim=32,
                            num_v_heads=4, layer_idx=None, use_short_conv=True, conv_size=4).items():
        assert getattr(layer, name) == value, name


def test_constructor_defaults_are_fla_06s():
    want = dict(hidden_size=2048, expand_v=1, head_dim=128, num_heads=16, num_v_heads=None, mode="chunk",
                use_short_conv=True, allow_neg_eigval=False, safe_gate=False, lower_bound=None, conv_size=4,
                conv_bias=False, layer_idx=None, norm_eps=1e-5)
    params = inspect.signature(KimiDeltaAttention.__init__).parameters
    assert list(params)[1:] == [*want, "kwargs"]
    assert {name: params[name].default for name in want} == want
    assert params["kwargs"].kind is inspect.Parameter.VAR_KEYWORD


def test_constructor_checks_name_the_argument():
    small = dict(hidden_size=16, head_dim=8, num_heads=2)
    with pytest.raises(ValueError, match="expand_v"):
        KimiDeltaAttention(**small, expand_v=0.3)  # head_v_dim 2.4
    with pytest.raises(ValueError, match="num_v_heads"):
        KimiDeltaAttention(**small, num_v_heads=3)
    with pytest.raises(ValueError, match="num_v_heads"):
        KimiDeltaAttention(**small, num_v_heads=1)
    with pytest.raises(ValueError, match="mode"):
        KimiDeltaAttention(**small, mode="parallel")
    with pytest.raises(ValueError, match="lower_bound"):
        KimiDeltaAttention(**small, safe_gate=True)
    with pytest.raises(ValueError, match="lower_bound"):
        KimiDeltaAttention(**small, safe_gate=True, lower_bound=-6.0)
    with pytest.raises(TypeError, match="lower_bound"):
        KimiDeltaAttention(**small, lower_bound="-5")
    with pytest.raises(TypeError, match="hidden_size"):
        KimiDeltaAttention(hidden_size=16.0, head_dim=8, num_heads=2)
    with pytest.raises(ValueError, match="num_heads"):
        KimiDeltaAttention(hidden_size=16, head_dim=8, num_heads=0)
    with pytest.raises(TypeError, match="conv_bias"):
        KimiDeltaAttention(**small, conv_bias=1)
    with pytest.raises(ValueError, match="norm_eps"):
        KimiDeltaAttention(**small, norm_eps=0.0)
    # kda-op's former keywords would vanish into **kwargs: refused.
    with pytest.raises(TypeError, match="v_head_dim"):
        KimiDeltaAttention(**small, v_head_dim=4)
    # fla ignores other keywords (model configs pass theirs).
    KimiDeltaAttention(**small, fuse_norm=True, attn_mode="chunk")


# -- an independent composition of the layer's math ------------------------------


def _oracle(p: dict, x: torch.Tensor, cfg: dict, state=None):
    """The layer written out from its definition in plain PyTorch, on the
    parameters ``p`` (name -> tensor): projections, a tap-by-tap causal
    convolution with SiLU, l2 norm of q and k (``x / sqrt(sum x^2 + 1e-6)``), the
    gate, the beta sigmoid, tests/naive.py's KDA loop, the sigmoid-gated RMSNorm
    and o_proj. Returns (y, (recurrent, q cache, k cache, v cache))."""
    B, T, _ = x.shape
    HV, V, W = cfg["num_v_heads"], int(K * cfg["expand_v"]), cfg["conv_size"]
    recurrent, caches = (None, (None, None, None)) if state is None else (state[0], state[1:])

    def conv(name, u, cache):
        if not cfg["use_short_conv"]:
            return F.silu(u), None
        w = p[f"{name}_conv1d.weight"][:, 0, :]  # [D, W]
        ut = u.transpose(1, 2)
        if cache is None:
            cache = ut.new_zeros(B, ut.shape[1], W - 1)
        full = torch.cat([cache, ut], dim=2)
        out = sum(w[:, i, None] * full[:, :, i:i + T] for i in range(W))
        if f"{name}_conv1d.bias" in p:
            out = out + p[f"{name}_conv1d.bias"][:, None]
        return F.silu(out).transpose(1, 2), full[:, :, T:]

    def l2(u):
        return u / torch.sqrt(u.square().sum(-1, keepdim=True) + 1e-6)

    q, cq = conv("q", x @ p["q_proj.weight"].T, caches[0])
    k, ck = conv("k", x @ p["k_proj.weight"].T, caches[1])
    v, cv = conv("v", x @ p["v_proj.weight"].T, caches[2])
    q, k, v = l2(q.view(B, T, H, K)), l2(k.view(B, T, H, K)), v.view(B, T, HV, V)
    f = (x @ p["f_proj.0.weight"].T @ p["f_proj.1.weight"].T).view(B, T, HV, K) + p["dt_bias"].view(HV, K)
    A = p["A_log"].exp()[:, None]
    if cfg.get("lower_bound") is not None:
        g = cfg["lower_bound"] * torch.sigmoid(A * f)
    else:
        g = -A * F.softplus(f)
    beta = torch.sigmoid(x @ p["b_proj.weight"].T) * (2.0 if cfg.get("allow_neg_eigval") else 1.0)
    o, recurrent = naive_kda(q, k, v, g, beta, initial_state=recurrent)
    gate = (x @ p["g_proj.0.weight"].T @ p["g_proj.1.weight"].T + p["g_proj.1.bias"]).view(B, T, HV, V)
    o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + 1e-5) * p["o_norm.weight"] * torch.sigmoid(gate)
    return o.reshape(B, T, HV * V) @ p["o_proj.weight"].T, (recurrent, cq, ck, cv)


ORACLE_CONFIGS = [
    pytest.param(dict(num_v_heads=4, expand_v=0.75, conv_size=4, use_short_conv=True), id="gva"),
    pytest.param(dict(num_v_heads=2, expand_v=1.0, conv_size=3, use_short_conv=True, conv_bias=True,
                      allow_neg_eigval=True, safe_gate=True, lower_bound=-4.0), id="bias-negeig-safegate"),
    pytest.param(dict(num_v_heads=2, expand_v=1.25, conv_size=4, use_short_conv=False, lower_bound=-3.0),
                 id="noconv-lowerbound"),
]


def _config(options: dict) -> dict:
    return dict(dict(conv_bias=False, allow_neg_eigval=False, safe_gate=False, lower_bound=None), **options)


@pytest.mark.parametrize("options", ORACLE_CONFIGS)
def test_layer_matches_plain_pytorch_composition_with_parameter_grads(options):
    cfg = _config(options)
    layer = _layer(seed=3, **cfg)
    params = dict(layer.named_parameters())
    x = _x(2, 70, seed=4).requires_grad_()  # 70 tokens: two 64-token chunks
    y, (rec, cq, ck, cv) = layer(x)
    x_ref = x.detach().clone().requires_grad_()
    p_ref = {name: t.detach().clone().requires_grad_() for name, t in params.items()}
    y_ref, (rec_ref, cq_ref, ck_ref, cv_ref) = _oracle(p_ref, x_ref, cfg)

    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(rec, rec_ref, rtol=1e-10, atol=1e-10)
    if cfg["use_short_conv"]:
        for got, want in ((cq, cq_ref), (ck, ck_ref), (cv, cv_ref)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    else:
        assert cq is None and ck is None and cv is None

    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    drec = torch.randn(rec.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    ((y * dy).sum() + (rec * drec).sum()).backward()
    ((y_ref * dy).sum() + (rec_ref * drec).sum()).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-9, atol=1e-10)
    for name, param in params.items():
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, p_ref[name].grad, rtol=1e-9, atol=1e-10,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("options", ORACLE_CONFIGS)
def test_prefill_then_decode_continues_the_sequence(options):
    """Prefill with chunk_kda, then decode (fused_recurrent_kda) from the returned
    state, equals the oracle run on the whole sequence; mode="fused_recurrent"
    without grad, too."""
    cfg = _config(options)
    layer = _layer(seed=7, **cfg)
    p = {name: t.detach() for name, t in layer.named_parameters()}
    x = _x(3, 13, seed=8)
    with torch.no_grad():
        y_ref, state_ref = _oracle(p, x, cfg)
        y1, state = layer(x[:, :9])
        y2, state = layer(x[:, 9:12], state, decode=True)
        y3, state = layer(x[:, 12:], state, decode=True)
        layer.mode = "fused_recurrent"
        y_fr, state_fr = layer(x)
    torch.testing.assert_close(torch.cat([y1, y2, y3], dim=1), y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(y_fr, y_ref, rtol=1e-10, atol=1e-10)
    for got, got_fr, want in zip(state, state_fr, state_ref):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got_fr, want, rtol=1e-10, atol=1e-10)


def test_short_convolution_and_gated_rmsnorm_pieces():
    """The pieces against torch's own: the conv is nn.Conv1d with fla's padding
    (weight[:, 0, -1] on the current token) then SiLU; the norm is fla's
    FusedRMSNormGated(activation='sigmoid') math, in fp32 for bf16 inputs."""
    torch.manual_seed(0)
    conv = ShortConvolution(6, 4, bias=True).double()
    ref = torch.nn.Conv1d(6, 6, 4, padding=3, groups=6, bias=True).double()
    ref.load_state_dict(conv.state_dict())
    x = torch.randn(2, 9, 6, dtype=torch.float64)
    y, cache = conv(x)
    torch.testing.assert_close(y, F.silu(ref(x.transpose(1, 2))[..., :9]).transpose(1, 2), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cache, x[:, -3:].transpose(1, 2))

    norm = RMSNormGated(6, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(6))
    o, g = torch.randn(4, 3, 6).bfloat16(), torch.randn(4, 3, 6).bfloat16()
    of = o.float()
    want = of * torch.rsqrt(of.square().mean(-1, keepdim=True) + 1e-5) * norm.weight * torch.sigmoid(g.float())
    got = norm(o, g)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want.bfloat16(), rtol=0, atol=0)


def test_short_convolution_varlen_keeps_sequences_apart():
    """Packed sequences (one empty, some shorter than the kernel) each see only
    their own cache: equal to convolving each alone."""
    gen = torch.Generator().manual_seed(11)
    for W in (1, 2, 4):
        conv = ShortConvolution(5, W, bias=True).double()
        x = torch.randn(1, 12, 5, generator=gen, dtype=torch.float64)
        cache = torch.randn(5, 5, W - 1, generator=gen, dtype=torch.float64)
        cu = torch.tensor([0, 2, 2, 3, 11, 12], dtype=torch.int32)
        y, new_cache = conv(x, cache, cu_seqlens=cu)
        for n in range(5):
            a, b = int(cu[n]), int(cu[n + 1])
            if a == b:
                torch.testing.assert_close(new_cache[n], cache[n], rtol=0, atol=0)
                continue
            y_n, cache_n = conv(x[:, a:b], cache[n:n + 1])
            torch.testing.assert_close(y[:, a:b], y_n, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(new_cache[n:n + 1], cache_n, rtol=0, atol=0)


def test_forward_argument_checks():
    layer = _layer()
    x = _x(2, 5, seed=0)
    with pytest.raises(ValueError, match="hidden_states"):
        layer(x[..., :-1])
    with pytest.raises(ValueError, match="attention_mask"):
        layer(x, attention_mask=torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask"):
        layer(x, attention_mask=torch.ones(10, dtype=torch.long))
    with pytest.raises(TypeError, match="decode"):
        layer(x, decode=1)
    with pytest.raises(ValueError, match="not both"):
        layer(x[:1], attention_mask=torch.ones(1, 5, dtype=torch.long), cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="must be \\[1, T"):
        layer(x, cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="cu_seqlens must be a 1-D int32 or int64"):
        layer(x[:1], cu_seqlens=torch.tensor([0.0, 5.0]))


@needs_varlen
@pytest.mark.parametrize("decode", [False, True], ids=["chunk", "fused_recurrent"])
def test_cu_seqlens_sequences_equal_each_sequence_alone(decode):
    """fla's layer keyword: N sequences packed in [1, T] (an empty one and one of a
    single token among them), each continuing its own state, give each sequence's
    outputs and new state alone (the attention's and the short convolutions')."""
    layer = _layer(seed=3)
    lengths = [7, 0, 1, 12]
    cu = torch.tensor([0] + lengths).cumsum(0)
    x = _x(1, sum(lengths), seed=4)
    first = [layer(_x(1, 3 + n, seed=10 + n))[1] for n in range(len(lengths))]  # a state per sequence
    states = tuple(torch.cat([s[i] for s in first]) for i in range(4))
    y, new = layer(x, states, decode, cu_seqlens=cu)
    for n in range(len(lengths)):
        a, b = int(cu[n]), int(cu[n + 1])
        y_n, new_n = layer(x[:, a:b], tuple(s[n:n + 1] for s in states), decode)
        torch.testing.assert_close(y[:, a:b], y_n, rtol=1e-10, atol=1e-12)
        for got, want in zip(new, new_n):
            torch.testing.assert_close(got[n:n + 1], want, rtol=1e-10, atol=1e-12)


# -- attention_mask: unpad to varlen, repad --------------------------------------


def _mask(T: int, rows: list) -> torch.Tensor:
    """rows: per row a (start, stop) of its tokens, or a list of token positions."""
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for b, row in enumerate(rows):
        if isinstance(row, tuple):
            mask[b, row[0]:row[1]] = 1
        else:
            mask[b, row] = 1
    return mask


MASKS = [
    pytest.param(20, [(0, 20), (7, 20), (19, 20), (3, 20)], id="left-padding-incl-length-1"),
    pytest.param(20, [(0, 20), (0, 13), (0, 1), (0, 2)], id="right-padding-incl-length-1"),
    pytest.param(20, [(5, 20), (0, 11), [0, 1, 2, 9, 10, 15]], id="mixed-and-holes"),
]


def _rows_alone(layer, x, mask, states=None):
    """Each row's tokens (mask != 0, in order) through the layer alone."""
    outs = []
    for b in range(x.shape[0]):
        idx = mask[b].nonzero().flatten()
        state = None if states is None else tuple(None if s is None else s[b:b + 1] for s in states)
        outs.append((idx,) + layer(x[b:b + 1, idx], state))
    return outs


@needs_varlen
@pytest.mark.parametrize("T,rows", MASKS)
@pytest.mark.parametrize("with_state", [False, True], ids=["fresh", "continuing"])
@pytest.mark.parametrize("decode", [False, True], ids=["chunk", "fused_recurrent"])
def test_masked_rows_equal_each_row_alone(T, rows, with_state, decode):
    """Outputs (zeros at padding), states and grads of a padded batch equal those
    of each row's tokens run alone (unpadded, through chunk_kda)."""
    layer = _layer(seed=12)
    mask = _mask(T, rows)
    x = _x(len(rows), T, seed=13).requires_grad_()
    states = None
    if with_state:
        with torch.no_grad():
            _, states = layer(_x(len(rows), 6, seed=14))  # an earlier, unpadded part of every row
    y, new_states = layer(x, states, decode, attention_mask=mask)
    alone = _rows_alone(layer, x, mask, states)

    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(15), dtype=torch.float64)
    loss_alone = 0
    for b, (idx, y_b, state_b) in enumerate(alone):
        torch.testing.assert_close(y[b, idx], y_b[0], rtol=1e-10, atol=1e-10)
        pad = mask[b] == 0
        assert torch.equal(y[b, pad], torch.zeros_like(y[b, pad]))  # fla repads with zeros
        for got, want in zip(new_states, state_b):
            torch.testing.assert_close(got[b:b + 1], want, rtol=1e-10, atol=1e-10)
        loss_alone = loss_alone + (y_b[0] * dy[b, idx]).sum()

    params = dict(layer.named_parameters())
    grads = torch.autograd.grad((y * dy).sum(), [x, *params.values()])
    grads_alone = torch.autograd.grad(loss_alone, [x, *params.values()])
    for name, got, want in zip(["x", *params], grads, grads_alone):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10, msg=lambda m, name=name: f"{name}: {m}")


@needs_varlen
@pytest.mark.parametrize("decode", [False, True], ids=["chunk", "fused_recurrent"])
def test_masked_empty_row_keeps_its_state_and_outputs_zeros(decode):
    """A row of padding only (an empty sequence) passes its state through; the
    other rows still equal themselves run alone."""
    layer = _layer(seed=16)
    mask = _mask(9, [(0, 9), (9, 9), (4, 9)])
    x = _x(3, 9, seed=18)
    with torch.no_grad():
        _, states = layer(_x(3, 5, seed=17))
        y, new_states = layer(x, states, decode, attention_mask=mask)
        alone = _rows_alone(layer, x, mask, states)
    assert torch.equal(y[1], torch.zeros_like(y[1]))
    for got, before in zip(new_states, states):
        torch.testing.assert_close(got[1], before[1], rtol=0, atol=0)
    for b in (0, 2):
        idx, y_b, state_b = alone[b]
        torch.testing.assert_close(y[b, idx], y_b[0], rtol=1e-10, atol=1e-10)
        for got, want in zip(new_states, state_b):
            torch.testing.assert_close(got[b:b + 1], want, rtol=1e-10, atol=1e-10)


@needs_varlen
def test_mask_longer_than_the_input_reads_its_last_columns():
    """fla's decoding convention: the mask covers the whole sequence so far."""
    layer = _layer(seed=19)
    mask = _mask(12, [(0, 12), (5, 12)])
    x = _x(2, 4, seed=20)
    with torch.no_grad():
        want, _ = layer(x, attention_mask=mask[:, -4:])
        got, _ = layer(x, attention_mask=mask)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@needs_varlen
def test_masked_path_compiles_fullgraph_and_matches_eager():
    """torch.compile(fullgraph=True) traces the unpad / varlen / repad path (no
    data-dependent control or shapes); outputs, states and grads equal eager's;
    a second mask of the same shape reuses the graph."""
    torch._dynamo.reset()
    counters.clear()
    layer = _layer(seed=21)
    compiled = torch.compile(layer, fullgraph=True)
    for rows, seed in (([(0, 16), (9, 16), (15, 16)], 22), ([(2, 16), (0, 16), (11, 16)], 23)):
        mask = _mask(16, rows)
        x = _x(3, 16, seed=seed).requires_grad_()
        y_e, s_e = layer(x, attention_mask=mask)
        y_c, s_c = compiled(x, attention_mask=mask)
        torch.testing.assert_close(y_c, y_e, rtol=1e-10, atol=1e-10)
        for got, want in zip(s_c, s_e):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        params = list(layer.parameters())
        g_e = torch.autograd.grad(y_e.square().sum(), [x, *params])
        g_c = torch.autograd.grad(y_c.square().sum(), [x, *params])
        for got, want in zip(g_c, g_e):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


# -- fla's own layer, on a GPU ---------------------------------------------------


def _fla_kda_module():
    """fla.layers.kda alone: ``import fla.layers`` imports every fla layer, and
    some need transformers (absent on the GPU machine). A bare ``fla.layers``
    package object pointing at fla's layers folder lets kda.py (which needs only
    fla.layers.utils, fla.modules and fla.ops) import by itself."""
    fla = pytest.importorskip("fla", reason="flash-linear-attention is not installed")
    pytest.importorskip("einops", reason="fla's layer needs einops")
    if "fla.layers.kda" in sys.modules:
        return sys.modules["fla.layers.kda"]
    if "fla.layers" not in sys.modules:
        folders = [os.path.join(d, "layers") for d in fla.__path__
                   if os.path.isfile(os.path.join(d, "layers", "kda.py"))]
        assert folders, f"no layers/kda.py under {list(fla.__path__)}"
        package = types.ModuleType("fla.layers")
        package.__path__ = folders[:1]
        sys.modules["fla.layers"] = package
    return importlib.import_module("fla.layers.kda")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()


@pytest.mark.gpu
def test_matches_fla_layer_bf16_left_padded_gva_safe_gate():
    """fla 0.6's KimiDeltaAttention and ours with its state_dict, bf16 on CUDA,
    a left-padded attention_mask (a full row, a shorter one, a 1-token one), GVA
    (num_v_heads = 2 * num_heads), safe_gate=True with lower_bound=-5: outputs and
    every parameter's grad (and the input's) within 2e-2 relative (l2 norm)."""
    fla_kda = _fla_kda_module()
    config = dict(hidden_size=256, expand_v=1, head_dim=64, num_heads=2, num_v_heads=4, mode="chunk",
                  use_short_conv=True, safe_gate=True, lower_bound=-5.0, conv_size=4, layer_idx=0)
    torch.manual_seed(0)
    ref = fla_kda.KimiDeltaAttention(**config).to("cuda", torch.bfloat16)
    ours = KimiDeltaAttention(**config).to("cuda", torch.bfloat16)
    ours.load_state_dict(ref.state_dict())
    B, T = 3, 150
    lengths = torch.tensor([T, 97, 1], device="cuda")
    mask = (torch.arange(T, device="cuda")[None, :] >= T - lengths[:, None]).to(torch.long)
    x = torch.randn(B, T, config["hidden_size"], device="cuda", dtype=torch.bfloat16)
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()

    y_ref, _, _ = ref(x_ref, attention_mask=mask)  # fla returns (o, attentions, past_key_values)
    y, _ = ours(x_ours, attention_mask=mask)
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype == torch.bfloat16
    assert _rel(y, y_ref) < 2e-2, _rel(y, y_ref)
    assert torch.equal(y[mask == 0], torch.zeros_like(y[mask == 0]))

    dy = torch.randn_like(y)
    y_ref.backward(dy)
    y.backward(dy)
    ours_params = dict(ours.named_parameters())
    errors = {"x": _rel(x_ours.grad, x_ref.grad)}
    for name, p_ref in ref.named_parameters():
        assert p_ref.grad is not None and ours_params[name].grad is not None, name
        errors[name] = _rel(ours_params[name].grad, p_ref.grad)
    assert max(errors.values()) < 2e-2, errors


@pytest.mark.parametrize("allow_neg_eigval", [False, True])
def test_export_graph_has_no_prep_op_and_matches_eager(allow_neg_eigval):
    """Under torch.export the layer forms the l2 norm and beta sigmoid itself
    (kda_op::kda_prep_fwd cannot go into an AOTInductor package): the graph has
    the attention op but not the prep op, and gives the eager outputs and state."""
    layer = _layer(seed=24, allow_neg_eigval=allow_neg_eigval).eval()
    x = _x(2, 70, seed=25)
    seq = torch.export.Dim("seq", min=2, max=4096)
    program = torch.export.export(layer, (x,), dynamic_shapes=({1: seq},))
    targets = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert "kda_op.chunk_kda_fwd.default" in targets, sorted(targets)
    assert not any("kda_prep" in t for t in targets), sorted(targets)
    x2 = _x(2, 37, seed=26)
    with torch.no_grad():
        got, got_state = program.module()(x2)
        want, want_state = layer(x2)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_state[0], want_state[0], rtol=1e-12, atol=1e-12)
