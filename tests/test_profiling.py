"""profiling/: traces made on CPU carry the op's stage ranges, load through the
TensorBoard profiler plugin's own loader, and the benchmark plot is drawn."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "profiling"))

import plot_benchmark  # noqa: E402
import profile_kda  # noqa: E402
import stream_overlap  # noqa: E402
import scan_beside_intra  # noqa: E402

STAGES_CPU = ("kda_op::fwd::recurrence", "kda_op::bwd::recompute_chunk", "kda_op::bwd::bptt_chunk")

# The plugin loads traces in worker processes (spawn), so it runs in a script of its own.
_LOAD_WITH_PLUGIN = textwrap.dedent(
    """
    import json, sys
    from torch_tb_profiler import io as tbio
    from torch_tb_profiler.profiler.loader import RunLoader

    if __name__ == "__main__":
        run = RunLoader("kda", sys.argv[1], tbio.Cache()).load()
        ops = {}
        for profile in run.get_profiles():
            for row in profile.operation_table_by_name["data"]:
                ops[row["name"]] = row["host_total_duration"]
        print(json.dumps(ops))
    """
)


def _events(trace: Path) -> list[dict]:
    return json.loads(trace.read_text())["traceEvents"]


def _plugin_ops(run_dir: Path, tmp_path: Path) -> dict:
    script = tmp_path / "load_with_plugin.py"
    script.write_text(_LOAD_WITH_PLUGIN)
    done = subprocess.run([sys.executable, str(script), str(run_dir)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_op_trace_has_stage_ranges_and_loads_in_the_plugin(tmp_path):
    pytest.importorskip("torch_tb_profiler")
    prof, trace = profile_kda.run("op", "eager", "cpu", str(tmp_path), seq_len=70, head_dim=8)
    events = _events(trace)
    for stage in STAGES_CPU:
        durations = [e["dur"] for e in events if e.get("name") == stage and e.get("ph") == "X"]
        assert durations and all(d > 0 for d in durations), stage
    ops = _plugin_ops(trace.parent, tmp_path)
    assert ops.get("kda_op::chunk_kda_fwd", 0) > 0 and ops.get("kda_op::chunk_kda_bwd", 0) > 0, sorted(ops)[:20]
    top = prof.key_averages()
    assert any(e.key == "kda_op::chunk_kda_bwd" for e in top)


def test_compiled_layer_trace_has_the_ops(tmp_path):
    _, trace = profile_kda.run("layer", "compiled", "cpu", str(tmp_path), seq_len=40, head_dim=8)
    names = {e.get("name") for e in _events(trace)}
    assert {"kda_op::chunk_kda_fwd", "kda_op::chunk_kda_bwd", "kda_op::fwd::recurrence"} <= names


def test_plot_from_a_results_csv(tmp_path):
    pytest.importorskip("matplotlib")
    results = tmp_path / "results.csv"
    lines = ["# 2026-11-30, a header line as the benchmark writes it", "shape,B,T,H,HV,impl,fwd_ms,fwd_bwd_ms"]
    for T, scale in ((2048, 1), (4096, 2), (8192, 4)):
        for impl, f in (("ours", 1.0), ("fla", 1.2)):
            lines.append(f"B1-T{T}-H16,1,{T},16,16,{impl},{0.1 * scale * f},{0.35 * scale * f}")
    results.write_text("\n".join(lines) + "\n")
    out = plot_benchmark.plot(str(results), str(tmp_path / "bench.png"))
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    with pytest.raises(ValueError, match="no timing rows"):
        empty = tmp_path / "empty.csv"
        empty.write_text("# nothing\nshape,B,T,H,HV,impl,fwd_ms,fwd_bwd_ms\n")
        plot_benchmark.read_results(str(empty))


@pytest.mark.gpu
def test_cuda_trace_has_kernel_stages(tmp_path):
    import torch

    _, trace = profile_kda.run("op", "eager", "cuda", str(tmp_path), seq_len=300, head_dim=64,
                               dtype=torch.bfloat16)
    events = _events(trace)
    names = {e.get("name") for e in events}
    for stage in ("kda_op::fwd::intra", "kda_op::fwd::state_scan", "kda_op::fwd::output",
                  "kda_op::bwd::state_scan", "kda_op::bwd::intra_through_w",
                  "kda_op::bwd::intra", "kda_op::bwd::intra_through_a"):
        assert stage in names, stage
    # the forward keeps its intermediates for the backward, which then recomputes nothing
    assert "kda_op::bwd::intra_recompute" not in names
    kernels = {e.get("name") for e in events if e.get("cat") == "kernel"}
    assert any("kda_intra_a_fwd_kernel" in k for k in kernels), sorted(kernels)[:20]


def test_host_time_runs_the_cuda_host_code_with_stubbed_launches():
    """profiling/host_time.py (the host path alone, no GPU): the chunked kernels' host
    code runs on CPU tensors, every launch of the forward (prep, the varlen index, gate,
    the A's, the diagonal blocks' inverses (settings.INTRA_DIAG_INV_KERNEL), W/U, scan,
    unused state slots, output) and of the backward (the index again)
    stubbed, and it prints both times. fla's layer gate: the A's by row blocks both ways
    (settings.INTRA_A_ROW_PROGRAMS, INTRA_BWD_A_ROW_PROGRAMS), the backward's dg in a
    launch of its own; the backward's reverse scan forms its own A_qk^T dO and Qg^T dO
    (settings.SCAN_BWD_FUSED), so no prep launch before it where the forward kept U'; with
    one value head a key head (16 and 16 here) the backward writes dq and dk itself
    (settings.DIRECT_DQ_DK), so no gva_reduce launch."""
    from kda_op.triton_kernels import settings

    done = subprocess.run([sys.executable, str(REPO / "profiling" / "host_time.py"), "varlen-mixed-T8192"],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("varlen-mixed-T8192 forward: ") and "9 Triton launches" in lines[0], lines
    backward = 8 - bool(settings.DIRECT_DQ_DK)  # the host_time.py subprocess reads the same settings.py
    assert lines[1].startswith("varlen-mixed-T8192 forward_backward: ") and f"{9 + backward} Triton launches" in lines[1], \
        lines
    for line in lines:
        assert float(line.split(": ")[1].split(" ms")[0]) > 0


def test_mma_chain_repro_finds_nothing_wrong_where_the_product_is_right(monkeypatch):
    """profiling/mma_chain_repro.py (a Triton fault's minimal kernel, for the GPU): under the
    interpreter, whose products are right, it reports no wrong row and two equal runs at each
    N, so a wrong row it reports on a GPU is the compiled kernel's; and a product it is
    handed wrong (the kernel's output overwritten in part) shows as those rows."""
    import os

    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the harness check runs under the interpreter")
    import mma_chain_repro

    for N in (16, 32):
        line = mma_chain_repro.check(N, 4, 2)
        assert "wrong rows -," in line and "runs agree True" in line, line
    kernel = mma_chain_repro.mma_chain_kernel

    class RowsOverwritten:  # the kernel as launched, then rows 16.. of every chunk set to 1e3
        def __getitem__(self, grid):
            def launch(a, b, c, out, *args, **kw):
                kernel[grid](a, b, c, out, *args, **kw)
                out[:, 16:] = 1e3
            return launch

    monkeypatch.setattr(mma_chain_repro, "mma_chain_kernel", RowsOverwritten())
    line = mma_chain_repro.check(32, 4, 2)
    assert "wrong rows 16..63 (48)" in line, line


def test_stream_overlap_counts_only_time_two_streams_share():
    """profiling/stream_overlap.py's arithmetic: a stream's own kernels that touch or nest
    count once in its busy time; overlap is the time two streams run at once, not the sum of
    their busy times less the span (a gap between kernels is neither busy nor overlapped)."""
    s = stream_overlap.overlap_summary({7: [(0.0, 10.0), (5.0, 12.0), (30.0, 31.0)], 9: [(8.0, 20.0), (21.0, 22.0)]})
    assert s["busy_7"] == 13.0 and s["busy_9"] == 13.0
    assert s["span"] == 31.0
    assert s["busy"] == 20.0 + 1.0 + 1.0  # 0-20, 21-22, 30-31
    assert s["overlap"] == 4.0  # 8-12
    # kernels that meet end to start on two streams do not overlap
    assert stream_overlap.overlap_summary({1: [(0.0, 5.0)], 2: [(5.0, 9.0)]})["overlap"] == 0.0
    assert stream_overlap.overlap_summary({})["busy"] == 0.0
    with pytest.raises(ValueError, match="stream 3"):
        stream_overlap.overlap_summary({3: [(2.0, 1.0)]})


def test_scan_beside_intra_reads_the_shape_names():
    """profiling/scan_beside_intra.py's shapes (ncu_stages.parse_shape): the benchmark's
    names, HV = H where absent; anything else refused by name."""
    assert scan_beside_intra.parse_shape("B2-T8192-H8-HV32") == (2, 8192, 8, 32)
    assert scan_beside_intra.parse_shape("B8-T8192-H16") == (8, 8192, 16, 16)
    for bad in ("B2-T8192", "b2-T8192-H8", "B2-T8192-H8-HV"):
        with pytest.raises(SystemExit, match="--shape"):
            scan_beside_intra.parse_shape(bad)
