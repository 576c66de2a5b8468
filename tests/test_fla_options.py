"""fla 0.6's call surface: the in-kernel options (q/k l2 norm, gate, beta sigmoid,
state_v_first), fla's keywords and their rules.

Oracle: tests/naive.py's loop with the options written out here in plain
PyTorch and differentiated by autograd (independent of kda_op.reference's
option functions), in fp64."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from naive import naive_kda
from kda_op import CHUNK_SIZE, chunk_kda, fused_recurrent_kda

# (l2norm, gate, beta sigmoid scale): gate is None, "softplus", ("lb", bound) or
# ("lb-noA", bound); sigmoid scale 0 (off), 1 or 2 (allow_neg_eigval)
OPTIONS = [
    (True, "softplus", 1.0),          # fla's layer without safe_gate
    (True, ("lb", -5.0), 2.0),        # safe_gate style, negative eigenvalues
    (False, ("lb-noA", -3.0), 0.0),   # lower_bound without A_log
    (True, None, 0.0),
    (False, None, 1.0),
    (False, "softplus", 0.0),
]


def _raw_inputs(B, T, H, G, K, V, seed, dtype=torch.float64, with_bias=True, with_h0=True):
    """Raw (pre-option) inputs: q, k unnormalised, g and beta as logits, A_log, dt_bias."""
    gen = torch.Generator().manual_seed(seed)
    HV = H * G

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype)

    return dict(
        q=randn(B, T, H, K, scale=2.0), k=randn(B, T, H, K, scale=2.0), v=randn(B, T, HV, V),
        g=randn(B, T, HV, K), beta=randn(B, T, HV),
        A_log=randn(HV, scale=0.5), dt_bias=randn(HV * K, scale=0.5) if with_bias else None,
        initial_state=randn(B, HV, K, V).float() if with_h0 and dtype != torch.float64
        else (randn(B, HV, K, V) if with_h0 else None),
    )


def _naive_with_options(x, l2norm, gate, beta_scale, state_v_first=False):
    """The options in plain PyTorch, then the naive loop."""
    q, k, g, beta = x["q"], x["k"], x["g"], x["beta"]
    HV, K = g.shape[2:]
    if l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    if gate is not None:
        z = g + (0 if x["dt_bias"] is None else x["dt_bias"].view(HV, K))
        if gate == "softplus":
            g = -torch.exp(x["A_log"]).view(HV, 1) * F.softplus(z)
        elif gate[0] == "lb":
            g = gate[1] * torch.sigmoid(torch.exp(x["A_log"]).view(HV, 1) * z)
        else:
            g = gate[1] * torch.sigmoid(z)
    if beta_scale:
        beta = beta_scale * torch.sigmoid(beta)
    h0 = x["initial_state"]
    if h0 is not None and state_v_first:
        h0 = h0.transpose(-1, -2)
    o, ht = naive_kda(q, k, x["v"], g, beta, None, h0)
    return o, (ht.transpose(-1, -2) if state_v_first else ht)


def _option_kwargs(x, l2norm, gate, beta_scale):
    kw = dict(use_qk_l2norm_in_kernel=l2norm, use_beta_sigmoid_in_kernel=beta_scale > 0,
              allow_neg_eigval=beta_scale == 2.0)
    if gate is not None:
        kw.update(use_gate_in_kernel=True, dt_bias=x["dt_bias"])
        if gate == "softplus":
            kw.update(A_log=x["A_log"])
        else:
            kw.update(lower_bound=gate[1], A_log=x["A_log"] if gate[0] == "lb" else None)
    return kw


def _grad_names(x, gate):
    names = ["q", "k", "v", "g", "beta", "initial_state"]
    if gate is not None:
        if x["dt_bias"] is not None:
            names.append("dt_bias")
        if gate == "softplus" or gate[0] == "lb":
            names.append("A_log")
    return names


def _as_log_decay(x, gate):
    """Without the in-kernel gate g is the log decay itself: make it one (<= 0)."""
    return x if gate is not None else dict(x, g=F.logsigmoid(x["g"]))


def _compare(fn, x, l2norm, gate, beta_scale, state_v_first=False, tol=1e-10):
    x = _as_log_decay(x, gate)
    names = _grad_names(x, gate)
    leaves = {n: x[n].detach().clone().requires_grad_() for n in x if x[n] is not None}
    if state_v_first:
        leaves["initial_state"] = leaves["initial_state"].detach().transpose(-1, -2).contiguous().requires_grad_()
    xs = dict(x, **leaves)
    o, ht = fn(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], initial_state=xs["initial_state"],
               output_final_state=True, state_v_first=state_v_first, **_option_kwargs(xs, l2norm, gate, beta_scale))
    gen = torch.Generator().manual_seed(1)
    do, dht = torch.randn(o.shape, generator=gen, dtype=o.dtype), torch.randn(ht.shape, generator=gen,
                                                                            dtype=ht.dtype)
    grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), [leaves[n] for n in names])

    ref_leaves = {n: x[n].detach().clone().requires_grad_() for n in x if x[n] is not None}
    if state_v_first:
        ref_leaves["initial_state"] = leaves["initial_state"].detach().clone().requires_grad_()
    o_ref, ht_ref = _naive_with_options(dict(x, **ref_leaves), l2norm, gate, beta_scale, state_v_first)
    grads_ref = torch.autograd.grad((o_ref * do).sum() + (ht_ref * dht).sum(), [ref_leaves[n] for n in names])
    assert ht.shape == ht_ref.shape and ht.is_contiguous()
    torch.testing.assert_close(o, o_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(ht, ht_ref, rtol=tol, atol=tol)
    for name, got, want in zip(names, grads, grads_ref):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("l2norm,gate,beta_scale", OPTIONS)
def test_chunk_kda_options_match_naive(l2norm, gate, beta_scale):
    x = _raw_inputs(B=2, T=CHUNK_SIZE + 6, H=2, G=2, K=8, V=6, seed=3)
    _compare(chunk_kda, x, l2norm, gate, beta_scale)


@pytest.mark.parametrize("l2norm,gate,beta_scale", OPTIONS[:3])
def test_fused_recurrent_kda_options_match_naive(l2norm, gate, beta_scale):
    x = _raw_inputs(B=2, T=9, H=1, G=2, K=8, V=6, seed=4)
    _compare(fused_recurrent_kda, x, l2norm, gate, beta_scale)


@pytest.mark.parametrize("fn", [chunk_kda, fused_recurrent_kda])
def test_state_v_first(fn):
    x = _raw_inputs(B=1, T=20, H=1, G=2, K=8, V=4, seed=5)
    _compare(fn, x, True, "softplus", 1.0, state_v_first=True)


def test_gate_without_dt_bias():
    x = _raw_inputs(B=1, T=CHUNK_SIZE + 1, H=1, G=1, K=4, V=4, seed=6, with_bias=False)
    _compare(chunk_kda, x, False, "softplus", 0.0)


def test_gradcheck_through_the_options():
    """fp64 gradcheck of chunk_kda with every option on, A_log and dt_bias included."""
    x = _raw_inputs(B=1, T=5, H=1, G=2, K=3, V=2, seed=7)
    names = ["q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state"]
    leaves = [x[n].detach().clone().requires_grad_() for n in names]

    def f(q, k, v, g, beta, A_log, dt_bias, h0):
        return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                         use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                         A_log=A_log, dt_bias=dt_bias, lower_bound=-4.0, safe_gate=True)

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-7)


def test_chunk_size_and_disable_recompute_change_nothing():
    """chunk_size (fla's **kwargs) is accepted at 32 and 64 and disable_recompute
    at both values: kda-op's kernels cut 64-token chunks whatever fla's would."""
    x = _raw_inputs(B=1, T=40, H=1, G=1, K=4, V=4, seed=8)
    base = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                     output_final_state=True, use_qk_l2norm_in_kernel=True)
    for kw in (dict(chunk_size=32), dict(chunk_size=64), dict(disable_recompute=True)):
        got = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                        output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)
        for a, b in zip(got, base):
            assert torch.equal(a, b), kw


def test_positional_order_is_fla():
    """The first eight positional arguments are fla's: chunk_kda's (..., scale,
    initial_state, output_final_state), fused_recurrent_kda's (..., A_log,
    dt_bias, scale)."""
    x = _raw_inputs(B=1, T=6, H=1, G=1, K=4, V=4, seed=9)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    o1, h1 = chunk_kda(*args, 0.3, x["initial_state"], True)
    o2, h2 = chunk_kda(*args, scale=0.3, initial_state=x["initial_state"], output_final_state=True)
    assert torch.equal(o1, o2) and torch.equal(h1, h2)
    o3, h3 = fused_recurrent_kda(*args, x["A_log"], x["dt_bias"], 0.3, x["initial_state"], True,
                                 use_gate_in_kernel=True)
    o4, h4 = fused_recurrent_kda(*args, scale=0.3, initial_state=x["initial_state"], output_final_state=True,
                                 use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"])
    assert torch.equal(o3, o4) and torch.equal(h3, h4)


def test_transpose_state_layout_is_fla_deprecated_alias():
    x = _raw_inputs(B=1, T=6, H=1, G=1, K=4, V=3, seed=10)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    h0 = x["initial_state"].transpose(-1, -2).contiguous()
    want = chunk_kda(*args, initial_state=h0, output_final_state=True, state_v_first=True)
    with pytest.warns(DeprecationWarning, match="state_v_first"):
        got = chunk_kda(*args, initial_state=h0, output_final_state=True, transpose_state_layout=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="transpose_state_layout"):
        chunk_kda(*args, state_v_first=True, transpose_state_layout=True)


# -- errors -----------------------------------------------------------------

def _args(seed=11):
    x = _raw_inputs(B=1, T=6, H=2, G=2, K=4, V=3, seed=seed)
    return (x["q"], x["k"], x["v"], x["g"], x["beta"]), x


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(use_gate_in_kernel=True), ValueError, "needs A_log"),
    (dict(A_log=torch.zeros(4, dtype=torch.float64)), ValueError, "use_gate_in_kernel is False"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(3, dtype=torch.float64)), ValueError, r"A_log must be \[HV\]"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(4, dtype=torch.int64)), TypeError, "A_log must have a floating"),
    (dict(use_gate_in_kernel=True, A_log=[0.0] * 4), TypeError, "A_log must be a torch.Tensor"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(4, dtype=torch.float64),
          dt_bias=torch.zeros(4 * 4 + 1, dtype=torch.float64)), ValueError, r"dt_bias must be \[HV \* K\]"),
    (dict(use_gate_in_kernel=True, safe_gate=True, A_log=torch.zeros(4, dtype=torch.float64)), ValueError,
     "needs lower_bound"),
    (dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-6.0), ValueError, r"\[-5, 0\)"),
    (dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=0.0), ValueError, r"\[-5, 0\)"),
    (dict(use_gate_in_kernel=True, lower_bound=float("nan")), ValueError, "lower_bound must be finite"),
    (dict(use_gate_in_kernel=True, lower_bound="-5"), TypeError, "lower_bound must be a float"),
    (dict(allow_neg_eigval=True), ValueError, "requires use_beta_sigmoid_in_kernel"),
    (dict(chunk_size=16), ValueError, "chunk_size must be 32 or 64"),
    (dict(chunk_size=64.0), ValueError, "chunk_size must be 32 or 64"),
    (dict(use_qk_l2norm_in_kernel=1), TypeError, "use_qk_l2norm_in_kernel must be a bool"),
    (dict(state_v_first="yes"), TypeError, "state_v_first must be a bool"),
    (dict(disable_recompute=True, recompute_in_backward=True), ValueError, "contradicts"),
    (dict(initial_state=torch.zeros(1, 4, 4, 3, dtype=torch.float64), state_v_first=True), ValueError,
     r"\[B, HV, V, K\] \(state_v_first\) = \(1, 4, 3, 4\), got shape \(1, 4, 4, 3\)"),
    (dict(use_qk_l2norm_in_kernels=True), TypeError, "unexpected keyword argument 'use_qk_l2norm_in_kernels'"),
    (dict(cp_context=object()), NotImplementedError, "context parallelism"),
    (dict(use_graph=True), NotImplementedError, "use_graph"),
    (dict(return_intermediate_states=True), NotImplementedError, "return_intermediate_states"),
    (dict(cu_seqlens=torch.tensor([0, 2, 6], dtype=torch.int16)), ValueError, "1-D int64"),
    (dict(cu_seqlens=[0, 6]), TypeError, "cu_seqlens must be a 1-D integer torch.Tensor"),
    (dict(cu_seqlens=torch.tensor([[0, 6]])), ValueError, "1-D int64"),
    (dict(cu_seqlens=torch.tensor([1, 6])), ValueError, "start at 0"),
    (dict(cu_seqlens=torch.tensor([0, 4, 3, 6])), ValueError, "never decrease"),
    (dict(cu_seqlens=torch.tensor([0, 5])), ValueError, "end at T = 6"),
    (dict(cu_seqlens=torch.tensor([0, 2, 6]), initial_state=torch.zeros(3, 4, 4, 3, dtype=torch.float64)),
     ValueError, "one state per sequence of cu_seqlens: N = 2, got 3"),
    (dict(cu_seqlens=torch.tensor([0, 2, 6]), cu_seqlens_cpu=torch.tensor([0, 3, 6])), ValueError,
     "same offsets as cu_seqlens"),
    (dict(cu_seqlens=torch.tensor([0, 2, 6]), cu_seqlens_cpu=torch.tensor([0, 6])), ValueError,
     "cu_seqlens_cpu must be cu_seqlens"),
    (dict(cu_seqlens_cpu=torch.tensor([0, 6])), ValueError, "without cu_seqlens"),
    (dict(ssm_state_indices=torch.tensor([0])), ValueError, "needs the state pool"),  # tests/test_pool.py
])
def test_chunk_kda_refuses(kwargs, error, match):
    args, _ = _args()
    with pytest.raises(error, match=match):
        chunk_kda(*args, **kwargs)


def test_fused_recurrent_kda_refuses():
    args, x = _args()
    with pytest.raises(ValueError, match="need ssm_state_indices"):  # tests/test_pool.py: the pool itself
        fused_recurrent_kda(*args, inplace_final_state=True)
    with pytest.raises(ValueError, match="B must be 1"):
        fused_recurrent_kda(*(torch.cat([a, a]) for a in args), cu_seqlens=torch.tensor([0, 6]))
    with pytest.raises(TypeError, match="unexpected keyword argument 'chunk_size'"):
        fused_recurrent_kda(*args, chunk_size=64)
    with pytest.raises(ValueError, match="needs A_log"):
        fused_recurrent_kda(*args, use_gate_in_kernel=True)
    # The later work's keywords at their defaults are accepted, as fla's callers pass them.
    o, _ = fused_recurrent_kda(*args, ssm_state_indices=None, inplace_final_state=False)
    assert o.shape == x["v"].shape


def test_no_input_is_modified():
    args, x = _args(seed=12)
    before = {n: t.clone() for n, t in x.items() if t is not None}
    chunk_kda(*args, initial_state=x["initial_state"], use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              A_log=x["A_log"], dt_bias=x["dt_bias"], use_beta_sigmoid_in_kernel=True)
    for n, t in before.items():
        assert torch.equal(x[n], t), n


# -- the Triton kernels with the options (interpreter on CPU, CUDA on a GPU) --

def _triton_or_skip():
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not set")
    return device


# fp32; on a GPU the dots run as 3xTF32 (about fp32) and the chunked form sums in
# another order than the token loop (as tests/test_triton_kernels.py)
FP32_TOL = dict(rtol=2e-4, atol=2e-5)


def _gate_tuple(x, gate):
    if gate == "softplus":
        return (x["A_log"], x["dt_bias"], None)
    return (x["A_log"] if gate[0] == "lb" else None, x["dt_bias"], gate[1])


@pytest.mark.parametrize("T,gate,steep_a", [
    (CHUNK_SIZE + 19, "softplus", 0.0),
    (CHUNK_SIZE + 19, ("lb", -5.0), 3.0),      # exp(A_log) ~ 20: gates near -5, steep chunks
    (2 * CHUNK_SIZE, ("lb-noA", -2.0), 0.0),
    (5, "softplus", 0.0),                     # the recurrent kernel (T <= RECURRENT_MAX_T)
    # the steep chunks through the block references (settings.STEEP_BLOCK_REFS)
    (CHUNK_SIZE + 19, ("lb", -5.0), "3.0 block refs"),
    # fla's bounded gate through the row programs (settings.INTRA_A_ROW_PROGRAMS,
    # INTRA_BWD_A_ROW_PROGRAMS: block references for every chunk)
    (CHUNK_SIZE + 19, ("lb", -5.0), "3.0 row programs"),
])
def test_triton_gate_matches_reference(T, gate, steep_a, monkeypatch):
    """gam_fwd.py (forward and the backward's recompute), recurrent_fwd.py and
    intra_bwd_a.py (both launches) with the gate, against the reference op; and the
    row programs (intra_a_fwd_rows.py, intra_bwd_a_rows.py) where the case says so."""
    device = _triton_or_skip()
    from kda_op.triton_kernels import settings

    tol = dict(FP32_TOL)
    # the steep chunks through the former path (STEEP_BLOCK_REFS = 0) unless the case says block refs
    monkeypatch.setattr(settings, "STEEP_BLOCK_REFS", int(isinstance(steep_a, str)))
    # the one-program-per-chunk kernels unless the case says row programs
    rows = int(isinstance(steep_a, str) and "row programs" in steep_a)
    monkeypatch.setattr(settings, "INTRA_A_ROW_PROGRAMS", rows)
    monkeypatch.setattr(settings, "INTRA_BWD_A_ROW_PROGRAMS", rows)
    if isinstance(steep_a, str):
        steep_a = float(steep_a.split()[0])
        # Reduction order: the block references sum each entry's terms in another
        # order, off by 2.5e-5 at most on grads of up to 44 (the default path: 2.8e-5
        # and 3.4e-5 on dg and dk), which one entry of dg near 1e-3 exceeds
        # elementwise: errors bounded relative to each grad's scale instead.
        tol = dict(rtol=FP32_TOL["rtol"], atol=None)
    from kda_op.ops import _reference_bwd, _reference_fwd
    from kda_op.triton_kernels import kda_bwd_triton, kda_fwd_triton

    x = _raw_inputs(B=1, T=T, H=2, G=2, K=24, V=20, seed=13, dtype=torch.float32)
    x["k"] = F.normalize(x["k"], dim=-1)
    x["beta"] = torch.sigmoid(x["beta"])
    if steep_a:  # value heads 0, 1: gates near lower_bound (steep chunks); 2, 3: near 0
        x["A_log"][:2] += steep_a
        x["g"][:, :, 2:] -= 8.0
    x = {n: (t.to(device) if t is not None else None) for n, t in x.items()}
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    h0, gate_t = x["initial_state"], _gate_tuple(x, gate)
    cpu = {n: (t.cpu() if t is not None else None) for n, t in x.items()}
    cpu_args, cpu_gate = [cpu[n] for n in ("q", "k", "v", "g", "beta")], _gate_tuple(cpu, gate)

    o, ht, cs, _ = kda_fwd_triton(*args, None, h0, gate=gate_t)
    o_ref, ht_ref, cs_ref, _ = _reference_fwd(*cpu_args, None, cpu["initial_state"], cpu_gate)
    torch.testing.assert_close(o.cpu(), o_ref, **FP32_TOL)
    torch.testing.assert_close(ht.cpu(), ht_ref, **FP32_TOL)
    if T <= 16:
        return  # the recurrent kernel has no backward of its own
    gen = torch.Generator().manual_seed(2)
    do, dht = torch.randn(o.shape, generator=gen), torch.randn(ht.shape, generator=gen)
    want = _reference_bwd(*cpu_args, None, cpu["initial_state"], cs_ref, do, dht, cpu_gate)
    _, _, cs_kept, kept = kda_fwd_triton(*args, None, h0, keep_intermediates=True, gate=gate_t)
    for intermediates in (None, kept):
        got = kda_bwd_triton(*args, None, h0, cs_kept, do.to(device), dht.to(device), intermediates, gate=gate_t)
        names = ("dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias")
        for name, a, b in zip(names, got, want):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            # dA_log and ddt_bias sum dg over every token: relative to their size
            atol = tol["atol"] if tol["atol"] is not None else max(FP32_TOL["atol"], 2e-6 * b.abs().max().item())
            torch.testing.assert_close(a.cpu(), b, rtol=tol["rtol"], atol=atol, msg=lambda m: f"{name}: {m}")
    if steep_a:
        from kda_op.triton_kernels.fwd import _intra_fwd
        from kda_op.triton_kernels._host import _sizes

        flags = _intra_fwd(*args, 24 ** -0.5, _sizes(args[0], args[2]), store_tm=False, gate=gate_t)["steep"]
        assert flags.any() and not flags.all()  # both launches of intra_bwd_a ran


@pytest.mark.parametrize("on_chip", [0, 1])
@pytest.mark.parametrize("packed", [False, True])
def test_triton_row_programs_hand_kb_to_wu(packed, on_chip, monkeypatch):
    """settings.INTRA_A_ROWS_KBG: with fla's bounded gate (every chunk by row programs,
    intra_a_fwd_rows.py) in a forward that keeps nothing on bf16 inputs, the row programs
    store Kb for intra_wu_fwd's W (KBG and KBG_IN at the launches). The output differs from
    the one without it (Kb rounded to bf16 before W's dot, as with gam on chip; W's dot on
    fp32 operands, settings.WU_BF16_DOTS = 0), and its errors against the reference, o's and
    the final state's, stay within a quarter more than those without. A
    kept forward (the backward reads W) and fp32 inputs do not take it; a value other than
    0 or 1 is refused. Packed: an empty and a one-token sequence among them.
    ``on_chip`` (settings.INTRA_A_ROWS_GAM_ON_CHIP): the row programs form gam from the raw
    gate themselves, gam_fwd does not run; the same steep flags and chunks' last rows of gam
    as gam_fwd's (the same cumsum: fp32 rounding of another scan order on a GPU)."""
    device = _triton_or_skip()
    from kda_op.ops import _reference_fwd
    from kda_op.triton_kernels import fwd, kda_fwd_triton, settings

    monkeypatch.setattr(settings, "INTRA_A_ROW_PROGRAMS", 1)
    monkeypatch.setattr(settings, "INTRA_A_BLOCK_REFS", 1)
    lengths = [20, 130, 0, 1, 64] if packed else None
    B, T = (1, sum(lengths)) if packed else (2, 2 * CHUNK_SIZE + 19)
    x = _raw_inputs(B=B, T=T, H=2, G=2, K=32, V=32, seed=15, dtype=torch.float32, with_h0=not packed)
    x["k"] = F.normalize(x["k"], dim=-1)
    x["beta"] = torch.sigmoid(x["beta"])
    # weak decays (log decays near -0.01, lower_bound * sigmoid of about -6), so that each
    # chunk's state, and with it W, reaches the later chunks' outputs
    x["g"] = x["g"] - 6.0
    cu = torch.tensor([0] + lengths).cumsum(0) if packed else None
    bf16 = {n: (x[n].to(torch.bfloat16) if n in ("q", "k", "v", "beta") else x[n]) for n in x}
    args = [bf16[n].to(device) for n in ("q", "k", "v", "g", "beta")]
    h0 = None if packed else x["initial_state"].to(device)
    gate = (x["A_log"].to(device), x["dt_bias"].to(device), -5.0)
    cu_d = cu.to(device) if packed else None
    from test_triton_kernels import _on_launch

    flags = []  # (kernel, its flag) at each launch
    for name, key in (("kda_intra_a_fwd_rows_kernel", "KBG"), ("kda_intra_wu_fwd_kernel", "KBG_IN"),
                      ("kda_gam_fwd_kernel", "GATE")):
        _on_launch(monkeypatch, fwd, name, lambda kw, name=name, key=key: flags.append((name, kw[key])))
    monkeypatch.setattr(settings, "INTRA_A_ROWS_GAM_ON_CHIP", on_chip)
    results = []
    for on in (0, 1):
        monkeypatch.setattr(settings, "INTRA_A_ROWS_KBG", on)
        flags.clear()
        o, ht, _, _ = kda_fwd_triton(*args, None, h0, gate=gate, cu_seqlens=cu_d, keep_chunk_states=False)
        assert flags and all(bool(flag) == bool(on) for name, flag in flags if name != "kda_gam_fwd_kernel"), flags
        kernels = {"kda_intra_a_fwd_rows_kernel", "kda_intra_wu_fwd_kernel"}
        assert {name for name, _ in flags} == (kernels if on and on_chip else kernels | {"kda_gam_fwd_kernel"})
        results.append((o, ht))
    if on_chip:  # the steep flags and the scans' rows of gam, against gam_fwd's
        from kda_op.triton_kernels._host import _sizes

        intra = []
        for rows_on_chip in (0, 1):
            monkeypatch.setattr(settings, "INTRA_A_ROWS_GAM_ON_CHIP", rows_on_chip)
            s = _sizes(args[0], args[2], cu_seqlens=cu_d, has_initial_state=h0 is not None)
            intra.append(fwd._intra_fwd(*args, 32 ** -0.5, s, store_tm=False, gate=gate))
        assert torch.equal(intra[0]["steep"], intra[1]["steep"])
        last = _last_rows_of_gam(intra[0]["gam"], lengths if packed else [T] * B)
        got = _last_rows_of_gam(intra[1]["gam"], lengths if packed else [T] * B)
        torch.testing.assert_close(got, last, rtol=1e-6, atol=1e-5)  # cumsums of up to 64 terms near -0.01
    # Kb stored in bf16 (2^-9 relative) where intra_wu_fwd formed it in fp32 (WU_BF16_DOTS = 0),
    # the tolerance of the same rounding with gam on chip (test_triton_kernels.py)
    assert not torch.equal(results[1][0], results[0][0]) or settings.WU_BF16_DOTS  # Kb did go through bf16
    # bf16 operands (2^-9 relative each) against the fp32 reference on the same inputs
    want = _reference_fwd(*(bf16[n].float() for n in ("q", "k", "v", "g", "beta")), None,
                          None if packed else x["initial_state"], (x["A_log"], x["dt_bias"], -5.0), cu)[:2]
    errors = [[((got.cpu().float() - ref).norm() / ref.norm()).item() for got, ref in zip(r, want)] for r in results]
    for without, with_kb in zip(*errors):
        assert with_kb <= 1e-2 and without <= 1e-2
        # Kb's rounding adds at most a quarter of the error already there
        assert with_kb <= 1.25 * without, errors
    # a kept forward, and fp32 inputs: W from K and gam
    for kept, inputs in ((True, args), (False, [t.float() for t in args])):
        flags.clear()
        kda_fwd_triton(*inputs, None, h0, keep_intermediates=kept, gate=gate, cu_seqlens=cu_d)
        assert ("kda_gam_fwd_kernel", 2) in flags, (kept, flags)  # gam through memory
        assert not any(flag for name, flag in flags if name != "kda_gam_fwd_kernel"), (kept, flags)
    monkeypatch.setattr(settings, "INTRA_A_ROWS_KBG", 2)
    with pytest.raises(ValueError, match="INTRA_A_ROWS_KBG"):
        kda_fwd_triton(*args, None, h0, gate=gate, cu_seqlens=cu_d)


