"""The forward's intra-chunk stage in one launch (settings.INTRA_FUSED_FWD,
kda_op/triton_kernels/intra_fused_fwd.py) against the fp64 reference and against the
four-launch stage it replaces, through kda_fwd_triton, at tiny shapes. Without a GPU
both run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set by
conftest.py)."""

from __future__ import annotations

import os

import pytest
import torch

from inputs import make_inputs
from kda_op import CHUNK_SIZE
from kda_op.reference import kda_forward_reference, kda_forward_reference_varlen

triton = pytest.importorskip("triton")
from kda_op.triton_kernels import fwd as fwd_module  # noqa: E402
from kda_op.triton_kernels import kda_fwd_triton  # noqa: E402
from kda_op.triton_kernels import settings as S  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)

# the one-pass forward's fresh inputs with their fp64 reference, and its fp32 comparison;
# test_triton_kernels' launch recorder
from test_one_pass_fwd import NAMES, _close, _problem, _steeper_second_chunk  # noqa: E402
from test_triton_kernels import _on_launch  # noqa: E402


def _spy(monkeypatch, name: str) -> list:
    """The launches of fwd.py's kernel ``name`` from here on (one entry each)."""
    launches = []
    _on_launch(monkeypatch, fwd_module, name, launches.append)
    return launches


def _fused(monkeypatch, on, diag_inv: int = 0):
    """INTRA_FUSED_FWD = ``on`` (False / True / 2) and INTRA_FUSED_DIAG_INV = ``diag_inv``."""
    monkeypatch.setattr(S, "RECURRENT_MAX_T", 0)  # short sequences through the chunked kernels too
    monkeypatch.setattr(S, "INTRA_FUSED_FWD", int(on))
    monkeypatch.setattr(S, "INTRA_FUSED_DIAG_INV", diag_inv)


SHAPES = [
    # B, T, H, G, K, V, initial state
    (1, 5, 1, 1, 16, 16, True),  # shorter than a sub-block
    (2, CHUNK_SIZE, 1, 2, 16, 32, False),  # exactly one chunk, GVA
    (1, 2 * CHUNK_SIZE + 19, 2, 2, 24, 20, True),  # K, V not powers of two; a partial chunk
    (1, CHUNK_SIZE + 40, 1, 1, 48, 40, False),  # K in a full and a partial slice of 32; V in two blocks
]


@pytest.mark.parametrize("diag_inv", [0, 1])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_fused_intra_matches_reference_and_four_launches(monkeypatch, shape, diag_inv):
    B, T, H, G, K, V, with_h0 = shape
    args, h0, ref = _problem(B, T, H, G, K, V, with_h0, seed=sum(shape) + diag_inv)
    _fused(monkeypatch, False)
    want = kda_fwd_triton(*args, None, h0)
    _fused(monkeypatch, True, diag_inv)
    fused = _spy(monkeypatch, "kda_intra_fused_fwd_kernel")
    gam = _spy(monkeypatch, "kda_gam_fwd_kernel")
    got = kda_fwd_triton(*args, None, h0)
    assert len(fused) == 1 and len(gam) == 0  # the one launch replaced the stage
    for i, name in enumerate(("o", "final state", "chunk states")):
        _close(got[i], want[i], f"{name} vs four launches")
        _close(got[i], ref[i], f"{name} vs fp64 reference")


