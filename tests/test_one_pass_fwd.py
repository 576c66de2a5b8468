"""The one-pass forward (kda_op/triton_kernels/one_pass_fwd.py) against the fp64
reference and against the six-launch CUDA forward (kda_fwd_triton), at tiny shapes.
Without a GPU both run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1,
set by conftest.py)."""

from __future__ import annotations

import os

import pytest
import torch

from inputs import make_inputs
from kda_op import CHUNK_SIZE
from kda_op._contract import chunk_states_dtype
from kda_op.reference import kda_forward_reference, kda_forward_reference_varlen

triton = pytest.importorskip("triton")
from kda_op.triton_kernels import kda_fwd_triton  # noqa: E402
from kda_op.triton_kernels.one_pass_fwd import kda_one_pass_fwd  # noqa: E402
from kda_op.triton_kernels.settings import BC, MAX_SPLIT  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)

NAMES = ("q", "k", "v", "g", "beta")
# as tests/test_triton_kernels.py: fp32 throughout (3xTF32 dots on a GPU), summed in
# another order than the token loop
FP32_TOL = dict(rtol=2e-4, atol=2e-5)


def _problem(B, T, H, G, K, V, with_h0, seed, dtype=torch.float32, steep=None):
    """Fresh inputs (g fp32, the rest in ``dtype``; the state fp32) and the fp64
    reference on those same (rounded) values: ``(args, h0, (o, final, chunk states))``.
    ``steep``: a function that edits g (fp32) in place."""
    x = make_inputs(B=B, T=T, H=H, G=G, K=K, V=V, dtype=torch.float64, with_initial_state=with_h0, seed=seed)
    g = x["g"].float()
    if steep is not None:
        steep(g)
    args = [g if n == "g" else x[n].to(dtype) for n in NAMES]
    h0 = None if x["initial_state"] is None else x["initial_state"].float()
    ref = kda_forward_reference(*[a.double() for a in args], None, None if h0 is None else h0.double())
    return [a.to(DEVICE) for a in args], None if h0 is None else h0.to(DEVICE), ref


