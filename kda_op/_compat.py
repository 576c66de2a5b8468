"""What differs between the torch and Triton versions kda-op is tested on.

Tested: torch 2.11 with Triton 3.6 (the H200 machine and CPU CI), torch 2.15
with Triton 3.9 (CPU CI; torch 2.13 with Triton 3.9 before 2026-12-05, on this
project's development machines). Each shim says which versions it
bridges. Kernel code itself is written in forms every tested Triton accepts
(e.g. ``intra_a_fwd.py``'s block-shaped row mask), so it needs no shim here.
"""

from __future__ import annotations

import functools

import torch


def _major_minor(version: str) -> tuple[int, int]:
    """``"3.6.0"`` -> (3, 6)."""
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def ptxas_path(arch: int) -> str:
    """The ptxas that Triton itself uses for ``sm_<arch>``.

    Triton 3.6 bundles ``bin/ptxas`` (CUDA 12.8) for sm_90 and ``ptxas-blackwell``
    for sm_100+; Triton 3.9 emits PTX 9.4, which only its ``ptxas-blackwell``
    (CUDA 13) accepts, and picks that one for sm_90 too. Triton's own chooser
    (``get_ptxas``, in both) answers for whichever is installed.
    """
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(arch).path


def cuobjdump_path() -> str:
    """Triton's bundled cuobjdump (``knobs.nvidia.cuobjdump`` in 3.6 and 3.9)."""
    from triton import knobs

    return knobs.nvidia.cuobjdump.path


def interpreter_numpy_problem() -> str | None:
    """Why Triton's interpreter cannot run these kernels with the installed numpy,
    or ``None`` when it can.

    Triton 3.6's interpreter hands a kernel's scalar arguments over as 1-element
    arrays and takes ``int()`` of them for a runtime loop bound (``range(T)``):
    numpy 2.3 warns about that, numpy 2.4 refuses it ('only 0-dimensional arrays
    can be converted to Python scalars'). Triton 3.9's interpreter does not.
    There is no kernel-side form that avoids it, so the tests refuse to start on
    that pair with this message instead of failing one by one.
    """
    import numpy
    import triton

    if _major_minor(triton.__version__) < (3, 7) and _major_minor(numpy.__version__) >= (2, 4):
        return (f"Triton {triton.__version__}'s interpreter needs numpy < 2.4 (installed: {numpy.__version__}); "
                f"install numpy<2.4 or Triton >= 3.9 (pyproject.toml, .ci/envs/)")
    return None


@functools.cache
def fences_wgmma_after_cp_async() -> bool:
    """Whether Triton puts a proxy fence between every shared-memory tile that
    ``cp.async`` wrote (the pipeliner's loads ahead: the generic proxy) and a wgmma that
    reads it (the async proxy), as the PTX memory model asks.

    Triton 3.6 to 3.8 leave it out where such a tile feeds a wgmma whose other operand
    comes from registers or after a transpose, with no shared-memory store of their own
    before it to bring a fence in (sm_90a TTGIR: the fused backward scan under
    settings.SCAN_AQK_ROW_MASK, intra_bwd's dO U'^T under settings.INTRA_BWD_BF16_DAQK
    or on fp16 inputs); the wgmma may then read a stale tile. Triton 3.9 fences them
    (``tests/test_kernel_resources.py`` checks every kernel's TTGIR). The host takes
    those forms only where this is true (thirty-second session, benchmarks/NOTES.md).
    """
    import triton

    return _major_minor(triton.__version__) >= (3, 9)


def all_gather_plain():
    """torch's all-gather of functional collectives without autograd:
    ``all_gather_single`` where it exists (torch 2.13 deprecates the other name),
    else ``all_gather_tensor``."""
    import torch.distributed._functional_collectives as fc

    return getattr(fc, "all_gather_single", None) or fc.all_gather_tensor


def all_gather_autograd():
    """torch's differentiable all-gather of functional collectives:
    ``all_gather_single_autograd`` where it exists (torch 2.13, which deprecates the
    other name), else ``all_gather_tensor_autograd`` (the name in older torch;
    torch 2.11 on the H200 machine has not been checked for the newer one)."""
    import torch.distributed._functional_collectives as fc

    return getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd


def is_exporting() -> bool:
    """Whether torch.export is tracing: ``torch.compiler.is_exporting()``, except that
    torch 2.11's dynamo folds that call to True in every trace, torch.compile's too
    (torch/_dynamo/variables/torch.py lists it among the functions that are True while
    compiling; torch 2.13 answers False there), which sent compiled training on CUDA
    through the export forward op (nothing kept for the backward, plain torch ops for
    the q/k l2 norm). The flag that torch.export sets (torch/_export/utils.py) and that
    the public function returns, read directly, is right under both: dynamo reads a
    module attribute's value at trace time (and guards on it)."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    if isinstance(flag, bool):
        return flag
    return torch.compiler.is_exporting()


def wrap_triton(fn):
    """``torch.library.wrap_triton(fn)``, except that a kernel of Triton's interpreter
    (TRITON_INTERPRET=1 makes ``@triton.jit`` give an ``InterpretedFunction``, which
    launches eagerly on CPU tensors) comes back as it is: torch 2.13 does that itself,
    torch 2.11 raises 'wrap_triton only works on functions annotated with triton.jit'."""
    from torch.library import wrap_triton as torch_wrap_triton
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(fn, InterpretedFunction):
        return fn
    return torch_wrap_triton(fn)



class _ContiguousGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def contiguous_grad(x):
    """``x`` unchanged, its incoming gradient made contiguous on the way back. torch
    2.11's all-gather backward (a reduce-scatter) refuses a non-contiguous gradient
    ('Expected input.is_contiguous()'), as a ``.sum(0)`` over the gathered ranks
    hands it (an expand); torch 2.13 copies it itself."""
    return _ContiguousGrad.apply(x)


# torch has no public query of whether a profiler records; record_function asks this one
# (torch 2.11 and 2.13). Where it is missing, "always": the ranges are then always recorded.
_profiler_query = getattr(torch._C._autograd, "_profiler_enabled", lambda: True)


def profiler_enabled() -> bool:
    """Whether a torch profiler is recording now (True where torch cannot say)."""
    return bool(_profiler_query())
