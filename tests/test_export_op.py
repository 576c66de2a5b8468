"""The export op's host code under tracing, checked on any machine: torch.export
and AOTAutograd run on fake CUDA tensors (no GPU needed, no kernel runs), in a
subprocess without TRITON_INTERPRET (under the interpreter a kernel cannot be
captured by wrap_triton). What runs on the GPU is tests/test_cuda.py's and
tests/test_model.py's business."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent(
    """
    import torch
    from torch._dynamo.source import ConstantSource
    from torch._functorch.aot_autograd import aot_export_module
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    import kda_op
    from kda_op import chunk_kda
    from kda_op.triton_kernels import settings

    H, G, K, V = 2, 2, 128, 128
    HV = H * G


    class Step(torch.nn.Module):
        def forward(self, q, k, v, g, beta, h0):
            return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)


    def fake_inputs(mode, B, T):
        with mode:
            return (torch.empty(B, T, H, K, device="cuda", dtype=torch.bfloat16),
                    torch.empty(B, T, H, K, device="cuda", dtype=torch.bfloat16),
                    torch.empty(B, T, HV, V, device="cuda", dtype=torch.bfloat16),
                    torch.empty(B, T, HV, K, device="cuda", dtype=torch.float32),
                    torch.empty(B, T, HV, device="cuda", dtype=torch.bfloat16),
                    torch.empty(B, HV, K, V, device="cuda", dtype=torch.float32))


    def dims(batch, seq):
        return ({0: batch, 1: seq},) * 5 + ({0: batch},)


    # 1. torch.export on CUDA records the export op, and the given ranges stand.
    inputs = fake_inputs(FakeTensorMode(allow_non_fake_inputs=True), 2, 70)
    ep = torch.export.export(Step(), inputs, dynamic_shapes=dims(torch.export.Dim("batch", max=64),
                                                                  torch.export.Dim("seq", max=4096)))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "kda_op.chunk_kda_fwd_export.default" in targets, targets
    assert "kda_op.chunk_kda_fwd.default" not in targets, targets
    assert sorted(r.upper for r in ep.range_constraints.values()) == [64, 4096], ep.range_constraints

    # 2. Without an upper bound, export says which bounds the kernels need.
    try:
        torch.export.export(Step(), inputs, dynamic_shapes=dims(torch.export.Dim("batch"), torch.export.Dim("seq")))
    except Exception as e:  # torch._dynamo.exc.UserError
        text = str(e)
        assert str(65535 // HV) in text and str(65535 * 64) in text, text
    else:
        raise AssertionError("export without bounds passed")

    # 3. What AOTInductor traces: the op decomposed into captured Triton launches,
    # with symbolic batch and length, guarding nothing but those two bounds
    # (e.g. not T > 64, which would break every shorter sequence).
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    env = mode.shape_env

    def sym(name, hint):
        return env.create_symintnode(env.create_symbol(hint, source=ConstantSource(name),
                                                       dynamic_dim=DimDynamic.DYNAMIC), hint=hint)

    sym_inputs = fake_inputs(mode, sym("B", 2), sym("T", 67))
    with mode:
        gm, _ = aot_export_module(ep.module(), sym_inputs, trace_joint=False)
    launches = [n for n in gm.graph.nodes if "triton_kernel_wrapper" in str(n.target)]
    names = [kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__ for n in launches]
    # the export op's forward keeps nothing: gam stays on chip (settings.INTRA_A_GAM_ON_CHIP)
    gam_launch = ["kda_gam_fwd_kernel"] if settings.INTRA_GAM_KERNEL and not settings.INTRA_A_GAM_ON_CHIP else []
    inverses = ["kda_diag_inv_kernel"] if settings.INTRA_DIAG_INV_KERNEL else []
    assert names == gam_launch + ["kda_intra_a_fwd_kernel", "kda_intra_a_fwd_steep_kernel", *inverses,
                                  "kda_intra_wu_fwd_kernel", "kda_state_fwd_kernel", "kda_output_fwd_kernel"], names
    for n in launches:
        assert not isinstance(n.kwargs["kwargs"]["T"], int), "T was specialised"
    warps = [kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).configs[0].num_warps for n in launches]
    assert warps == [settings.GAM_WARPS] * len(gam_launch) + [
        settings.INTRA_A_FWD_WARPS, 4, *[settings.DIAG_INV_WARPS] * len(inverses), settings.INTRA_WU_FWD_WARPS_BF16,
        settings.SCAN_WARPS, settings.OUTPUT_WARPS], warps
    guards = sorted(str(g.expr) for g in env.guards)
    assert all("<=" in g for g in guards) and len(guards) == 2, guards
    print("ok")
    """
)


def test_export_op_traces_with_symbolic_sizes_on_fake_cuda_tensors(tmp_path):
    script = tmp_path / "trace_export_op.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-4000:]
