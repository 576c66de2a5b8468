"""Context parallelism on CPU: ``kda_op.distributed.chunk_kda_cp`` in 2 and 3 gloo
processes (fp64, the reference kernels), slices of unequal lengths (an empty one
too), GVA: each rank's output slice, the final state and every gradient equal the
single-process call (1e-10); the in-kernel gate and l2norm options through it; and
``torch.compile(fullgraph=True)`` of the step traces the collective."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TESTS = Path(__file__).resolve().parent
NAMES = ("q", "k", "v", "g", "beta")
TOL = dict(rtol=1e-10, atol=1e-10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(options: bool, cu=None, v_first=False):
    """fp64 inputs of 150 tokens: B = 2, or packed (B = 1) along ``cu`` with one
    initial state per sequence; ``v_first``: the states [.., V, K]."""
    sys.path.insert(0, str(TESTS))
    from inputs import make_inputs

    x = make_inputs(B=2, T=150, H=1, G=2, K=8, V=6, dtype=torch.float64, seed=0)
    kwargs = {}
    if cu is not None:
        x = {n: t[:1] for n, t in x.items()}
        x["initial_state"] = torch.randn(len(cu) - 1, 2, 8, 6, generator=torch.Generator().manual_seed(3),
                                         dtype=torch.float64)
        kwargs["cu_seqlens"] = torch.tensor(cu)
    if v_first:
        x["initial_state"] = x["initial_state"].transpose(-1, -2).contiguous()
        kwargs["state_v_first"] = True
    if options:  # raw gate and q/k scaled: the in-kernel gate and l2norm act
        gen = torch.Generator().manual_seed(4)
        x["g"] = torch.randn(x["g"].shape, generator=gen, dtype=torch.float64)
        x["q"], x["k"] = 3 * x["q"], 3 * x["k"]
        kwargs.update(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, lower_bound=-5.0,
                      A_log=torch.randn(2, generator=gen, dtype=torch.float64),
                      dt_bias=torch.randn(2 * 8, generator=gen, dtype=torch.float64))
    return x, kwargs


def _worker(rank, world, port, cuts, options, compiled, cu, v_first, errors):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        from kda_op import chunk_kda
        from kda_op.distributed import chunk_kda_cp

        x, kwargs = _inputs(options, cu, v_first)
        sl = slice(cuts[rank], cuts[rank + 1])
        # cu_seqlens: the same offsets of the whole batch on every rank (not a parameter)
        flags = {n: p for n, p in kwargs.items() if not isinstance(p, torch.Tensor) or n == "cu_seqlens"}
        params = {n: p.clone().requires_grad_() for n, p in kwargs.items() if n not in flags}
        mine = {n: x[n][:, sl].clone().requires_grad_() for n in NAMES}
        h0 = x["initial_state"].clone().requires_grad_()
        fn = torch.compile(chunk_kda_cp, fullgraph=True, backend="aot_eager") if compiled else chunk_kda_cp
        o, ht = fn(*(mine[n] for n in NAMES), initial_state=h0, output_final_state=True, **flags, **params)

        full = {n: x[n].clone().requires_grad_() for n in NAMES}
        full_params = {n: kwargs[n].clone().requires_grad_() for n in params}
        h0_full = x["initial_state"].clone().requires_grad_()
        o_full, ht_full = chunk_kda(*(full[n] for n in NAMES), initial_state=h0_full, output_final_state=True,
                                    **flags, **full_params)
        torch.testing.assert_close(o, o_full[:, sl], **TOL)
        torch.testing.assert_close(ht, ht_full, **TOL)

        gen = torch.Generator().manual_seed(1)
        do = torch.randn(o_full.shape, generator=gen, dtype=torch.float64)
        dht = torch.randn(ht_full.shape, generator=gen, dtype=torch.float64)
        ((o_full * do).sum() + (ht_full * dht).sum()).backward()
        # the final state is replicated: its loss term is taken once over the ranks
        ((o * do[:, sl]).sum() + (ht * dht).sum() / world).backward()
        for n in NAMES:
            torch.testing.assert_close(mine[n].grad, full[n].grad[:, sl], **TOL, msg=lambda m: f"d{n}: {m}")
        # replicated inputs: their grads are split over the ranks
        for name, leaf, want in [("initial_state", h0, h0_full)] + [(n, params[n], full_params[n]) for n in params]:
            total = leaf.grad.clone()
            dist.all_reduce(total)
            torch.testing.assert_close(total, want.grad, **TOL, msg=lambda m: f"d{name}: {m}")
        dist.barrier()  # no rank tears down while another still talks to it
        dist.destroy_process_group()
        # Every check has passed. Skip the interpreter's teardown: with torch 2.13's gloo on
        # CPU it aborted now and then after a clean destroy ('terminate called without an
        # active exception', exit -6), about one run in five, whatever the test did.
        os._exit(0)
    except BaseException as e:  # reported to the parent, which fails the test
        import traceback

        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise SystemExit(1) from e


def _spawn(target, world, *args):
    """``target(rank, world, port, *args, errors)`` in ``world`` fresh processes; fails
    with every rank's traceback, or the exit codes, unless all of them passed."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    procs = [ctx.Process(target=target, args=(r, world, PORT[0], *args, errors)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    msgs = []
    while not errors.empty():
        msgs.append(errors.get())
    assert not msgs and all(p.exitcode == 0 for p in procs), "\n".join(msgs) or [p.exitcode for p in procs]


