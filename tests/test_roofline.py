"""profiling/roofline.py: its cost model, its reading of the benchmark's kernel tables,
and the table and plot it makes from the measured times kept in the repository."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "profiling"))
import roofline  # noqa: E402

LOG = """\
B1-T8192-H16 layer-style: ours: forward: 0.730 ms of kernels per step
       0.201 ms  kda_intra_a_fwd_kernel
B1-T8192-H16 layer-style: ours: forward+backward: 2.917 ms of kernels per step
       0.710 ms  kda_intra_bwd_a_kernel
       0.185 ms  kda_state_fwd_kernel
B1-T8192-H16 layer-style: fla: forward+backward: 2.364 ms of kernels per step
       0.650 ms  chunk_kda_bwd_kernel_wy_dqkg_fused
"""


def test_parse_kernel_times_takes_the_labelled_table_only():
    got = roofline.parse_kernel_times(LOG, "B1-T8192-H16 layer-style: ours")
    assert got == {"kda_intra_bwd_a_kernel": 0.710, "kda_state_fwd_kernel": 0.185}
    assert roofline.parse_kernel_times(LOG, "B1-T8192-H16 layer-style: ours", "forward") == {
        "kda_intra_a_fwd_kernel": 0.201}
    with pytest.raises(ValueError, match="no kernel table"):
        roofline.parse_kernel_times(LOG, "B8-T8192-H16: ours")


def test_costs_of_the_scan_and_the_output_by_hand():
    """Two sequences of 100 tokens (two chunks each), H = HV = 2, K = 32, V = 16, an
    initial state: the forward scan and the output kernel counted by hand."""
    s = roofline.Shape(lengths=(100, 100), H=2, HV=2, K=32, V=16, initial_state=True)
    costs = roofline.kernel_costs(s)
    tok, chunks, seqh, state = 200 * 2, 2 * 2 * 2, 2 * 2, 32 * 16
    # reads Kr, W (bf16, K), U (bf16, V), h0 (fp32); writes U' (bf16, V), the chunk
    # states (bf16, one per chunk and one final per sequence) and the final states (fp32)
    want_bytes = 2 * tok * 32 * 2 + tok * 16 * 2 + seqh * state * 4 + tok * 16 * 2 + (chunks + seqh) * state * 2 \
        + seqh * state * 4
    assert costs["kda_state_fwd_kernel"][:2] == (want_bytes, chunks * 2 * 2 * 64 * 32 * 16)
    # reads A_qk (bf16, 64 a row), U', and Qg and S0 of every chunk (an initial state); writes o
    want_bytes = tok * 64 * 2 + tok * 16 * 2 + tok * 32 * 2 + chunks * state * 2 + tok * 16 * 2
    assert costs["kda_output_fwd_kernel"][:2] == (want_bytes, chunks * 2 * 64 * 32 * 16 + chunks * 2 * 64 * 64 * 16)


def test_costs_of_the_scan_writing_the_output_by_hand():
    """Two sequences of 100 tokens (two chunks each), H = HV = 2, K = 32, V = 16, no
    initial state: the forward scan that writes the output reads Kr, W, U, A_qk and the
    Qg of second chunks, writes U', the chunk states, the final states and o; it reads
    neither U' nor the chunk states back, which the scan and the output kernel apart do."""
    s = roofline.Shape(lengths=(100, 100), H=2, HV=2, K=32, V=16)
    costs = roofline.kernel_costs(s)
    tok, chunks, seqh, state = 200 * 2, 2 * 2 * 2, 2 * 2, 32 * 16
    rows_s0 = (100 - 64) * 2 * 2  # the second chunks' rows: the only ones with an entering state
    want_bytes = (2 * tok * 32 * 2 + tok * 16 * 2 + tok * 64 * 2 + rows_s0 * 32 * 2  # Kr, W, U, A_qk, Qg
                  + tok * 16 * 2 + (chunks + seqh) * state * 2 + seqh * state * 4 + tok * 16 * 2)  # U', states, o
    # W S0 and Qg S0 in the second chunks, Kr^T U' in every chunk, A_qk U' in every chunk
    want_flops = (2 * 4 + 8) * 2 * 64 * 32 * 16 + chunks * 2 * 64 * 64 * 16
    assert costs["kda_state_output_fwd_kernel"][:2] == (want_bytes, want_flops)
    apart = costs["kda_state_fwd_kernel"][0] + costs["kda_output_fwd_kernel"][0]
    assert want_bytes == apart - tok * 16 * 2 - 4 * state * 2  # U' and the 4 entering states not read


def test_costs_of_the_fused_backward_scan_by_hand():
    """Two sequences of 100 tokens (two chunks each), H = HV = 2, K = 32, V = 16, an
    initial state and dht: the fused backward scan reads Qg, Kr, W, A_qk and dO (bf16)
    and writes dU' (fp32), dS_C (bf16) and dh0 (fp32); four dots a chunk."""
    s = roofline.Shape(lengths=(100, 100), H=2, HV=2, K=32, V=16, initial_state=True, final_state_grad=True)
    tok, chunks, seqh, state = 200 * 2, 2 * 2 * 2, 2 * 2, 32 * 16
    want_bytes = 3 * tok * 32 * 2 + tok * 64 * 2 + tok * 16 * 2 + tok * 16 * 4 + chunks * state * 2 + seqh * state * 4
    want_flops = chunks * (2 * 64 * 64 * 16 + 3 * 2 * 64 * 32 * 16)
    assert roofline.kernel_costs(s)["kda_state_bwd_fused_kernel"][:2] == (want_bytes, want_flops)