def _last_rows_of_gam(gam, lengths):
    """Each chunk's last row of gam [B, T, HV, K] (packed: B = 1, sequences of ``lengths``),
    the rows the scans read: a chunk's row BT - 1, or its sequence's last row."""
    rows = []
    for n, (bos, length) in enumerate(zip(torch.tensor([0] + lengths).cumsum(0).tolist(), lengths)):
        b, start = (0, bos) if gam.shape[0] == 1 else (n, 0)
        for c in range(0, length, CHUNK_SIZE):
            rows.append(gam[b, start + min(c + CHUNK_SIZE, length) - 1].cpu())
    return torch.stack(rows)


@pytest.mark.parametrize("l2norm,beta_scale,G", [(True, 1.0, 3), (True, 0.0, 1), (False, 2.0, 2), (True, 2.0, 4)])
def test_triton_prep_matches_reference(l2norm, beta_scale, G):
    device = _triton_or_skip()
    from kda_op.ops import _reference_prep_bwd, _reference_prep_fwd
    from kda_op.triton_kernels.bwd import kda_prep_bwd_triton
    from kda_op.triton_kernels.fwd import kda_prep_fwd_triton

    x = _raw_inputs(B=2, T=21, H=3, G=G, K=24, V=4, seed=14, dtype=torch.float32)
    q, k, beta = (x[n].to(device) for n in ("q", "k", "beta"))
    got = kda_prep_fwd_triton(q, k, beta, l2norm, beta_scale)
    want = _reference_prep_fwd(x["q"], x["k"], x["beta"], l2norm, beta_scale)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a.cpu(), b, rtol=1e-6, atol=1e-6)
    gen = torch.Generator().manual_seed(3)
    dq, dk, dbeta = (torch.randn(t.shape, generator=gen) for t in (q, k, beta))
    # a grad of a sum: stride 0 (the kernels must not assume a dense layout)
    dbeta = torch.ones(1).expand(beta.shape)
    got = kda_prep_bwd_triton(*got[:2], *got[3:], beta, dq.to(device), dk.to(device), dbeta.to(device), l2norm,
                              beta_scale)
    want = _reference_prep_bwd(*want[:2], *want[3:], x["beta"], dq, dk, dbeta, l2norm, beta_scale)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-6)