def _run(cuts, options=False, compiled=False, cu=None, v_first=False):
    _spawn(_worker, len(cuts) - 1, cuts, options, compiled, cu, v_first)


PORT = [0]


@pytest.fixture(autouse=True)
def _port():
    PORT[0] = _free_port()


@pytest.mark.parametrize("cuts", [
    [0, 37, 150],          # 2 ranks, unequal, neither a multiple of 64
    [0, 64, 64, 150],      # 3 ranks, an empty middle slice
    [0, 5, 101, 150],      # 3 ranks
])
def test_context_parallel_equals_one_process(cuts):
    _run(cuts)


def test_context_parallel_with_the_in_kernel_options():
    _run([0, 70, 150], options=True)


def test_context_parallel_compiles_fullgraph():
    _run([0, 90, 150], compiled=True)


# packed sequences of 20, 0, 70, 1, 59 tokens (150 in all)
CU = [0, 20, 20, 90, 91, 150]


@pytest.mark.parametrize("cuts", [
    [0, 37, 150],          # 2 ranks, the cut inside the third sequence
    [0, 20, 91, 150],      # 3 ranks, cut at sequence boundaries (the empty one at the first cut)
    [0, 30, 60, 150],      # 3 ranks, the third sequence over all of them
    [0, 64, 64, 150],      # 3 ranks, an empty middle slice
    [0, 90, 91, 150],      # 3 ranks, the middle one a single token (a one-token sequence)
])
def test_context_parallel_packed_sequences_equal_one_process(cuts):
    """cu_seqlens across the ranks: each rank's slice of o, every sequence's final
    state and every grad equal the packed call on one process."""
    _run(cuts, cu=CU)


def test_context_parallel_packed_with_the_options_and_v_first_states():
    _run([0, 45, 100, 150], options=True, cu=CU, v_first=True)


def test_context_parallel_packed_compiles_fullgraph():
    _run([0, 55, 150], compiled=True, cu=CU)


def test_context_parallel_v_first_states():
    _run([0, 80, 150], v_first=True)


def _bad_input_worker(rank, world, port, errors):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        from kda_op.distributed import chunk_kda_cp

        x, _ = _inputs(False, cu=CU)
        args = [x[n][:, 75 * rank:75 * (rank + 1)] for n in NAMES]
        # every rank refuses the same way, after the lengths' all-gather where it needs it
        with pytest.raises(ValueError, match="end at the ranks' tokens in all, 150"):
            chunk_kda_cp(*args, cu_seqlens=torch.tensor([0, 20, 151]))
        dist.barrier()
        dist.destroy_process_group()
        os._exit(0)  # as in _worker
    except BaseException as e:
        import traceback

        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise SystemExit(1) from e


