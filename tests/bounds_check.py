"""A bounds checker for Triton kernels run by the interpreter (TRITON_INTERPRET=1).

The GPU faults on an access outside every allocation; the interpreter, reading
raw CPU addresses, may not. `install(monkeypatch, *host_modules)` makes every
masked load and store of the interpreter check that the addresses it touches
(where the mask is on) lie inside one tensor that the launcher (the host modules
given) allocated or that the test registered with `track`; a violation is
recorded in `violations` and raised (IndexError, which the interpreter
re-raises) instead of performed.
"""

from __future__ import annotations

import numpy as np
import torch


class BoundsChecker:
    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []
        self.violations: list[tuple[str, int, int]] = []
        self.accesses = 0

    def track(self, t: torch.Tensor) -> torch.Tensor:
        if t is not None and t.numel() > 0:
            self.ranges.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
        return t

    def check(self, ptrs, mask, itemsize: int, kind: str) -> None:
        self.accesses += 1
        addresses = ptrs.data.astype(np.uint64)
        on = np.broadcast_to(mask.data, addresses.shape) if mask is not None else np.ones(addresses.shape, bool)
        addresses = addresses[on]
        if addresses.size == 0:
            return
        lo, hi = int(addresses.min()), int(addresses.max()) + itemsize
        # one access (one pointer tile) must stay inside one tensor
        if not any(start <= lo and hi <= end for start, end in self.ranges):
            self.violations.append((kind, lo, hi))
            # refuse the access itself: an out-of-bounds store would corrupt this
            # process's heap before the test could report it
            raise IndexError(f"out-of-bounds {kind}: bytes [{lo:#x}, {hi:#x}) lie in no tracked tensor")

    def install(self, monkeypatch, *host_modules) -> "BoundsChecker":
        import triton.runtime.interpreter as interpreter

        checker = self
        real = torch

        class TrackingTorch:
            """The host modules' `torch` (fwd.py, bwd.py, decode.py), recording what it allocates."""

            def __getattr__(self, name):
                return getattr(real, name)

            @staticmethod
            def empty(*args, **kwargs):
                return checker.track(real.empty(*args, **kwargs))

            @staticmethod
            def empty_like(t, **kwargs):
                return checker.track(real.empty_like(t, **kwargs))

            @staticmethod
            def zeros(*args, **kwargs):
                return checker.track(real.zeros(*args, **kwargs))

            @staticmethod
            def zeros_like(t, **kwargs):
                return checker.track(real.zeros_like(t, **kwargs))

        builder = interpreter.InterpreterBuilder
        load, store = builder.create_masked_load, builder.create_masked_store

        def checked_load(self, ptrs, mask, other, *args):
            itemsize = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
            checker.check(ptrs, mask, itemsize, "load")
            return load(self, ptrs, mask, other, *args)

        def checked_store(self, ptrs, value, mask, *args):
            itemsize = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
            checker.check(ptrs, mask, itemsize, "store")
            return store(self, ptrs, value, mask, *args)

        for module in host_modules:
            monkeypatch.setattr(module, "torch", TrackingTorch())
        monkeypatch.setattr(builder, "create_masked_load", checked_load)
        monkeypatch.setattr(builder, "create_masked_store", checked_store)
        return self