def test_triton_recurrent_gate_matches_reference():
    device = _triton_or_skip()
    from kda_op.ops import _reference_fwd
    from kda_op.triton_kernels import kda_recurrent_fwd_triton

    x = _raw_inputs(B=2, T=3, H=1, G=2, K=20, V=12, seed=15, dtype=torch.float32)
    x["k"] = F.normalize(x["k"], dim=-1)
    args = [x[n].to(device) for n in ("q", "k", "v", "g", "beta")]
    for gate in ("softplus", ("lb", -5.0), ("lb-noA", -1.0)):
        gate_d = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in _gate_tuple(x, gate))
        o, ht = kda_recurrent_fwd_triton(*args, None, x["initial_state"].to(device), gate=gate_d)
        o_ref, ht_ref, _, _ = _reference_fwd(*[x[n] for n in ("q", "k", "v", "g", "beta")], None,
                                             x["initial_state"], _gate_tuple(x, gate))
        torch.testing.assert_close(o.cpu(), o_ref, **FP32_TOL)
        torch.testing.assert_close(ht.cpu(), ht_ref, **FP32_TOL)


# -- packed sequences (cu_seqlens) ------------------------------------------

LENGTHS = [1, 63, 0, 65, 5]  # a single token, around a chunk boundary, an empty sequence


