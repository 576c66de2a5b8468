"""Decoding on a state pool (serving): ``fused_recurrent_kda(..., initial_state=pool,
ssm_state_indices=..., num_accepted_tokens=..., inplace_final_state=True)`` and the
in-place op ``kda_op::fused_recurrent_kda_pool_``.

Oracle: the independent naive loop (tests/naive.py, fp64) run on each sequence
alone from its slot's state (on each prefix for the per-token states of
speculative decoding). The Triton kernel runs under the interpreter on CPU and on
CUDA where there is a GPU."""

from __future__ import annotations

import os

import pytest
import torch

from kda_op import chunk_kda, fused_recurrent_kda
from naive import naive_kda

FP64 = dict(rtol=1e-10, atol=1e-12)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_HERE = DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _inputs(lengths, H, G, K, V, dtype, seed, packed):
    """Inputs for sequences of ``lengths``: packed (B = 1, cu_seqlens) or as rows of
    one length (B = N); q, k, v, g, beta fresh random, k unit-norm, g <= 0."""
    gen = torch.Generator().manual_seed(seed)
    HV = H * G
    N, T = len(lengths), (sum(lengths) if packed else lengths[0])
    B = 1 if packed else N

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = dict(q=randn(B, T, H, K), k=torch.nn.functional.normalize(randn(B, T, H, K), dim=-1), v=randn(B, T, HV, V),
             g=torch.nn.functional.logsigmoid(randn(B, T, HV, K)), beta=torch.sigmoid(randn(B, T, HV)))
    x = {n: t.to(dtype) for n, t in x.items()}
    cu = torch.tensor([0] + list(lengths)).cumsum(0) if packed else None
    return x, cu


def _rows(x, cu, n):
    """Sequence n's tensors ([1, T_n, ...])."""
    if cu is None:
        return {name: t[n:n + 1] for name, t in x.items()}
    a, b = int(cu[n]), int(cu[n + 1])
    return {name: t[:, a:b] for name, t in x.items()}


def _oracle(x, cu, pool, idx, nat=None, v_first=False):
    """(o, pool after the step) by the naive loop, sequence by sequence."""
    pool = pool.clone()
    before = pool.clone()
    N = idx.shape[0]
    o = torch.zeros_like(x["v"])
    layout = (lambda s: s.transpose(-1, -2)) if v_first else (lambda s: s)
    for n in range(N):
        r = _rows(x, cu, n)
        T_n = r["q"].shape[1]
        start = int(idx[n, int(nat[n]) - 1] if nat is not None else idx[n, 0]) if idx.dim() == 2 else int(idx[n])
        if start < 0:
            continue
        h0 = layout(before[start]).unsqueeze(0).double()
        o_n, ht = naive_kda(r["q"].double(), r["k"].double(), r["v"].double(), r["g"].double(), r["beta"].double(),
                            None, h0)
        if cu is None:
            o[n:n + 1] = o_n.to(o.dtype)
        else:
            o[:, int(cu[n]):int(cu[n + 1])] = o_n.to(o.dtype)
        if idx.dim() == 1:
            if T_n:
                pool[start] = layout(ht[0]).to(pool.dtype)
        else:
            for t in range(T_n):
                if int(idx[n, t]) >= 0:
                    _, h_t = naive_kda(*(r[name][:, :t + 1].double() for name in ("q", "k", "v", "g", "beta")),
                                       None, h0)
                    pool[int(idx[n, t])] = layout(h_t[0]).to(pool.dtype)
    return o, pool


def _step(x, cu, pool, idx, nat=None, v_first=False, fn=fused_recurrent_kda, **kw):
    if nat is not None:
        kw["num_accepted_tokens"] = nat
    with torch.no_grad():
        return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool, ssm_state_indices=idx,
                  inplace_final_state=True, cu_seqlens=cu, state_v_first=v_first, **kw)


CASES = [
    # lengths, packed, slots (1-D: per sequence; 2-D: per token), num_accepted_tokens
    ([1, 1, 1, 1], False, [6, -1, 0, 3], None),               # decode, one padding row
    ([1, 5, 0, 3], True, [2, 7, 4, -1], None),                # prefill chunks beside decode tokens, an empty one
    ([3, 3], False, [[0, 1, 2], [5, -1, 6]], [2, 1]),         # speculative: start from the last accepted
    ([2, 4, 1], True, [[1, 3, -1, -1], [4, 0, 6, 7], [-1, 2, 5, 8]], [1, 3, 2]),
]
# chunk_kda (prefill): one slot per sequence, sequences across chunk boundaries
CHUNK_CASES = [CASES[0], CASES[1], ([70, 1, 130, 0], True, [9, 0, -1, 5], None), ([67, 67], False, [3, 8], None)]


