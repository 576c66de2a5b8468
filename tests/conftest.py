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


def _test_settings() -> dict:
    """``KDA_TEST_SETTINGS="NAME=VALUE,..."``: the whole suite under other values of
    kda_op/triton_kernels/settings.py's upper-case settings (say, ones that stay off
    until the GPU has run every test with them on) and of kda_op._contract's storage
    dtypes (BF16_AKK, ...); values are Python literals."""
    import ast

    changes = {}
    for item in filter(None, os.environ.get("KDA_TEST_SETTINGS", "").split(",")):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name.isupper() or _setting_owner(name) is None:
            from kda_op._contract import STORAGE_SETTINGS

            raise pytest.UsageError(f"KDA_TEST_SETTINGS: {item!r} is not NAME=VALUE of a setting in settings.py "
                                    f"or of kda_op._contract's {', '.join(STORAGE_SETTINGS)}")
        changes[name] = ast.literal_eval(value.strip())
    return changes


def _setting_owner(name: str):
    """The module that holds the setting ``name`` (settings.py or kda_op._contract), or None."""
    from kda_op import _contract
    from kda_op.triton_kernels import settings

    if name in _contract.STORAGE_SETTINGS:
        return _contract
    return settings if hasattr(settings, name) else None


def pytest_report_header(config):
    changes = _test_settings()
    return [f"KDA_TEST_SETTINGS: {changes}"] if changes else []


def pytest_configure(config):
    for name, value in _test_settings().items():
        setattr(_setting_owner(name), name, value)
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
