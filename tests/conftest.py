from __future__ import annotations

import sys
from pathlib import Path

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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