def test_costs_of_the_compact_forward_scan_by_hand():
    """Packed sequences of 100 and 30 tokens (two chunks and one), H = HV = 1, K = 32,
    V = 16, no states in or out (training): the scan stores only the state entering
    the 100-token sequence's second chunk, and forms only it and that chunk's W S."""
    s = roofline.Shape(lengths=(100, 30), H=1, HV=1, K=32, V=16, final_state=False, packed=True)
    tok, state = 130, 32 * 16
    want_bytes = 2 * tok * 32 * 2 + tok * 16 * 2 + tok * 16 * 2 + 1 * state * 2
    assert roofline.kernel_costs(s)["kda_state_fwd_kernel"][:2] == (want_bytes, 2 * 2 * 64 * 32 * 16)
    # the same call not packed (dense layout: every boundary stored) and with final states
    dense = roofline.kernel_costs(roofline.Shape(lengths=(100, 30), H=1, HV=1, K=32, V=16))
    assert dense["kda_state_fwd_kernel"][0] == want_bytes - state * 2 + (3 + 2) * state * 2 + 2 * state * 4


def test_costs_of_the_row_block_kernels_and_the_diagonal_inverses_by_hand():
    """One 64-token chunk, H = HV = 1, K = 32: the diagonal inverses read the 16-wide
    diagonal blocks of A_kk (fp32) and beta (bf16) and write the inverses (fp32); the
    forward's row blocks dot over 16, 32, 64 and 64 columns, the backward's over the
    chunk's 64 rows and columns, two dots each way a block."""
    costs = roofline.kernel_costs(roofline.Shape(lengths=(64,), H=1, HV=1, K=32, V=16))
    assert costs["kda_diag_inv_kernel"][:2] == (64 * 16 * 4 + 64 * 2 + 64 * 16 * 4, 0)
    assert costs["kda_intra_a_fwd_rows_kernel"][1] == 2 * 2 * 16 * 32 * (16 + 32 + 64 + 64)
    assert costs["kda_intra_bwd_a_rows_kernel"][1] == 4 * 4 * 2 * 16 * 64 * 32


def test_costs_skip_the_zero_state_terms_of_one_chunk_sequences():
    """Without initial states or final-state grads a one-chunk sequence has no state
    term: intra_bwd_w computes nothing for it (it stores zeros), the backward scan
    nothing; a two-chunk sequence still does."""
    short = roofline.kernel_costs(roofline.Shape(lengths=(30, 64, 1), H=1, HV=1))
    assert short["kda_intra_bwd_w_kernel"][1] == 0 and short["kda_state_bwd_kernel"][1] == 0
    with_states = roofline.kernel_costs(roofline.Shape(lengths=(30, 64, 1), H=1, HV=1, initial_state=True,
                                                       final_state_grad=True))
    assert with_states["kda_intra_bwd_w_kernel"][1] > 0 and with_states["kda_state_bwd_kernel"][1] > 0
    longer = roofline.kernel_costs(roofline.Shape(lengths=(30, 65), H=1, HV=1))
    assert longer["kda_intra_bwd_w_kernel"][1] > 0 and longer["kda_state_bwd_kernel"][1] > 0
    # the output kernel reads Qg only in the second chunk of the 65-token sequence (1 row)
    no_s0 = roofline.kernel_costs(roofline.Shape(lengths=(30, 65), H=1, HV=1))["kda_output_fwd_kernel"][0]
    all_s0 = roofline.kernel_costs(roofline.Shape(lengths=(30, 65), H=1, HV=1, initial_state=True))
    assert all_s0["kda_output_fwd_kernel"][0] - no_s0 == 94 * 128 * 2 + 2 * 128 * 128 * 2
    with pytest.raises(ValueError, match="lengths"):
        roofline.kernel_costs(roofline.Shape(lengths=(), H=1, HV=1))


def test_block_references_count_four_dots_a_slice():
    plain = roofline.kernel_costs(roofline.Shape(lengths=(128,), H=1, HV=1))
    refs = roofline.kernel_costs(roofline.Shape(lengths=(128,), H=1, HV=1, block_refs=1.0))
    for name in ("kda_intra_a_fwd_kernel", "kda_intra_bwd_a_kernel"):
        assert refs[name][1] == 4 * plain[name][1], name


def test_main_writes_the_table_and_the_plot_from_the_kept_times(tmp_path, capsys):
    path = os.path.join(os.path.dirname(__file__), "..", "profiling", "kernel_times.json")
    out = tmp_path / "roofline.png"
    assert roofline.main([path, "--case", "B1-T8192-H16-layer", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| intra_bwd_a_rows | 0.511 |" in text and "**all**" in text
    assert out.stat().st_size > 10_000
    # every row under its ceilings: achieved bytes/s no more than the copy ceiling by
    # more than the measurement's noise (the model counts each tensor once: a lower bound)
    with open(path) as f:
        case = json.load(f)["cases"]["B1-T8192-H16-layer"]
    rows = roofline.rows_for(roofline.shape_of(case), case["ours_ms"])
    assert rows and all(r.tbs <= 1.05 * roofline.COPY_TBS for r in rows)
    with pytest.raises(SystemExit, match="unknown case"):
        roofline.main([path, "--case", "nope"])