@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("fn,lengths,packed,slots,nat", [(fused_recurrent_kda, *c) for c in CASES]
                         + [(chunk_kda, *c) for c in CHUNK_CASES])
def test_pool_matches_each_sequence_alone(fn, lengths, packed, slots, nat, v_first):
    H, G, K, V, S = 2, 2, 8, 6, 10
    x, cu = _inputs(lengths, H, G, K, V, torch.float64, seed=len(lengths) * 7 + packed, packed=packed)
    shape = (S, H * G, V, K) if v_first else (S, H * G, K, V)
    pool = torch.randn(*shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    idx = torch.tensor(slots)
    nat_t = None if nat is None else torch.tensor(nat)
    want_o, want_pool = _oracle(x, cu, pool, idx, nat_t, v_first)
    before = pool.clone()
    o, returned = _step(x, cu, pool, idx, nat_t, v_first, fn=fn)
    assert returned is pool  # updated in place
    torch.testing.assert_close(o, want_o, **FP64)
    torch.testing.assert_close(pool, want_pool, **FP64)
    written = set(s for s in idx.flatten().tolist() if s >= 0)
    for s in range(S):
        if s not in written:  # untouched, bit for bit
            assert torch.equal(pool[s], before[s]), s
    assert not torch.equal(pool, before)


@pytest.mark.skipif(not TRITON_HERE, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("lengths,packed,slots,nat", CASES)
def test_triton_pool_kernel_matches_the_reference(lengths, packed, slots, nat, v_first):
    """recurrent_fwd.py with POOL against the CPU op, fp32, with the gate: o and
    every slot (the untouched ones bitwise)."""
    from kda_op.triton_kernels import kda_recurrent_pool_triton

    H, G, K, V, S = 2, 2, 16, 20, 10
    x, cu = _inputs(lengths, H, G, K, V, torch.float32, seed=len(lengths) + 11, packed=packed)
    shape = (S, H * G, V, K) if v_first else (S, H * G, K, V)
    pool = torch.randn(*shape, generator=torch.Generator().manual_seed(5))
    idx = torch.tensor(slots)
    nat_t = None if nat is None else torch.tensor(nat, dtype=torch.int32)
    A_log = torch.randn(H * G, generator=torch.Generator().manual_seed(6)) * 0.5
    dt_bias = torch.randn(H * G * K, generator=torch.Generator().manual_seed(7)) * 0.5
    want_pool = pool.clone()
    want_o = torch.ops.kda_op.fused_recurrent_kda_pool_(x["q"], x["k"], x["v"], x["g"], x["beta"], None, want_pool,
                                                        idx, nat_t, v_first, A_log, dt_bias, True, None, cu)
    dev = {n: t.to(DEVICE) for n, t in x.items()}
    got_pool = pool.to(DEVICE)
    got_o = kda_recurrent_pool_triton(dev["q"], dev["k"], dev["v"], dev["g"], dev["beta"], None, got_pool,
                                      idx.to(DEVICE), None if nat_t is None else nat_t.to(DEVICE), v_first,
                                      gate=(A_log.to(DEVICE), dt_bias.to(DEVICE), None),
                                      cu_seqlens=None if cu is None else cu.to(DEVICE))
    torch.testing.assert_close(got_o.cpu(), want_o, rtol=2e-5, atol=2e-6)  # fp32, another summation order
    torch.testing.assert_close(got_pool.cpu(), want_pool, rtol=2e-5, atol=2e-6)
    written = set(s for s in idx.flatten().tolist() if s >= 0)
    for s in range(S):
        if s not in written:
            assert torch.equal(got_pool[s].cpu(), pool[s]), s


@pytest.mark.skipif(not TRITON_HERE, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("lengths,packed,slots,nat", CHUNK_CASES[1:])
def test_triton_chunked_pool_matches_the_reference(lengths, packed, slots, nat, v_first):
    """The chunked kernels with the scan reading and writing the pool (state_fwd.py,
    output_fwd.py with POOL) against the CPU op, fp32, with the gate."""
    from kda_op.triton_kernels import kda_chunk_pool_triton

    H, G, K, V, S = 1, 2, 16, 20, 10
    x, cu = _inputs(lengths, H, G, K, V, torch.float32, seed=len(lengths) + 13, packed=packed)
    shape = (S, H * G, V, K) if v_first else (S, H * G, K, V)
    pool = torch.randn(*shape, generator=torch.Generator().manual_seed(8))
    idx = torch.tensor(slots)
    A_log = torch.randn(H * G, generator=torch.Generator().manual_seed(9)) * 0.5
    dt_bias = torch.randn(H * G * K, generator=torch.Generator().manual_seed(10)) * 0.5
    want_pool = pool.clone()
    want_o = torch.ops.kda_op.chunk_kda_pool_(x["q"], x["k"], x["v"], x["g"], x["beta"], None, want_pool, idx,
                                              v_first, A_log, dt_bias, True, None, cu)
    dev = {n: t.to(DEVICE) for n, t in x.items()}
    got_pool = pool.to(DEVICE)
    got_o = kda_chunk_pool_triton(dev["q"], dev["k"], dev["v"], dev["g"], dev["beta"], None, got_pool,
                                  idx.to(DEVICE), v_first, gate=(A_log.to(DEVICE), dt_bias.to(DEVICE), None),
                                  cu_seqlens=None if cu is None else cu.to(DEVICE))
    # fp32 on the GPU: 3xTF32 dots, the chunked form's summation order
    torch.testing.assert_close(got_o.cpu(), want_o, rtol=2e-4, atol=2e-5)
    torch.testing.assert_close(got_pool.cpu(), want_pool, rtol=2e-4, atol=2e-5)
    written = set(s for s in idx.tolist() if s >= 0)
    for s in range(S):
        if s not in written:
            assert torch.equal(got_pool[s].cpu(), pool[s]), s


def test_pool_with_fla_options_and_read_only_pool():
    """The call-surface options work on the pool (l2norm, gate, beta sigmoid); with
    inplace_final_state=False (1-D slots) the pool is only read and the final
    states come back as without one, equal to what the in-place call writes."""
    H, G, K, V, S = 1, 2, 8, 8, 6
    x, cu = _inputs([1, 4, 2], H, G, K, V, torch.float64, seed=21, packed=True)
    x["q"], x["k"] = 3 * x["q"], 3 * x["k"]  # not unit-norm: the l2norm acts
    opts = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                allow_neg_eigval=True, A_log=torch.randn(H * G, dtype=torch.float64),
                dt_bias=torch.randn(H * G * K, dtype=torch.float64))
    pool = torch.randn(S, H * G, K, V, dtype=torch.float64)
    idx = torch.tensor([4, 0, 2])
    before = pool.clone()
    with torch.no_grad():
        o_ro, finals = fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool,
                                           ssm_state_indices=idx, output_final_state=True, cu_seqlens=cu, **opts)
        assert torch.equal(pool, before)  # read only
        o_plain, finals_plain = fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                    initial_state=pool[idx], output_final_state=True,
                                                    cu_seqlens=cu, **opts)
        o_ip, _ = _step(x, cu, pool, idx, **opts)
    torch.testing.assert_close(o_ro, o_plain, **FP64)
    torch.testing.assert_close(finals, finals_plain, **FP64)
    torch.testing.assert_close(o_ip, o_plain, **FP64)
    torch.testing.assert_close(pool[idx], finals_plain, **FP64)