def test_context_parallel_refuses_bad_input():
    """Errors that name the argument, raised before any kernel: the rules one rank
    checks alone, and the end of cu_seqlens against the ranks' tokens in all."""
    from kda_op.distributed import chunk_kda_cp

    x, _ = _inputs(False, cu=CU)
    args = [x[n] for n in NAMES]
    with pytest.raises(NotImplementedError, match="cp_context"):
        chunk_kda_cp(*args, cp_context=object())
    with pytest.raises(ValueError, match="cu_seqlens_cpu is given without cu_seqlens"):
        chunk_kda_cp(*args, cu_seqlens_cpu=torch.tensor(CU))
    with pytest.raises(ValueError, match="1-D int64"):
        chunk_kda_cp(*args, cu_seqlens=torch.tensor([0.0, 150.0]))
    with pytest.raises(TypeError, match="cu_seqlens must be a 1-D integer torch.Tensor"):
        chunk_kda_cp(*args, cu_seqlens=CU)
    with pytest.raises(ValueError, match="never decrease"):
        chunk_kda_cp(*args, cu_seqlens=torch.tensor([0, 90, 20, 150]))
    with pytest.raises(ValueError, match="one state per sequence of cu_seqlens"):
        chunk_kda_cp(*args, cu_seqlens=torch.tensor([0, 150]), initial_state=x["initial_state"])
    two = _inputs(False)[0]
    with pytest.raises(ValueError, match="B must be 1"):
        chunk_kda_cp(*(two[n] for n in NAMES), cu_seqlens=torch.tensor([0, 150]))
    _spawn(_bad_input_worker, 2)


def _model_worker(rank, world, port, cu, errors):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        from kda_op import cp_demo

        model = cp_demo.build(48, seed=0, device="cpu", dtype=torch.float64)
        tokens = torch.randint(48, (2 if cu is None else 1, 301), generator=torch.Generator().manual_seed(1))
        cu = None if cu is None else torch.tensor(cu)
        loss, grads = cp_demo.step(model, tokens, cu_seqlens=cu)
        ref = cp_demo.build(48, seed=0, device="cpu", dtype=torch.float64)
        ref_loss, ref_grads = cp_demo.single_step(ref, tokens, cu)
        torch.testing.assert_close(loss, ref_loss, **TOL)
        assert grads.keys() == ref_grads.keys()
        for name, g in ref_grads.items():  # every parameter, the short convolutions' and A_log included
            torch.testing.assert_close(grads[name], g, **TOL, msg=lambda m: f"{name}: {m}")
        dist.barrier()  # no rank tears down while another still talks to it
        dist.destroy_process_group()
        # Every check has passed. Skip the interpreter's teardown: with torch 2.13's gloo on
        # CPU it aborted now and then after a clean destroy ('terminate called without an
        # active exception', exit -6), about one run in five, whatever the test did.
        os._exit(0)
    except BaseException as e:
        import traceback

        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise SystemExit(1) from e


@pytest.mark.parametrize("world", [2, 3])
def test_context_parallel_training_step_of_the_model_equals_one_process(world):
    """kda_op.cp_demo.step: the small language model (short convolutions reading the
    previous rank's last inputs, the layer's in-kernel options) over 2 and 3 ranks,
    fp64: the loss and every parameter's gradient (summed over the ranks) equal the
    whole sequence's on one process."""
    _spawn(_model_worker, world, None)


@pytest.mark.parametrize("world,cu", [
    # 300 positions in slices of 150 / 100: documents that start two (world 2) and one
    # (world 3) tokens before a cut and go on past it (their first inputs in the short
    # convolutions' window from the previous rank, the inputs before them not), one
    # that ends at a cut, one that starts at a cut, an empty one, one of a single token
    (2, [0, 40, 148, 230, 230, 299, 300]),
    (3, [0, 98, 100, 170, 199, 300]),
])
def test_context_parallel_training_step_on_packed_documents_equals_one_process(world, cu):
    """The same with documents packed in the sequence (cu_seqlens across the ranks):
    the attention and the short convolutions restart at every document, also where
    a document starts just before or at a rank's first token."""
    _spawn(_model_worker, world, cu)
