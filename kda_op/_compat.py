"""What differs between the torch and Triton versions kda-op is tested on.

Tested: torch 2.11 with Triton 3.6 (the H200 machine), torch 2.13 with Triton
3.6 and with Triton 3.9 (CPU CI, both). Each shim says which versions it
bridges. Kernel code itself is written in forms every tested Triton accepts
(e.g. ``intra_a_fwd.py``'s block-shaped row mask), so it needs no shim here.
"""

from __future__ import annotations


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