def test_pool_ops_pass_opcheck():
    H, G, K, V, S = 1, 2, 8, 8, 10
    for lengths, packed, slots, nat in CASES[1:3]:
        x, cu = _inputs(lengths, H, G, K, V, torch.float64, seed=31, packed=packed)
        pool = torch.randn(S, H * G, K, V, dtype=torch.float64)
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"], None, pool, torch.tensor(slots),
                None if nat is None else torch.tensor(nat), False, None, None, False, None, cu)
        torch.library.opcheck(torch.ops.kda_op.fused_recurrent_kda_pool_.default, args)
        if nat is None:
            chunk_args = args[:8] + args[9:]  # no num_accepted_tokens
            torch.library.opcheck(torch.ops.kda_op.chunk_kda_pool_.default, chunk_args)


def test_pool_step_compiles_fullgraph_and_export_records_the_write():
    """torch.compile(fullgraph=True) of a serving step writes the pool as eager does
    (functionalisation keeps the declared mutation); torch.export records the pool
    as a mutated input, and the exported program writes it when run."""
    H, G, K, V, S = 1, 2, 8, 8, 6
    x, _ = _inputs([1, 1, 1], H, G, K, V, torch.float32, seed=41, packed=False)
    pool0 = torch.randn(S, H * G, K, V)
    idx = torch.tensor([3, -1, 1])

    def step(q, k, v, g, beta, pool, idx):
        o, _ = fused_recurrent_kda(q, k, v, g, beta, initial_state=pool, ssm_state_indices=idx,
                                   inplace_final_state=True)
        return o

    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    eager_pool = pool0.clone()
    with torch.no_grad():
        o_eager = step(*args, eager_pool, idx)
        compiled_pool = pool0.clone()
        o_comp = torch.compile(step, fullgraph=True)(*args, compiled_pool, idx)
    torch.testing.assert_close(o_comp, o_eager)
    torch.testing.assert_close(compiled_pool, eager_pool)
    assert not torch.equal(compiled_pool, pool0)

    class Step(torch.nn.Module):
        def forward(self, q, k, v, g, beta, pool, idx):
            return step(q, k, v, g, beta, pool, idx)

    with torch.no_grad():
        ep = torch.export.export(Step(), (*args, pool0.clone(), idx))
    # the op node says which argument it writes (its schema's Tensor(a!)) ...
    nodes = [n for n in ep.graph.nodes if n.target is torch.ops.kda_op.fused_recurrent_kda_pool_.default]
    assert len(nodes) == 1
    written = [a.name for a in nodes[0].target._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert written == ["pool"], written
    # ... and the functional form of the program lists the pool among the inputs it mutates
    mutated = ep.run_decompositions().graph_signature.user_inputs_to_mutate
    assert list(mutated.values()) == ["pool"], mutated
    export_pool = pool0.clone()
    with torch.no_grad():
        o_ep = ep.module()(*args, export_pool, idx)
    torch.testing.assert_close(o_ep, o_eager)
    torch.testing.assert_close(export_pool, eager_pool)


def _bad_calls():
    H, G, K, V, S = 1, 2, 8, 8, 6
    x, _ = _inputs([2, 2], H, G, K, V, torch.float32, seed=51, packed=False)
    pool = torch.randn(S, H * G, K, V)
    good = dict(initial_state=pool, ssm_state_indices=torch.tensor([1, 4]), inplace_final_state=True)
    return x, pool, good, [
        (dict(ssm_state_indices=torch.tensor([1.0, 4.0])), TypeError, "int32 or int64"),
        (dict(ssm_state_indices=torch.tensor([1, 4, 5])), ValueError, "N = 2"),
        (dict(ssm_state_indices=torch.tensor([1, 6])), ValueError, "past the pool's 6 slots"),
        (dict(ssm_state_indices=torch.tensor([3, 3])), ValueError, "must not share a slot"),
        (dict(ssm_state_indices=torch.tensor([[1, 2], [3, 1]])), ValueError, "must not share a slot"),
        (dict(ssm_state_indices=torch.tensor([[1], [2]])), ValueError, "T_max >= T"),
        (dict(num_accepted_tokens=torch.tensor([1, 1])), ValueError, r"\[N, T_max\]"),
        (dict(ssm_state_indices=torch.tensor([[1, 2], [3, 4]]), num_accepted_tokens=torch.tensor([0, 2])),
         ValueError, "num_accepted_tokens must lie in"),
        (dict(initial_state=pool[:, :1]), ValueError, "the state pool"),
        (dict(initial_state=pool.double()), TypeError, "the state pool"),
        (dict(initial_state=pool.transpose(-1, -2)), ValueError, "contiguous"),
        (dict(initial_state=None), ValueError, "needs the state pool"),
        (dict(ssm_state_indices=torch.tensor([[1, 2], [3, 4]]), inplace_final_state=False), NotImplementedError,
         "inplace_final_state=True"),
        (dict(ssm_state_indices=None), ValueError, "need ssm_state_indices"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls()[3])))
