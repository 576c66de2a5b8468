from __future__ import annotations

import os
import sys
from pathlib import Path

# Without a GPU the Triton kernels run in Triton's interpreter, on CPU tensors.
# It must be chosen before triton is first imported.
_HAS_CUDA_DRIVER = os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl")
if not _HAS_CUDA_DRIVER:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import torch._functorch.config
import torch._inductor.config

sys.path.insert(0, str(Path(__file__).parent))

# Inductor's on-disk caches key on the traced graph, not on the fake kernels'
# code: after a change to a fake kernel they can serve a stale compiled graph.
# Tests compile afresh.
torch._inductor.config.fx_graph_cache = False
torch._functorch.config.enable_autograd_cache = False


def pytest_configure(config):
    if os.environ.get("TRITON_INTERPRET") == "1":
        from kda_op._compat import interpreter_numpy_problem

        try:
            problem = interpreter_numpy_problem()
        except ImportError:  # no triton: the kernel tests skip themselves
            return
        if problem is not None:
            pytest.exit(problem, returncode=pytest.ExitCode.USAGE_ERROR)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