@pytest.mark.parametrize("drop,flag", [(9.0, 2), (4.0, 1)])
def test_fused_intra_steep_chunks(monkeypatch, drop, flag):
    """A second chunk whose gam strays past MAX_SPLIT from its middle row. Lowered by 4
    a token (16-row blocks within 8 * 4.x of their middle rows): flagged 1, its A's by
    block references in the fused kernel. By 9 (72 > 60): flagged 2, its A's by the
    steep launch and its W, U by intra_wu_fwd's ONLY_STEEP launch from the gam the
    fused kernel stored. The other chunks split at their middle rows (0)."""
    args, h0, ref = _problem(1, 3 * CHUNK_SIZE - 7, 1, 2, 32, 24, True, seed=11, steep=_steeper_second_chunk(drop))
    _fused(monkeypatch, True)
    monkeypatch.setattr(S, "INTRA_FUSED_BLOCK_REFS", 2)  # block references for a plain g too
    steep_wu = _spy(monkeypatch, "kda_intra_wu_fwd_kernel")
    got = kda_fwd_triton(*args, None, h0)
    assert len(steep_wu) == 1
    for i, name in enumerate(("o", "final state", "chunk states")):
        _close(got[i], ref[i], f"{name} vs fp64 reference")
    # the flags the fused kernel wrote: only the second chunk is steep, in both value heads
    s = fwd_module._sizes(args[0], args[2])
    flags = torch.empty(1, s["NC"], 2, dtype=torch.int32, device=DEVICE)
    out = dict(gam=torch.empty_like(args[3]), akk=torch.empty(1, args[0].shape[1], 2, CHUNK_SIZE, device=DEVICE),
               aqk=torch.empty(1, args[0].shape[1], 2, CHUNK_SIZE, device=DEVICE), steep=flags,
               qg=torch.empty_like(args[3]), kr=torch.empty_like(args[3]), w=torch.empty_like(args[3]),
               u=torch.empty_like(args[2]), tm=None)
    fwd_module._intra_fwd(*args, 32 ** -0.5, s, store_tm=False, out=out)
    assert flags[0, :, 0].tolist() == [0, flag, 0] and flags[0, :, 1].tolist() == [0, flag, 0]
    # without the kernel's block references for a plain g (the default), the steep launch takes it
    monkeypatch.setattr(S, "INTRA_FUSED_BLOCK_REFS", 1)
    fwd_module._intra_fwd(*args, 32 ** -0.5, s, store_tm=False, out=out)
    assert flags[0, :, 0].tolist() == [0, 2, 0]
    _close(kda_fwd_triton(*args, None, h0)[0], ref[0], "o vs fp64 reference, the steep launch")


def test_fused_intra_packed_sequences(monkeypatch):
    """Packed sequences (B = 1; a steep chunk inside one), without the short sequences'
    tiles, which keep the four launches (checked last)."""
    monkeypatch.setattr(S, "SHORT_TILE", 0)
    lengths = [1, 63, 65, 130]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    T = int(cu[-1])
    x = make_inputs(B=1, T=T, H=1, G=2, K=24, V=20, dtype=torch.float64, with_initial_state=False, seed=5)
    g = x["g"].float()
    g[:, 70:120] -= 3.0  # a steep chunk inside the third sequence
    args = [g if n == "g" else x[n].float() for n in NAMES]
    h0 = torch.randn(len(lengths), 2, 24, 20, dtype=torch.float64)
    ref_o, ref_ht = kda_forward_reference_varlen(*[a.double() for a in args], None, h0, cu)[:2]
    args = [a.to(DEVICE) for a in args]
    cu_d = cu.to(DEVICE)
    _fused(monkeypatch, False)
    want = kda_fwd_triton(*args, None, h0.float().to(DEVICE), cu_seqlens=cu_d)
    _fused(monkeypatch, True)
    fused = _spy(monkeypatch, "kda_intra_fused_fwd_kernel")
    got = kda_fwd_triton(*args, None, h0.float().to(DEVICE), cu_seqlens=cu_d)
    assert len(fused) == 1
    for i, name in enumerate(("o", "final states", "chunk states")):
        _close(got[i], want[i], f"{name} vs four launches")
    _close(got[0], ref_o, "o vs fp64 reference")
    _close(got[1], ref_ht, "final states vs fp64 reference")
    monkeypatch.setattr(S, "SHORT_TILE", 32)
    kda_fwd_triton(*args, None, h0.float().to(DEVICE), cu_seqlens=cu_d)
    assert len(fused) == 1


def test_fused_intra_forward_that_keeps_nothing(monkeypatch):
    """No chunk states, no final state (a no-grad forward): the fused kernel leaves
    unwritten what nothing reads (Qg and W of the first chunk, Kr of the last) and o
    is unchanged."""
    args, h0, ref = _problem(2, 2 * CHUNK_SIZE + 3, 1, 1, 16, 16, False, seed=21)
    _fused(monkeypatch, True)
    o, ht, cs, _ = kda_fwd_triton(*args, None, None, output_final_state=False, keep_chunk_states=False)
    assert ht.numel() == 0 and cs.numel() == 0
    _close(o, ref[0], "o vs fp64 reference")