def _packed(lengths, seed, dtype=torch.float64, **kw):
    x = _raw_inputs(B=1, T=sum(lengths), seed=seed, dtype=dtype, with_h0=False, **kw)
    gen = torch.Generator().manual_seed(seed + 100)
    HV, K, V = x["v"].shape[2], x["q"].shape[3], x["v"].shape[3]
    x["initial_state"] = torch.randn(len(lengths), HV, K, V, generator=gen, dtype=torch.float64).to(
        torch.float64 if dtype == torch.float64 else torch.float32)
    cu = torch.tensor([0] + lengths).cumsum(0)
    return x, cu


def _per_sequence(fn, x, cu, **kw):
    """Each packed sequence alone (B = 1): the oracle of the packed call."""
    outs, finals = [], []
    for n in range(cu.shape[0] - 1):
        a, b = int(cu[n]), int(cu[n + 1])
        piece = {m: (t[:, a:b] if m in ("q", "k", "v", "g", "beta") else t) for m, t in x.items()}
        o, ht = fn(piece, x["initial_state"][n:n + 1], **kw)
        outs.append(o)
        finals.append(ht)
    return torch.cat(outs, dim=1), torch.cat(finals)


@pytest.mark.parametrize("fn", [chunk_kda, fused_recurrent_kda])
@pytest.mark.parametrize("l2norm,gate,beta_scale", [OPTIONS[0], (False, None, 0.0)])
def test_varlen_matches_each_sequence_alone(fn, l2norm, gate, beta_scale):
    """fp64 on the CPU reference: outputs, final states and every grad of the packed
    call equal the naive loop run on each sequence alone."""
    x, cu = _packed(LENGTHS, seed=20, H=1, G=2, K=8, V=6)
    x = _as_log_decay(x, gate)
    names = _grad_names(x, gate)
    leaves = {n: x[n].detach().clone().requires_grad_() for n in x if x[n] is not None}
    o, ht = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
               initial_state=leaves["initial_state"], output_final_state=True, cu_seqlens=cu,
               **_option_kwargs(leaves, l2norm, gate, beta_scale))
    gen = torch.Generator().manual_seed(5)
    do, dht = torch.randn(o.shape, generator=gen, dtype=o.dtype), torch.randn(ht.shape, generator=gen,
                                                                            dtype=ht.dtype)
    grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), [leaves[n] for n in names])

    ref = {n: x[n].detach().clone().requires_grad_() for n in x if x[n] is not None}

    def naive(piece, h0):
        return _naive_with_options(dict(piece, initial_state=h0), l2norm, gate, beta_scale)

    o_ref, ht_ref = _per_sequence(naive, ref, cu)
    grads_ref = torch.autograd.grad((o_ref * do).sum() + (ht_ref * dht).sum(), [ref[n] for n in names])
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ht, ht_ref, rtol=1e-10, atol=1e-10)
    for name, got, want in zip(names, grads, grads_ref):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("with_h0", [True, False])