def _paths(B, T, HV):
    return torch.full((B, -(-T // CHUNK_SIZE), HV), -1, dtype=torch.int32, device=DEVICE)


def _python_paths(g: torch.Tensor) -> list:
    """The path each chunk of head 0 of sequence 0 should take, from g in Python (fp64
    cumsum; the cases below stay far from the MAX_SPLIT boundary): 0 where gam stays
    within MAX_SPLIT of the middle row, 1 where the gate is <= 0 and every 16-row block
    stays within MAX_SPLIT of its middle row, else 2. Rows past T repeat the last."""
    T = g.shape[1]
    out = []
    for c in range(0, T, CHUNK_SIZE):
        gc = g[0, c:c + CHUNK_SIZE, 0].double()
        gc = torch.cat([gc, gc.new_zeros(CHUNK_SIZE - gc.shape[0], gc.shape[1])])
        gam = gc.cumsum(0)
        if (gam - gam[CHUNK_SIZE // 2]).abs().max() <= MAX_SPLIT:
            out.append(0)
            continue
        blocks = gam.view(CHUNK_SIZE // BC, BC, -1)
        block_spread = (blocks - blocks[:, BC // 2:BC // 2 + 1]).abs().max()
        out.append(1 if block_spread <= MAX_SPLIT and gc.max() <= 0 else 2)
    return out


def _close(got, want, name):
    torch.testing.assert_close(got.cpu().double(), want.cpu().double(), **FP32_TOL, msg=lambda m: f"{name}: {m}")


SHAPES = [
    # B, T, H, G, K, V, initial state, V block, K slice of the A's
    (1, 5, 1, 1, 16, 16, True, 16, 32),  # shorter than a sub-block
    (2, CHUNK_SIZE, 1, 2, 16, 32, False, 16, 32),  # exactly one chunk, GVA, two V blocks
    # K, V not powers of two; partial chunk; V = 20 in blocks of 16; K = 24 in one slice, or two of 16
    (1, 2 * CHUNK_SIZE + 19, 2, 2, 24, 20, True, 16, 32),
    (1, 2 * CHUNK_SIZE + 19, 2, 2, 24, 20, True, 16, 16),
    (1, 2 * CHUNK_SIZE + 19, 1, 2, 32, 32, False, 32, 32),
]


@pytest.mark.parametrize("B,T,H,G,K,V,with_h0,block_v,block_k_a", SHAPES)
def test_one_pass_fp32_matches_reference_and_the_six_launch_forward(B, T, H, G, K, V, with_h0, block_v, block_k_a):
    args, h0, (o_ref, ht_ref, cs_ref) = _problem(B, T, H, G, K, V, with_h0, seed=11 + T + K)
    paths = _paths(B, T, H * G)
    o, ht, cs = kda_one_pass_fwd(*args, None, h0, True, True, block_v=block_v, block_k_a=block_k_a, paths=paths)
    assert o.dtype == torch.float32 and ht.dtype == torch.float32 and cs.dtype == torch.float32
    assert cs.shape == (B, -(-T // CHUNK_SIZE) + 1, H * G, K, V)
    assert paths.min().item() >= 0  # every chunk's path recorded
    for name, got, want in (("o", o, o_ref), ("final_state", ht, ht_ref), ("chunk_states", cs, cs_ref)):
        _close(got, want, name)
    o6, ht6, cs6, _ = kda_fwd_triton(*args, None, h0)
    for name, got, want in (("o", o, o6), ("final_state", ht, ht6), ("chunk_states", cs, cs6)):
        _close(got, want, name + " vs kda_fwd_triton")


def _steeper_second_chunk(drop: float, positive_entry: bool = False):
    def edit(g):
        g[:, CHUNK_SIZE:2 * CHUNK_SIZE] -= drop
        if positive_entry:  # one rising gate entry: the block references are refused
            g[:, CHUNK_SIZE + 3, :, 1] = 0.5
    return edit


# drop 4: ~1.3 + 4 per token over 32 rows from the chunk's middle (> 60), 8 from a
# block's middle (< 60): block references. drop 9: > 60 within a block: columns.
# drop 4 with a rising entry: block spreads allow references but the gate is not <= 0.
@pytest.mark.parametrize("drop,positive_entry,want,block_k_a", [(4.0, False, [0, 1, 0], 32), (9.0, False, [0, 2, 0], 32),
                                                                (4.0, True, [0, 2, 0], 32), (4.0, False, [0, 1, 0], 16),
                                                                (9.0, False, [0, 2, 0], 16)])
def test_one_pass_steep_chunks_take_the_other_paths(drop, positive_entry, want, block_k_a):
    B, T, H, G, K, V = 1, 2 * CHUNK_SIZE + 19, 1, 2, 24, 20
    args, h0, (o_ref, ht_ref, cs_ref) = _problem(B, T, H, G, K, V, True, seed=5,
                                                 steep=_steeper_second_chunk(drop, positive_entry))
    assert _python_paths(args[3].cpu()) == want
    paths = _paths(B, T, H * G)
    o, ht, cs = kda_one_pass_fwd(*args, None, h0, True, True, block_v=16, block_k_a=block_k_a, paths=paths)
    assert paths[0, :, 0].tolist() == want and paths[0, :, 1].tolist()[1] != 0
    for name, got, want_t in (("o", o, o_ref), ("final_state", ht, ht_ref), ("chunk_states", cs, cs_ref)):
        _close(got, want_t, name)
    o6, ht6, cs6, _ = kda_fwd_triton(*args, None, h0)
    for name, got, want_t in (("o", o, o6), ("final_state", ht, ht6), ("chunk_states", cs, cs6)):
        _close(got, want_t, name + " vs kda_fwd_triton")


def _rel_err(got, want):
    got, want = got.cpu().double(), want.cpu().double()
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("drop", [0.0, 9.0])
def test_one_pass_bf16_matches_reference_and_the_six_launch_forward(drop):
    B, T, H, G, K, V = 1, 2 * CHUNK_SIZE + 19, 1, 2, 32, 32
    args, h0, (o_ref, ht_ref, cs_ref) = _problem(B, T, H, G, K, V, True, seed=3, dtype=torch.bfloat16,
                                                 steep=_steeper_second_chunk(drop) if drop else None)
    paths = _paths(B, T, H * G)
    o, ht, cs = kda_one_pass_fwd(*args, None, h0, True, True, block_v=16, paths=paths)
    assert paths[0, 1, 0].item() == (2 if drop else 0)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    assert cs.dtype == chunk_states_dtype(torch.bfloat16, "cuda")
    o6, ht6, cs6, _ = kda_fwd_triton(*args, None, h0)
    for name, got, ref, six in (("o", o, o_ref, o6), ("final_state", ht, ht_ref, ht6),
                                ("chunk_states", cs, cs_ref, cs6)):
        err, err6 = _rel_err(got, ref), _rel_err(six, ref)
        # The scan and output dots take bf16 operands (Kb, S, Tm, the residual, A_qk,
        # U', Qg, Kr rounded to 2^-8 relative, fp32 sums), and o and the chunk states
        # are stored in bf16 (2^-9 relative each): some 1e-3 to 4e-3 relative error in
        # norm is expected. Seen here (interpreter, either drop): o 3.1e-3, final state
        # 2.5e-3, chunk states 1.8e-3, where the six-launch forward (which rounds W, U,
        # Qg, Kr, A_qk to bf16 between its launches instead) has 2.8e-3, 1.9e-3,
        # 1.7e-3. Bounds: 1e-2 as in tests/test_triton_kernels.py's bf16 test, and
        # within 2x of the six-launch forward's own error (plus 1e-3 for a lucky draw
        # there).
        assert err < 1e-2, (name, err)
        assert err < 2 * err6 + 1e-3, (name, err, err6)
        assert _rel_err(got, six) < 1e-2, name


def test_one_pass_outputs_as_asked():
    """No final state and no chunk states where not asked (None); chunk states written
    into a given tensor; T = 0: the initial state passes through."""
    B, T, H, G, K, V = 1, CHUNK_SIZE + 3, 1, 1, 16, 16
    args, h0, (o_ref, ht_ref, cs_ref) = _problem(B, T, H, G, K, V, True, seed=8)
    o, ht, cs = kda_one_pass_fwd(*args, None, h0, output_final_state=False)
    assert ht is None and cs is None
    _close(o, o_ref, "o")
    buf = torch.full((B, 3, H * G, K, V), float("nan"), device=DEVICE)
    o, ht, cs = kda_one_pass_fwd(*args, None, h0, chunk_states=buf)
    assert cs is buf
    _close(buf, cs_ref, "chunk_states")
    empty = [a[:, :0] for a in args]
    o, ht, cs = kda_one_pass_fwd(*empty, None, h0, True, True)
    assert o.shape == (B, 0, H * G, V)
    _close(ht, h0, "final_state at T = 0")
    _close(cs[:, 0], h0, "chunk_states at T = 0")


def test_one_pass_explicit_scale():
    B, T, H, G, K, V = 1, 20, 1, 1, 16, 16
    args, h0, _ = _problem(B, T, H, G, K, V, True, seed=9)
    o_ref, ht_ref, _ = kda_forward_reference(*[a.double().cpu() for a in args], 0.3, h0.double().cpu())
    o, ht, _ = kda_one_pass_fwd(*args, 0.3, h0)
    _close(o, o_ref, "o")
    _close(ht, ht_ref, "final_state")


def test_one_pass_refuses_what_it_does_not_serve():
    args, h0, _ = _problem(1, 8, 1, 1, 16, 16, True, seed=1)
    args2, h02, _ = _problem(2, 8, 1, 1, 16, 16, True, seed=1)
    with pytest.raises(ValueError, match="cu_seqlens"):  # packed sequences take B = 1
        kda_one_pass_fwd(*args2, None, h02, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="initial_state"):  # one state per sequence: [N, HV, K, V]
        kda_one_pass_fwd(*args, None, h0, cu_seqlens=torch.tensor([0, 3, 8], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="a_bf16"):
        kda_one_pass_fwd(*args, None, h0, a_bf16=True)
    with pytest.raises(ValueError, match="block_v"):
        kda_one_pass_fwd(*args, None, h0, block_v=48)
    big = make_inputs(B=1, T=4, H=1, K=256, V=16, dtype=torch.float32, seed=2)
    with pytest.raises(ValueError, match="K = 256"):
        kda_one_pass_fwd(*[big[n] for n in NAMES], None, None)
    with pytest.raises(ValueError, match="initial_state"):
        kda_one_pass_fwd(*args, None, h0[:, :, :8])
    with pytest.raises(ValueError, match="chunk_states"):
        kda_one_pass_fwd(*args, None, h0, chunk_states=torch.empty(1, 1, 1, 16, 16))


def _varlen_problem(lengths, G, K, V, with_h0, seed, idx_dtype=torch.int32, steep=None):
    """Packed sequences (B = 1): fresh fp32 inputs, cu_seqlens, per-sequence initial
    states (or None) and the fp64 reference. The reference and the six-launch forward
    lay the chunk states out with initial-state slots only when given initial states;
    the one-pass forward always does, so without them both are run on zero states
    (the same sums) to get that layout."""
    T = sum(lengths)
    x = make_inputs(B=1, T=T, H=1, G=G, K=K, V=V, dtype=torch.float64, with_initial_state=False, seed=seed)
    g = x["g"].float()
    if steep is not None:
        steep(g)
    args = [g if n == "g" else x[n].float() for n in NAMES]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=idx_dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    h0 = torch.randn(len(lengths), G, K, V, generator=gen) if with_h0 else None
    h0_ref = h0 if with_h0 else torch.zeros(len(lengths), G, K, V)
    ref = kda_forward_reference_varlen(*[a.double() for a in args], None, h0_ref.double(), cu)
    to = (lambda t: None if t is None else t.to(DEVICE))
    return [a.to(DEVICE) for a in args], to(cu), to(h0), to(h0_ref), ref


@pytest.mark.parametrize("with_h0,idx_dtype", [(True, torch.int32), (False, torch.int64)])
def test_one_pass_packed_sequences_match_reference_and_the_six_launch_forward(with_h0, idx_dtype):
    # sequences of 1 token, just under, just over and over two chunks; GVA G = 2;
    # K, V not powers of two; V in two blocks of 16
    lengths = [1, 63, 65, 130]
    args, cu, h0, h0_ref, (o_ref, ht_ref, cs_ref) = _varlen_problem(lengths, 2, 24, 20, with_h0, seed=21,
                                                                     idx_dtype=idx_dtype)
    NCS = sum(lengths) // CHUNK_SIZE + 2 * len(lengths)
    assert cs_ref.shape == (1, NCS, 2, 24, 20)
    # NaN everywhere first: every slot, the unused one past the last sequence included
    # (written zero), must be written by the kernel
    buf = torch.full((1, NCS, 2, 24, 20), float("nan"), device=DEVICE)
    NCB = sum(lengths) // CHUNK_SIZE + len(lengths)
    paths = torch.full((1, NCB, 2), -1, dtype=torch.int32, device=DEVICE)
    o, ht, cs = kda_one_pass_fwd(*args, None, h0, True, buf, cu_seqlens=cu, block_v=16, paths=paths)
    assert cs is buf and ht.shape == (len(lengths), 2, 24, 20)
    # every real chunk (7 of them, numbered globally) recorded path 0; the spare slot untouched
    assert (paths[0, :7] == 0).all() and (paths[0, 7:] == -1).all()
    for name, got, want in (("o", o, o_ref), ("final_state", ht, ht_ref), ("chunk_states", cs, cs_ref)):
        _close(got, want, name)
    o6, ht6, cs6, _ = kda_fwd_triton(*args, None, h0_ref, cu_seqlens=cu)
    for name, got, want in (("o", o, o6), ("final_state", ht, ht6), ("chunk_states", cs, cs6)):
        _close(got, want, name + " vs kda_fwd_triton")
    assert (cs[:, -1] == 0).all()


def test_one_pass_packed_steep_chunk_and_given_index():
    """A steep chunk inside a packed sequence takes the column path at its global chunk
    index; passing _host._varlen_index's seq_offsets gives the same bits as letting
    the host build them."""
    from kda_op.triton_kernels._host import _varlen_index

    lengths = [70, 2 * CHUNK_SIZE + 5]

    def steep(g):  # the second sequence's second chunk (global chunk 3) falls by 9 per token
        g[:, 70 + CHUNK_SIZE:70 + 2 * CHUNK_SIZE] -= 9.0

    args, cu, h0, _, (o_ref, ht_ref, cs_ref) = _varlen_problem(lengths, 1, 16, 16, True, seed=4, steep=steep)
    NCB = sum(lengths) // CHUNK_SIZE + len(lengths)
    paths = torch.full((1, NCB, 1), -1, dtype=torch.int32, device=DEVICE)
    o, ht, cs = kda_one_pass_fwd(*args, None, h0, True, True, cu_seqlens=cu, block_v=16, paths=paths)
    assert paths[0, :5, 0].tolist() == [0, 0, 0, 2, 0]
    for name, got, want in (("o", o, o_ref), ("final_state", ht, ht_ref), ("chunk_states", cs, cs_ref)):
        _close(got, want, name)
    _, seq_offsets, _, _, _ = _varlen_index(cu, sum(lengths), True)
    o2, ht2, cs2 = kda_one_pass_fwd(*args, None, h0, True, True, cu_seqlens=cu, block_v=16, seq_offsets=seq_offsets)
    assert torch.equal(o, o2) and torch.equal(ht, ht2) and torch.equal(cs, cs2)