@pytest.mark.parametrize("diag_inv", [0, 1])
def test_fused_intra_bf16(monkeypatch, diag_inv):
    """bf16 inputs (bf16 operands and intermediates): the fused stage's error to the
    fp64 reference stays that of the four launches (within 20% plus 1e-4: the same
    roundings, Tm formed in another order)."""
    args, h0, ref = _problem(2, 2 * CHUNK_SIZE + 11, 2, 2, 32, 32, True, seed=31, dtype=torch.bfloat16)
    _fused(monkeypatch, False)
    want = kda_fwd_triton(*args, None, h0)
    _fused(monkeypatch, True, diag_inv)
    got = kda_fwd_triton(*args, None, h0)

    def err(x, r):
        return ((x.cpu().double() - r).norm() / r.norm()).item()

    for i, name in enumerate(("o", "final state", "chunk states")):
        e_got, e_want = err(got[i], ref[i]), err(want[i], ref[i])
        assert e_got < 1e-2, f"{name}: {e_got}"
        assert e_got <= 1.2 * e_want + 1e-4, f"{name}: fused {e_got} vs four launches {e_want}"


def test_fused_intra_is_not_used_where_it_does_not_serve(monkeypatch):
    """Kept intermediates (the backward's Tm) keep the four launches; a setting out of range is refused."""
    args, h0, _ = _problem(1, CHUNK_SIZE + 3, 1, 1, 16, 16, True, seed=41)
    _fused(monkeypatch, True)
    fused = _spy(monkeypatch, "kda_intra_fused_fwd_kernel")
    kda_fwd_triton(*args, None, h0, keep_intermediates=True)
    assert len(fused) == 0
    kda_fwd_triton(*args, None, h0)
    assert len(fused) == 1
    monkeypatch.setattr(S, "INTRA_FUSED_FWD", 3)
    with pytest.raises(ValueError, match="INTRA_FUSED_FWD"):
        kda_fwd_triton(*args, None, h0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("diag_inv", [0, 1])
def test_fused_intra_near_parallel_keys(monkeypatch, diag_inv, dtype):
    """Keys nearly parallel, beta near 1 and slow decay: M = diag(beta) A_kk is close
    to all ones below the diagonal, so every power of a diagonal block D matters in
    (I - D)(I + D^2)(I + D^4)(I + D^8) (their sum cancels to a near-bidiagonal
    inverse). fp32 inputs take the substitution whatever the setting, at FP32_TOL;
    bf16 inputs keep the four launches' error to the fp64 reference."""
    B, T, H, K, V = 1, 2 * CHUNK_SIZE + 9, 1, 16, 16
    gen = torch.Generator().manual_seed(51 + diag_inv)
    base = torch.randn(K, generator=gen, dtype=torch.float64)
    k = torch.nn.functional.normalize(base + 0.05 * torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    q = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    g = -0.01 * torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)
    beta = 0.9 + 0.1 * torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    h0 = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    args = [x.to(torch.float32 if n == "g" else dtype) for n, x in zip(NAMES, (q, k, v, g, beta))]
    ref = kda_forward_reference(*[a.double() for a in args], None, h0)
    args = [a.to(DEVICE) for a in args]
    _fused(monkeypatch, False)
    want = kda_fwd_triton(*args, None, h0.float().to(DEVICE))
    _fused(monkeypatch, True, diag_inv)
    got = kda_fwd_triton(*args, None, h0.float().to(DEVICE))
    for i, name in enumerate(("o", "final state", "chunk states")):
        if dtype == torch.float32:
            _close(got[i], ref[i], f"{name} vs fp64 reference")
        else:
            e_got = ((got[i].cpu().double() - ref[i]).norm() / ref[i].norm()).item()
            e_want = ((want[i].cpu().double() - ref[i]).norm() / ref[i].norm()).item()
            assert e_got <= 1.2 * e_want + 1e-4, f"{name}: fused {e_got} vs four launches {e_want}"


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
def test_fused_intra_with_fla_gate(monkeypatch, lower_bound):
    """fla's in-kernel gate, applied to the raw gate as the fused kernel reads it: the
    softplus form (steep chunks possible: the steep launches run) and the bounded form
    at lower_bound -5 (log decays of -2.5 on average: most chunks too steep to split,
    all within reach of block references, so the steep launches do not run)."""
    from kda_op.reference import kda_gate_reference

    monkeypatch.setattr(S, "INTRA_FUSED_WITH_GATE", 1)
    B, T, H, G, K, V = 1, 3 * CHUNK_SIZE - 5, 1, 2, 32, 16
    HV = H * G
    x = make_inputs(B=B, T=T, H=H, G=G, K=K, V=V, dtype=torch.float64, with_initial_state=True, seed=61)
    gen = torch.Generator().manual_seed(62)
    g_raw = torch.randn(B, T, HV, K, generator=gen, dtype=torch.float64)
    A_log = torch.empty(HV, dtype=torch.float64).uniform_(0.0, 1.0, generator=gen)
    dt_bias = 0.5 * torch.randn(HV * K, generator=gen, dtype=torch.float64)
    log_decay = kda_gate_reference(g_raw, A_log, dt_bias, lower_bound)
    ref = kda_forward_reference(x["q"], x["k"], x["v"], log_decay, x["beta"], None, x["initial_state"])
    args = [(g_raw if n == "g" else x[n]).float().to(DEVICE) for n in NAMES]
    gate = (A_log.float().to(DEVICE), dt_bias.float().to(DEVICE), lower_bound)
    h0 = x["initial_state"].float().to(DEVICE)
    _fused(monkeypatch, False)
    want = kda_fwd_triton(*args, None, h0, gate=gate)
    _fused(monkeypatch, True)
    fused = _spy(monkeypatch, "kda_intra_fused_fwd_kernel")
    steep_wu = _spy(monkeypatch, "kda_intra_wu_fwd_kernel")
    got = kda_fwd_triton(*args, None, h0, gate=gate)
    assert len(fused) == 1 and len(steep_wu) == (0 if lower_bound is not None else 1)
    monkeypatch.setattr(S, "INTRA_FUSED_WITH_GATE", 0)  # (the default) the four launches for fla's gate
    kda_fwd_triton(*args, None, h0, gate=gate)
    assert len(fused) == 1
    monkeypatch.setattr(S, "INTRA_FUSED_WITH_GATE", 1)
    for i, name in enumerate(("o", "final state", "chunk states")):
        _close(got[i], want[i], f"{name} vs four launches")
        _close(got[i], ref[i], f"{name} vs fp64 reference")
    s = fwd_module._sizes(args[0], args[2])
    out = fwd_module._intra_fwd(*args, K ** -0.5, s, store_tm=False, gate=gate)
    if lower_bound is not None:  # the bounded gate's chunks: some split, some by block references
        assert set(out["steep"].flatten().tolist()) <= {0, 1} and 1 in out["steep"].flatten().tolist()


def test_fused_intra_keeps_the_intermediates(monkeypatch):
    """INTRA_FUSED_FWD = 2: the forward that keeps its intermediates (and the backward's
    recompute) takes the fused stage too, which then also stores gam, A_kk and Tm:
    outputs bitwise those of the plain forward, every kept piece close to the four
    launches' (a chunk through the steep launches among them), and the backward from
    them close to the recomputing one and to the fp64 reference."""
    from kda_op.reference import kda_backward_reference
    from kda_op.triton_kernels import kda_bwd_triton
    from kda_op.triton_kernels._host import _intermediates_views, _layout

    args, h0, ref = _problem(1, 3 * CHUNK_SIZE - 11, 1, 2, 32, 24, True, seed=71, steep=_steeper_second_chunk(9.0))
    _fused(monkeypatch, False)
    *want, kept_want = kda_fwd_triton(*args, None, h0, keep_intermediates=True)
    _fused(monkeypatch, 2)
    fused = _spy(monkeypatch, "kda_intra_fused_fwd_kernel")
    plain = kda_fwd_triton(*args, None, h0)
    *got, kept = kda_fwd_triton(*args, None, h0, keep_intermediates=True)
    assert len(fused) == 2
    for i, name in enumerate(("o", "final state", "chunk states")):
        assert torch.equal(got[i], plain[i]), name
        _close(got[i], want[i], f"{name} vs four launches")
    layout = _layout(args[0], args[2])[0]
    views, views_want = _intermediates_views(kept, layout), _intermediates_views(kept_want, layout)
    assert torch.equal(views["steep"], views_want["steep"])
    assert views["steep"][0, :, 0].tolist() == [0, 2, 0]
    for name in ("gam", "akk", "aqk", "tm", "u", "up", "qg", "kr", "w"):
        _close(views[name], views_want[name], f"kept {name}")

    gen = torch.Generator().manual_seed(72)
    do = torch.randn(got[0].shape, generator=gen).to(DEVICE)
    dht = torch.randn(got[1].shape, generator=gen).to(DEVICE)
    from_kept = kda_bwd_triton(*args, None, h0, got[2], do, dht, kept)
    recomputed = kda_bwd_triton(*args, None, h0, got[2], do, dht)
    assert len(fused) == 3  # the recompute took the fused stage too
    grads_ref = kda_backward_reference(*[a.double().cpu() for a in args], None, h0.double().cpu(),
                                       ref[2], do.double().cpu(), dht.double().cpu())
    for name, a, b, r in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), from_kept, recomputed, grads_ref):
        _close(a, b, f"{name}: kept vs recomputed")
        _close(a, r, f"{name} vs fp64 reference")