def test_varlen_chunk_states_layout(with_h0):
    """The op's chunk states. With initial states: sequence n's NC_n + 1 boundaries
    from slot chunk_offsets[n] + n (its initial state first, its final state last).
    Without (training): only the states entering chunks after a sequence's first, NC_n
    - 1 each, in order, T // 64 + 2 slots in all; each matches the state the
    recurrence reaches there (the same op on the sequence cut at that chunk's start).
    Zeros after the last sequence's (every byte follows from the inputs)."""
    from kda_op._contract import varlen_state_offsets, varlen_state_slots

    lengths = LENGTHS + [200, 1]  # some sequences of three and four chunks
    x, cu = _packed(lengths, seed=21, H=1, G=1, K=4, V=3)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    h0 = x["initial_state"] if with_h0 else None
    _, ht, cs, _ = torch.ops.kda_op.chunk_kda_fwd(*args, None, h0, cu_seqlens=cu)
    T, N = cu[-1].item(), len(lengths)
    assert cs.shape == (1, varlen_state_slots(T, N, with_h0), 1, 4, 3)
    assert cs.shape[1] == (T // CHUNK_SIZE + 2 * N if with_h0 else T // CHUNK_SIZE + 2)
    starts, first_unused = varlen_state_offsets(lengths, with_h0)
    checked = 0
    for n, length in enumerate(lengths):
        chunks = -(-length // CHUNK_SIZE)
        if with_h0:
            assert torch.equal(cs[0, starts[n]], h0[n])  # the state entering its first chunk
            assert torch.equal(cs[0, starts[n] + chunks], ht[n])  # its final state closes its boundaries
        a = cu[n].item()
        for c in range(1, chunks):  # the state entering chunk c: the recurrence over the rows before it
            cut = [t[:, a:a + c * CHUNK_SIZE] for t in args]
            _, ht_cut, _, _ = torch.ops.kda_op.chunk_kda_fwd(*cut, None, None if h0 is None else h0[n:n + 1])
            torch.testing.assert_close(cs[0, starts[n] + c], ht_cut[0], rtol=1e-12, atol=1e-12)
            checked += 1
    assert checked == 4  # 65 tokens: one; 200: three
    expected_unused = sum(-(-n // CHUNK_SIZE) + 1 for n in lengths) if with_h0 else \
        sum(max(-(-n // CHUNK_SIZE) - 1, 0) for n in lengths)
    assert first_unused == expected_unused
    assert first_unused < cs.shape[1] and (cs[0, first_unused:] == 0).all()


@pytest.mark.parametrize("with_h0", [False, True])
def test_triton_short_packed_sequences_scan_block(with_h0, monkeypatch):
    """Short packed sequences (settings.SHORT_SEQ_CHUNKS) take the scans' V block from
    the sequence count: with a wave of four programs the block grows to the largest, so each
    scan program walks V = 64 columns at once; forward and backward against the
    reference op (fp32), a sequence of two chunks and one of none among them."""
    device = _triton_or_skip()
    from kda_op.ops import _reference_bwd, _reference_fwd
    from kda_op.triton_kernels import kda_bwd_triton, kda_fwd_triton
    from kda_op.triton_kernels import settings as S
    from kda_op.triton_kernels._host import _sizes

    lengths = [1, 70, 0, 33, 2]
    x, cu = _packed(lengths, seed=31, dtype=torch.float32, H=1, G=1, K=32, V=64)
    x["k"] = F.normalize(x["k"], dim=-1)
    x["beta"] = torch.sigmoid(x["beta"])
    x["g"] = -torch.rand_like(x["g"])  # log decays
    cpu_args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    args = [t.to(device) for t in cpu_args]
    h0_cpu = x["initial_state"] if with_h0 else None
    h0, cu_d = (None if h0_cpu is None else h0_cpu.to(device)), cu.to(device)
    monkeypatch.setattr(S, "SCAN_SMS", 4)  # a wave of 4 programs: one sequence fits it, five do not
    blocks = {}
    for chunks in (0, 2):
        monkeypatch.setattr(S, "SHORT_SEQ_CHUNKS", chunks)
        sz = _sizes(args[0], args[2], cu_seqlens=cu_d)
        blocks[chunks] = (sz["BV_SCAN"], sz["BV_SCAN_FWD"])  # the kernels below run with the last: 2
    assert blocks[2] == (64, 64) and blocks[0][0] < 64, blocks  # from N = 5 sequences, not B = 1
    want = _reference_fwd(*cpu_args, None, h0_cpu, None, cu)
    got = kda_fwd_triton(*args, None, h0, False, cu_seqlens=cu_d)
    for name, a, b in zip(("o", "final_state", "chunk_states"), got, want):
        torch.testing.assert_close(a.cpu(), b, **FP32_TOL, msg=lambda m: f"{name}: {m}")
    # without the final state (training): not stored, the rest bitwise the same
    o, ht, cs, _ = kda_fwd_triton(*args, None, h0, False, cu_seqlens=cu_d, output_final_state=False)
    assert ht.shape == (0,) and torch.equal(o, got[0]) and torch.equal(cs, got[2])
    gen = torch.Generator().manual_seed(7)
    do, dht = torch.randn(want[0].shape, generator=gen), torch.randn(want[1].shape, generator=gen)
    grads_ref = _reference_bwd(*cpu_args, None, h0_cpu, want[2], do, dht, None, cu)
    grads = kda_bwd_triton(*args, None, h0, got[2], do.to(device), dht.to(device), None, cu_seqlens=cu_d)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads, grads_ref):
        torch.testing.assert_close(a.cpu(), b, **FP32_TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("with_h0,with_dht", [(True, True), (False, False), (True, False)])
def test_triton_varlen_matches_reference(with_h0, with_dht):
    """Every kernel with IS_VARLEN (forward, both backwards, the gate), against the
    reference op on the same packed sequences, fp32; with and without initial states
    and a grad of the final states (without: the backward scan takes each sequence's
    last chunk apart, and dh0 is empty without initial states)."""
    device = _triton_or_skip()
    from kda_op.ops import _reference_bwd, _reference_fwd
    from kda_op.triton_kernels import kda_bwd_triton, kda_fwd_triton, kda_recurrent_fwd_triton

    lengths = [1, 63, 0, 65, 130, 2]
    x, cu = _packed(lengths, seed=22, dtype=torch.float32, H=2, G=2, K=20, V=12)
    x["k"] = F.normalize(x["k"], dim=-1)
    x["beta"] = torch.sigmoid(x["beta"])
    gate = ("lb", -5.0)
    cpu_args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    args = [t.to(device) for t in cpu_args]
    h0_cpu = x["initial_state"] if with_h0 else None
    h0, cu_d = (None if h0_cpu is None else h0_cpu.to(device)), cu.to(device)
    gate_d = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in _gate_tuple(x, gate))
    want = _reference_fwd(*cpu_args, None, h0_cpu, _gate_tuple(x, gate), cu)
    for keep in (False, True):
        got = kda_fwd_triton(*args, None, h0, keep, gate=gate_d, cu_seqlens=cu_d)
        for name, a, b in zip(("o", "final_state", "chunk_states"), got, want):
            assert a.shape == b.shape, name
            torch.testing.assert_close(a.cpu(), b, **FP32_TOL, msg=lambda m: f"{name}: {m}")
    kept = got[3]
    gen = torch.Generator().manual_seed(6)
    do, dht = torch.randn(want[0].shape, generator=gen), torch.randn(want[1].shape, generator=gen)
    dht = dht if with_dht else None
    grads_ref = _reference_bwd(*cpu_args, None, h0_cpu, want[2], do, dht, _gate_tuple(x, gate), cu)
    assert (grads_ref[5].numel() > 0) == with_h0
    for intermediates in (None, kept):
        grads = kda_bwd_triton(*args, None, h0, got[2], do.to(device), None if dht is None else dht.to(device),
                               intermediates, gate=gate_d, cu_seqlens=cu_d)
        for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0", "dA_log", "ddt_bias"), grads, grads_ref):
            assert a.shape == b.shape, name
            tol = FP32_TOL
            if name in ("dA_log", "ddt_bias"):
                # sums over every token: an entry that cancels to near zero keeps the rounding
                # of terms as large as the vector's largest entry, so the relative part of the
                # tolerance is taken of that (H200, row-block backward: ddt_bias[18] = -0.017
                # off by 3.4e-5 where the largest entry is 1.78; the fp32 CPU reference is
                # within 6e-9 of fp64 there)
                tol = dict(rtol=0.0, atol=FP32_TOL["atol"] + FP32_TOL["rtol"] * b.abs().max().item())
            torch.testing.assert_close(a.cpu(), b, **tol, msg=lambda m: f"{name}: {m}")
    o, ht = kda_recurrent_fwd_triton(*args, None, h0, gate=gate_d, cu_seqlens=cu_d)
    torch.testing.assert_close(o.cpu(), want[0], **FP32_TOL)
    torch.testing.assert_close(ht.cpu(), want[1], **FP32_TOL)


def test_varlen_opcheck():
    x, cu = _packed([3, 0, 70], seed=23, dtype=torch.float32, H=1, G=2, K=4, V=3)
    x["beta"] = torch.sigmoid(x["beta"])
    x["g"] = F.logsigmoid(x["g"])  # the log decay (and a fine raw gate for the gate's check below)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["initial_state"])
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    for a in args:
        if a is not None:
            a.requires_grad_()
    torch.library.opcheck(torch.ops.kda_op.chunk_kda_fwd.default, args, dict(cu_seqlens=cu), test_utils=utils)
    gate = dict(A_log=x["A_log"], dt_bias=x["dt_bias"], use_gate=True, lower_bound=None)
    torch.library.opcheck(torch.ops.kda_op.chunk_kda_fwd.default, args, dict(cu_seqlens=cu, **gate),
                          test_utils=utils)
    torch.library.opcheck(torch.ops.kda_op.fused_recurrent_kda_fwd.default, args, dict(cu_seqlens=cu, **gate),
                          test_utils=utils)
    o, ht, cs, _ = torch.ops.kda_op.chunk_kda_fwd(*args, cu_seqlens=cu, **gate)
    bwd_args = tuple(a.detach() if a is not None else None for a in args) + (cs, torch.randn_like(o),
                                                                             torch.randn_like(ht))
    torch.library.opcheck(torch.ops.kda_op.chunk_kda_bwd.default, bwd_args,
                          dict(cu_seqlens=cu, A_log=x["A_log"], dt_bias=x["dt_bias"], use_gate=True),
                          test_utils=utils[:1] + utils[2:])


@pytest.mark.parametrize("l2norm,beta_scale", [(True, 2.0), (True, 0.0), (False, 1.0)])
def test_prep_opcheck(l2norm, beta_scale):
    x = _raw_inputs(B=2, T=5, H=2, G=2, K=4, V=3, seed=24, dtype=torch.float32)
    args = (x["q"].requires_grad_(), x["k"].requires_grad_(), x["beta"].requires_grad_(), l2norm, beta_scale)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.kda_op.kda_prep_fwd.default, args, test_utils=utils)


def test_compile_varlen_dynamic_recompiles_at_most_once():
    """torch.compile(fullgraph=True, dynamic=True) over packed batches of changing
    N and T, with the options of fla's layer: at most one recompile, eager's numbers."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()

    def step(q, k, v, g, beta, A_log, dt_bias, cu):
        o, ht = chunk_kda(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                          use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)
        return o, ht

    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    for i, lengths in enumerate(([5, 70], [3, 9, 64], [1, 0, 40, 2], [129])):
        x, cu = _packed(lengths, seed=30 + i, dtype=torch.float32, H=1, G=2, K=4, V=3)
        args = [x[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")] + [cu]
        got, want = compiled(*args), step(*args)
        for a, b in zip(got, want):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b)
    assert counter.frame_count <= 2, counter.frame_count


def test_export_varlen_dynamic():
    """torch.export with dynamic T and N (cu_seqlens an input); the exported
    program equals eager at other T and N."""
    from torch.export import Dim, export

    class Packed(torch.nn.Module):
        def forward(self, q, k, v, g, beta, A_log, dt_bias, cu):
            return chunk_kda(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                             use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)

    x, cu = _packed([5, 70, 3], seed=40, dtype=torch.float32, H=1, G=2, K=4, V=3)
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")
    # N = cu.shape[0] - 1 >= 2: an output dim that is an expression of a symbol (N = Np1 - 1)
    # gets torch's contiguity guard N != 1 (a plain symbol would not); one sequence is a batch of one
    T, Np1 = Dim("T", min=2, max=4096), Dim("Np1", min=3, max=64)
    shapes = dict(q={1: T}, k={1: T}, v={1: T}, g={1: T}, beta={1: T}, A_log=None, dt_bias=None, cu={0: Np1})
    ep = export(Packed(), tuple(x[n] for n in names) + (cu,), dynamic_shapes=shapes)
    x2, cu2 = _packed([1, 0, 64, 65], seed=41, dtype=torch.float32, H=1, G=2, K=4, V=3)
    args2 = tuple(x2[n] for n in names) + (cu2,)
    for a, b in zip(ep.module()(*args2), Packed()(*args2)):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b)


# -- on the GPU: against fla itself, and CUDA graphs ---------------------------

def _layer_style_inputs(lengths, H, G, K, V, seed):
    """bf16 raw inputs as fla's layer hands them to chunk_kda, on the GPU."""
    x, cu = _packed(lengths, seed=seed, dtype=torch.bfloat16, H=H, G=G, K=K, V=V)
    x["A_log"] = torch.empty(H * G).uniform_(1, 16).log()
    x["dt_bias"] = x["dt_bias"].float()
    return {n: t.cuda() for n, t in x.items()}, cu.cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("varlen,with_states", [(False, True), (True, True), ("short", True), ("short", False)])
def test_cuda_matches_fla_with_layer_flags(varlen, with_states):
    """Ours and fla's chunk_kda on the same bf16 inputs with fla's layer flags
    (l2norm, gate with lower_bound and safe_gate, beta sigmoid, V-first states):
    o, final state and every grad within bf16 rounding (relative 2e-2). "short":
    300 packed sequences of 1 to 64 tokens (mostly one chunk each: the scans'
    boundary chunks out of their loops, the skipped zero state terms); without
    states: no initial state and a loss on o alone (training: no final-state grad
    either)."""
    fla_kda = pytest.importorskip("fla.ops.kda")
    if varlen == "short":
        lengths = torch.randint(1, 65, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    else:
        lengths = [1, 63, 65, 300, 7] if varlen else [436]
    x, cu = _layer_style_inputs(lengths, H=2, G=2, K=64, V=64, seed=50)
    names = ["q", "k", "v", "g", "beta", "A_log", "dt_bias"] + (["initial_state"] if with_states else [])
    h0 = x["initial_state"][:len(lengths)].transpose(-1, -2).contiguous().float()  # V-first
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              safe_gate=True, lower_bound=-5.0, state_v_first=True, output_final_state=True)
    if varlen:
        kw.update(cu_seqlens=cu)
    results = []
    for fn in (chunk_kda, fla_kda.chunk_kda):
        leaves = {n: (h0 if n == "initial_state" else x[n]).detach().clone().requires_grad_() for n in names}
        o, ht = fn(*(leaves[n] for n in ("q", "k", "v", "g", "beta")), initial_state=leaves.get("initial_state"),
                   A_log=leaves["A_log"], dt_bias=leaves["dt_bias"], **kw)
        gen = torch.Generator(device="cuda").manual_seed(1)
        do = torch.randn(o.shape, device="cuda", generator=gen).to(o.dtype)
        dht = torch.randn(ht.shape, device="cuda", generator=gen)
        loss = (o.float() * do).sum() + ((ht * dht).sum() if with_states else 0)
        grads = torch.autograd.grad(loss, [leaves[n] for n in names])
        results.append([o, ht, *grads])
    for name, a, b in zip(["o", "final_state"] + ["d" + n for n in names], *results):
        a, b = a.float(), b.float()
        rel = ((a - b).norm() / b.norm()).item()
        assert rel < 2e-2, (name, rel)


@pytest.mark.gpu
def test_cuda_graph_captures_the_varlen_forward():
    """A CUDA graph of chunk_kda with cu_seqlens (device tensor, no cu_seqlens_cpu:
    nothing syncs): replayed with other lengths (same N) and other data, it
    equals eager."""
    x, cu = _layer_style_inputs([5, 70, 1, 180], H=1, G=2, K=64, V=64, seed=51)
    static = {n: x[n].clone() for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")}
    static_cu = cu.clone()
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              output_final_state=True)

    def step():
        return chunk_kda(*(static[n] for n in ("q", "k", "v", "g", "beta")), A_log=static["A_log"],
                         dt_bias=static["dt_bias"], cu_seqlens=static_cu, **kw)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    x2, cu2 = _layer_style_inputs([100, 0, 64, 92], H=1, G=2, K=64, V=64, seed=52)
    for n in static:
        static[n].copy_(x2[n])
    static_cu.copy_(cu2)
    graph.replay()
    want = chunk_kda(*(x2[n] for n in ("q", "k", "v", "g", "beta")), A_log=x2["A_log"], dt_bias=x2["dt_bias"],
                     cu_seqlens=cu2, **kw)
    for a, b in zip(out, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("fn", [chunk_kda, fused_recurrent_kda])
def test_dt_bias_as_hv_by_k_gets_its_grad_in_its_own_shape(fn):
    """dt_bias given as [HV, K] (accepted beside fla's [HV * K]): the same outputs
    and grads as the flat one, the grad in [HV, K]."""
    gen = torch.Generator().manual_seed(81)
    B, T, H, G, K, V = 1, 10, 1, 2, 4, 3
    HV = H * G
    q = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64)
    g = torch.randn(B, T, HV, K, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, T, HV, generator=gen, dtype=torch.float64)
    A_log = torch.randn(HV, generator=gen, dtype=torch.float64)
    bias = torch.randn(HV, K, generator=gen, dtype=torch.float64)
    grads = []
    for dt_bias in (bias.clone().requires_grad_(), bias.reshape(-1).clone().requires_grad_()):
        o, _ = fn(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True)
        (o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).reshape(o.shape)).sum().backward()
        assert dt_bias.grad.shape == dt_bias.shape
        grads.append((o.detach(), dt_bias.grad.reshape(-1)))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=0, atol=0)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=0, atol=0)
