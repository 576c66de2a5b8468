"""kda_op._compat: the shims between the tested torch and Triton versions."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")
numpy = pytest.importorskip("numpy")

from kda_op import _compat  # noqa: E402


# Compiled in a subprocess: where there is no GPU, conftest sets TRITON_INTERPRET,
# whose triton.jit cannot compile.
_COMPILE_A_KERNEL = """
import sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

@triton.jit
def _copy(x, y, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(y + o, tl.load(x + o))

src = ASTSource(fn=_copy, signature={"x": "*fp32", "y": "*fp32", "N": "constexpr"}, constexprs={"N": 16})
sys.stdout.write(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"])
"""


def test_ptxas_accepts_the_ptx_of_this_triton(tmp_path):
    """The ptxas that _compat names assembles what this Triton emits for sm_90a
    (Triton 3.9's PTX 9.4 is refused by the CUDA 12.9 ptxas it also bundles)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = tmp_path / "compile_a_kernel.py"  # triton.jit reads the kernel's source file
    script.write_text(_COMPILE_A_KERNEL)
    compiled = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    assert compiled.stdout.startswith("//") and ".target sm_90a" in compiled.stdout
    path = _compat.ptxas_path(90)
    assert os.access(path, os.X_OK), path
    run = subprocess.run([path, "--gpu-name=sm_90a", "-", "-o", os.devnull], input=compiled.stdout,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert os.access(_compat.cuobjdump_path(), os.X_OK)


@pytest.mark.parametrize("triton_version,numpy_version,refused", [
    ("3.6.0", "2.3.5", False),
    ("3.6.0", "2.4.6", True),
    ("3.9.0", "2.4.6", False),
    ("3.10.1", "2.5.0", False),
])
def test_interpreter_numpy_problem(monkeypatch, triton_version, numpy_version, refused):
    monkeypatch.setattr(triton, "__version__", triton_version)
    monkeypatch.setattr(numpy, "__version__", numpy_version)
    problem = _compat.interpreter_numpy_problem()
    assert (problem is not None) == refused
    if refused:
        assert triton_version in problem and numpy_version in problem


def test_wrap_triton_leaves_an_interpreted_kernel_as_it_is():
    """Under TRITON_INTERPRET=1 (how CPU CI runs the kernels) ``@triton.jit`` gives an
    InterpretedFunction: the shim hands it back unwrapped on every torch (torch 2.11's
    own wrap_triton raised for it; torch 2.13's returns it as it is)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter's kernels only")
    from kda_op.triton_kernels.zero_slots import kda_zero_slots_kernel

    assert _compat.wrap_triton(kda_zero_slots_kernel) is kda_zero_slots_kernel
    from kda_op.triton_kernels import _host

    # the traced launcher only fills in the parameters a call leaves to their defaults
    assert _host._kernel(kda_zero_slots_kernel, traced=True).launcher is kda_zero_slots_kernel


def _sign_of_exporting(x):
    return x + 1 if _compat.is_exporting() else x - 1


def test_is_exporting_only_under_torch_export():
    """_compat.is_exporting() is False eagerly and under torch.compile (torch 2.11's
    dynamo folds torch.compiler.is_exporting() to True there, which sent compiled
    training through the export op) and True under torch.export, strict or not."""
    import torch

    class Step(torch.nn.Module):
        def forward(self, x):
            return _sign_of_exporting(x)

    x = torch.randn(3)
    assert torch.equal(_sign_of_exporting(x), x - 1)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(_sign_of_exporting, fullgraph=True)(x), x - 1)
    assert torch.equal(torch.compile(_sign_of_exporting, fullgraph=True, dynamic=True)(x), x - 1)
    for strict in (False, True):
        ep = torch.export.export(Step(), (x,), strict=strict)
        assert torch.equal(ep.module()(x), x + 1), f"strict={strict}"
    # the compiled function is not stuck with what export saw, nor export with compile's
    assert torch.equal(torch.compile(_sign_of_exporting, fullgraph=True)(x), x - 1)
