"""The CPU backward keeps O(T / C * K * V) state per head, never O(T * K * V)."""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from inputs import make_inputs
from kda_op.reference import kda_backward_reference, kda_forward_reference


class PeakLiveBytes(TorchDispatchMode):
    """Peak bytes of the storages that ops under this mode created and that are
    still alive (storages made before the mode, like the inputs, are not counted)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {key: entry for key, entry in self.live.items() if not entry[0].expired()}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.live.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))
        self.peak = max(self.peak, sum(nbytes for _, nbytes in self.live.values()))
        return out


def _backward_peak(T: int, chunk_size: int | None = None) -> int:
    inputs = make_inputs(B=1, T=T, H=1, G=1, K=128, V=128, seed=T)
    args = [inputs[n] for n in ("q", "k", "v", "g", "beta")]
    extra = {} if chunk_size is None else {"chunk_size": chunk_size}
    o, ht, chunk_states = kda_forward_reference(*args, None, inputs["initial_state"], **extra)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    with PeakLiveBytes() as mode:
        kda_backward_reference(*args, None, inputs["initial_state"], chunk_states, do, dht, **extra)
    return mode.peak


def test_backward_memory_does_not_grow_with_a_state_per_token():
    T1, T2 = 128, 256
    per_token_state_bytes = 128 * 128 * 8  # one fp64 [K, V] state
    bound = 0.25 * (T2 - T1) * per_token_state_bytes
    growth = _backward_peak(T2) - _backward_peak(T1)
    # What does grow with T is O(T * (K + V)): q/k/g copies and the grads.
    assert growth < bound, f"backward peak grew {growth} B from T={T1} to {T2}; bound {bound:.0f} B"

    # The measure itself can fail: one chunk spanning the whole sequence keeps a
    # state per token, and its growth exceeds the bound.
    naive_growth = _backward_peak(T2, chunk_size=T2) - _backward_peak(T1, chunk_size=T1)
    assert naive_growth > 2 * bound, naive_growth


def test_triton_backward_holds_one_stage_at_a_time(capsys):
    """profiling/memory_budget.py (the Triton host code's buffers under the
    interpreter, scaled to B8-T8192-H16): the backward drops each buffer after its
    last reader, so the peak (since dU' went to bf16, settings.BF16_DUP, at the backward
    through the A's, which reads dA_kk and dA_qk and writes dg, dq, dk) holds none of
    the buffers of the stages before it: dS_C, dU', U' and the dTm shares; 8088 bytes per
    token and head at K = V = 128, bf16 (8096 with fp32 dU', the peak then at the
    intra-chunk backward before dg, dq, dk; 8358 with dS_C in fp32 as well, 8878 with four
    dTm shares per chunk, 10672 when everything lived to the end)."""
    import os
    import sys
    from pathlib import Path

    import pytest

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the budget runs the kernels under the interpreter")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "profiling"))
    import memory_budget

    assert memory_budget.main(["--T", "64"]) == 0
    out = capsys.readouterr().out
    per_token = int(out.split(" bytes per token and value head")[0].rsplit("(", 1)[1])
    assert per_token <= 8150, out
    assert "dakk =" in out and "dg =" in out, out  # the peak is the backward through the A's
    for gone in (" dchunk_states =", " dup =", " up =", " dtm_part =", " dbeta_part ="):
        assert gone not in out, (gone, out)


def test_triton_forward_without_grad_keeps_no_chunk_states(monkeypatch):
    """A forward without grad (keep_chunk_states=False) whose scan writes the output
    (settings.FUSED_OUTPUT) allocates neither the chunk states nor U': its peak is below
    the scan-then-output forward's by both (which that forward holds at once, whether
    or not it returns the chunk states); with the chunk states kept, by U' alone."""
    import os

    import pytest

    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not set")
    from kda_op.triton_kernels import kda_fwd_triton, settings

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # the fused scan at these tiny shapes, in its V block on a GPU (64: fwd._FUSED_OUTPUT_DEVICE_MIN_BV)
    monkeypatch.setattr(settings, "BV_SCAN", 64)
    monkeypatch.setattr(settings, "FUSED_OUTPUT_MIN_BV", 64)
    monkeypatch.setattr(settings, "FUSED_OUTPUT_MIN_PROGRAMS_PER_SM", 0)  # ... and few programs
    # The diagonal blocks' inverses inside intra_wu_fwd, not in a buffer of their own: that
    # buffer (B * T * HV * 16 fp32, live during the intra-chunk stage) was U''s size at V = 32, so
    # on the GPU it set the fused forward's peak (2026-12-05, H100: 32,672 bytes below the
    # scan-then-output forward's instead of 76,800); the interpreter's own copies hid it.
    monkeypatch.setattr(settings, "INTRA_DIAG_INV_KERNEL", 0)
    B, T, HV, K, V = 2, 3 * 64 - 20, 2, 32, 64
    inputs = make_inputs(B=B, T=T, H=1, G=HV, K=K, V=V, dtype=torch.float32, seed=11)
    args = [inputs[n].to(device=device, dtype=torch.float32 if n == "g" else torch.bfloat16)
            for n in ("q", "k", "v", "g", "beta")] + [None, None]
    peaks = {}
    for fused in (0, 1):
        monkeypatch.setattr(settings, "FUSED_OUTPUT", fused)
        for keep in (True, False):
            with PeakLiveBytes() as mode:
                o, _, cs, _ = kda_fwd_triton(*args, False, keep_chunk_states=keep)
            assert cs.numel() == (B * 4 * HV * K * V if keep else 0)
            peaks[fused, keep] = mode.peak
    chunk_states_bytes = B * 4 * HV * K * V * 2  # bf16, NC + 1 = 4 boundaries
    up_bytes = B * T * HV * V * 2  # bf16
    # a few hundred bytes of small buffers (steep flags, spreads) are live at one peak
    # and not at the other: the comparisons allow 1 KiB
    assert peaks[0, True] - peaks[0, False] < 1024  # unfused: the same buffer, the caller's or its own
    assert peaks[0, False] - peaks[1, False] > chunk_states_bytes + up_bytes - 1024, peaks
    assert peaks[0, True] - peaks[1, True] > up_bytes - 1024, peaks
