"""Long contexts: offsets past 2^31 elements.

The kernels move each pointer in 64-bit to its chunk (or, in the loops of the
scans and the recurrent kernel, to each chunk or token) and offset within it in
32-bit (``_indexing.py``). Before that, T * HV * max(K, V, 64) >= 2^31 was refused
(262144 tokens at HV = 64, K = 128).

- Under the interpreter: the chunk coordinates every chunk-parallel kernel starts
  from (``chunk_coords``), for the last chunks of a 2^21-token sequence at HV = 64,
  K = 128, dense and packed, against exact Python integers: no real tensor of that
  size is needed (the interpreter runs ~1 chunk per second of the full kernels).
- On the GPU (marked gpu): the forward of one 2^21-token sequence whose tensors
  hold 3.2e9 elements (HV = 12, K = V = 128, bf16; about 100 GiB of device memory
  in all) against the same sequence run in 16 pieces of 131072 tokens carrying the
  state (each piece's offsets stay below 2^31 under any scheme), chunked and
  recurrent. A backward at that size does not fit one H200 (about 6-9 KB per token
  and value head), so it is not run here.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from kda_op.triton_kernels._indexing import chunk_coords  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BT = 64


@triton.jit
def _chunk_coords_probe(cu_seqlens, chunk_index, out, T, NC, H, HV, K: tl.constexpr, BT: tl.constexpr,
                        IS_VARLEN: tl.constexpr):
    # One program per probed chunk (axis 0: its slot; axis 1: one value head): the
    # element offsets of the chunk's first and last row in a [.., HV, K] tensor as
    # the kernels form them (64-bit base from chunk_coords, 32-bit within the
    # chunk), the rows left (T_c), the chunk's global index and state slot.
    i_p = tl.program_id(0)
    i_c = tl.load(chunk_index + 3 * i_p + 1) if not IS_VARLEN else i_p
    i_bh = tl.program_id(1).to(tl.int64)
    n, i_hv, i_h, bos, T_c, g_c, s_c = chunk_coords(i_c, i_bh, T, NC, H, HV, cu_seqlens, chunk_index, BT, IS_VARLEN)
    base = (bos * HV + i_hv) * K
    o_r = tl.arange(0, BT)
    last = tl.max(base + o_r * (HV * K), 0)  # the last row's offset as a block op, as in the kernels
    p = out + i_p * 5
    tl.store(p, base)
    tl.store(p + 1, last)
    tl.store(p + 2, T_c.to(tl.int64))
    tl.store(p + 3, g_c)
    tl.store(p + 4, s_c)


@pytest.mark.skipif(DEVICE != "cpu" or os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's arithmetic")
@pytest.mark.parametrize("varlen", [False, True])
def test_chunk_offsets_past_2_31_are_exact(varlen):
    T, HV, K = 2**21 + 37, 64, 128
    NC = -(-T // BT)
    chunks = [NC - 2, NC - 1]  # the last full chunk and the partial one: offsets ~2^34
    if varlen:
        # two sequences: 5 tokens, then the long one; the slots of its last chunks
        cu = torch.tensor([0, 5, 5 + T], dtype=torch.int64)
        # (sequence, chunk, state slot) as _host._varlen_index makes them: with initial
        # states sequence 1's boundaries follow sequence 0's two (chunk_offsets[1] + 1 = 2)
        expect_s = [2 + c for c in chunks]
        index = torch.tensor([[1, c, s] for c, s in zip(chunks, expect_s)], dtype=torch.int32)
        expect_bos = [5 + c * BT for c in chunks]
        expect_tc = [T - c * BT for c in chunks]
        expect_g = list(range(len(chunks)))  # the probe's slots
        T_arg = 5 + T
    else:
        cu = torch.zeros(1, dtype=torch.int64)
        index = torch.tensor([[0, c, 0] for c in chunks], dtype=torch.int32)
        expect_bos = [c * BT for c in chunks]
        expect_tc = [T - c * BT for c in chunks]
        expect_g = chunks
        expect_s = chunks
        T_arg = T
    out = torch.full((len(chunks), 5), -1, dtype=torch.int64)
    _chunk_coords_probe[(len(chunks), 1)](cu, index, out, T_arg, NC, HV, HV, K=K, BT=BT, IS_VARLEN=varlen)
    for i, c in enumerate(chunks):
        base = expect_bos[i] * HV * K
        assert base >= 2**31  # what 32-bit offsets could not reach
        assert out[i].tolist() == [base, base + (BT - 1) * HV * K, expect_tc[i], expect_g[i], expect_s[i]], (c, out[i])


def _long_inputs(T, H, HV, K, V, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dt = torch.bfloat16

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen, dtype=dt)

    q = randn(1, T, H, K)
    k = torch.nn.functional.normalize(randn(1, T, H, K), dim=-1)
    v = randn(1, T, HV, V)
    g = torch.nn.functional.logsigmoid(randn(1, T, HV, K).float()).clamp_min(-5.0)
    beta = torch.sigmoid(randn(1, T, HV))
    h0 = torch.randn(1, HV, K, V, device="cuda", generator=gen)
    return q, k, v, g, beta, h0


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
@pytest.mark.parametrize("fn_name", ["chunk_kda", "fused_recurrent_kda"])
def test_cuda_2_21_tokens_in_one_call_equal_the_sequence_in_pieces(fn_name):
    import kda_op

    fn = getattr(kda_op, fn_name)
    T, H, HV, K, V = 2**21, 12, 12, 128, 128
    assert T * HV * K > 2**31  # past the former bound in every [T, HV, K] tensor
    if torch.cuda.get_device_properties(0).total_memory < 120 * 2**30:
        pytest.skip("needs about 100 GiB of device memory")
    q, k, v, g, beta, h0 = _long_inputs(T, H, HV, K, V, seed=3)
    with torch.no_grad():
        o, ht = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        torch.cuda.synchronize()
        piece = 2**17
        state = h0
        worst = 0.0
        for a in range(0, T, piece):
            sl = slice(a, a + piece)
            o_p, state = fn(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], initial_state=state,
                            output_final_state=True)
            # The same chunks see the same state (carried in fp32 either way), so
            # the pieces give the whole call's numbers up to the kernels' rounding
            # (bf16 o); a wrapped offset would read other rows: O(1) errors or a fault.
            diff = ((o_p.float() - o[:, sl].float()).norm() / o[:, sl].float().norm()).item()
            worst = max(worst, diff)
            assert diff < 1e-3, (a, diff)
        state_diff = ((ht - state).norm() / state.norm()).item()
        print(f"{fn_name}: T = {T}: worst piece rel diff of o {worst:.2e}, final state {state_diff:.2e}")
        assert state_diff < 1e-4
        assert torch.isfinite(o).all()