def test_pool_bad_input_is_refused_and_no_slot_changes(case):
    x, pool, good, cases = _bad_calls()
    change, error, match = cases[case]
    before = pool.clone()
    with torch.no_grad(), pytest.raises(error, match=match):
        fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **{**good, **change})
    assert torch.equal(pool, before)


def test_packed_sequence_longer_than_t_max_is_refused_or_writes_no_state_past_it():
    """[N, T_max] slots with cu_seqlens: a sequence longer than T_max is refused where
    cu_seqlens is a CPU tensor; where nothing checks (CUDA), the kernel, like the
    reference op, writes no state for the tokens past T_max and reads no other
    sequence's slots for them."""
    H, G, K, V, S = 1, 1, 16, 16, 5
    x, cu = _inputs([3, 1], H, G, K, V, torch.float32, seed=71, packed=True)
    pool = torch.randn(S, H * G, K, V, generator=torch.Generator().manual_seed(72))
    idx = torch.tensor([[0, -1], [3, 4]])  # sequence 0: 3 tokens, 2 columns
    before = pool.clone()
    with torch.no_grad(), pytest.raises(ValueError, match="longest sequence of cu_seqlens, 3, got 2"):
        fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool, ssm_state_indices=idx,
                            inplace_final_state=True, cu_seqlens=cu)
    assert torch.equal(pool, before)
    want_pool = pool.clone()
    want_o = torch.ops.kda_op.fused_recurrent_kda_pool_(x["q"], x["k"], x["v"], x["g"], x["beta"], None, want_pool,
                                                        idx, None, False, None, None, False, None, cu)
    # the reference: sequence 0 writes slot 0 after its first token only; sequence 1 slot 3
    assert torch.equal(want_pool[[1, 2, 4]], pool[[1, 2, 4]])
    if not TRITON_HERE:
        return
    from kda_op.triton_kernels import kda_recurrent_pool_triton

    dev = {n: t.to(DEVICE) for n, t in x.items()}
    got_pool = pool.to(DEVICE)
    got_o = kda_recurrent_pool_triton(dev["q"], dev["k"], dev["v"], dev["g"], dev["beta"], None, got_pool,
                                      idx.to(DEVICE), None, False, cu_seqlens=cu.to(DEVICE))
    torch.testing.assert_close(got_o.cpu(), want_o, rtol=2e-5, atol=2e-6)  # fp32, another summation order
    torch.testing.assert_close(got_pool.cpu(), want_pool, rtol=2e-5, atol=2e-6)
    assert torch.equal(got_pool[[1, 2, 4]].cpu(), pool[[1, 2, 4]])


def test_chunk_kda_pool_takes_one_slot_per_sequence():
    x, pool, good, _ = _bad_calls()
    before = pool.clone()
    with torch.no_grad(), pytest.raises(NotImplementedError, match="fused_recurrent_kda's"):
        chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"],
                  **{**good, "ssm_state_indices": torch.tensor([[1, 2], [3, 4]])})
    with torch.no_grad(), pytest.raises(ValueError, match="must not share a slot"):
        chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **{**good, "ssm_state_indices": torch.tensor([2, 2])})
    assert torch.equal(pool, before)


def test_pool_refuses_inputs_that_need_grad():
    x, pool, good, _ = _bad_calls()
    before = pool.clone()
    with pytest.raises(ValueError, match="for inference"):
        fused_recurrent_kda(x["q"].requires_grad_(), x["k"], x["v"], x["g"], x["beta"], **good)
    assert torch.equal(pool, before)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
def test_cuda_graph_replays_pooled_decode_steps():
    """A decode step of a fixed maximum batch captured once, replayed with other
    requests in its rows (new slot indices copied into the captured tensor, -1 for
    empty rows): the pool after each replay equals eager steps'."""
    B, H, G, K, V, S = 8, 2, 2, 64, 64, 32
    x0, _ = _inputs([1] * B, H, G, K, V, torch.bfloat16, seed=61, packed=False)
    static_x = [x0[n].cuda() for n in ("q", "k", "v", "g", "beta")]
    pool = torch.randn(S, H * G, K, V, device="cuda")
    static_idx = torch.full((B,), -1, device="cuda", dtype=torch.int32)

    def step():
        return fused_recurrent_kda(*static_x, initial_state=pool, ssm_state_indices=static_idx,
                                   inplace_final_state=True)[0]

    with torch.no_grad():
        step()  # compile
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_o = step()
        eager_pool = pool.clone()
        for seed, rows in [(1, [3, 9, -1, 0, 17, -1, -1, 5]), (2, [-1, 1, 2, 30, -1, 4, 6, 7])]:
            new_x, _ = _inputs([1] * B, H, G, K, V, torch.bfloat16, seed=seed, packed=False)
            for dst, name in zip(static_x, ("q", "k", "v", "g", "beta")):
                dst.copy_(new_x[name])
            static_idx.copy_(torch.tensor(rows, dtype=torch.int32))
            graph.replay()
            o_eager, _ = fused_recurrent_kda(*static_x, initial_state=eager_pool,
                                             ssm_state_indices=static_idx.clone(), inplace_final_state=True)
            torch.testing.assert_close(static_o, o_eager, rtol=0, atol=0)  # the same kernel on the same bytes
            torch.testing.assert_close(pool, eager_pool, rtol=0, atol=0)
