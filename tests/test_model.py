"""The KDA layer and the small LM: incremental decoding, torch.compile of the
whole model with zero graph breaks, torch.export, AOTInductor in a fresh
process, and a training run whose loss falls."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from kda_op.nn import KDALanguageModel, KimiDeltaAttention
from kda_op.train_demo import MarkovData

VOCAB = 32
REPO = Path(__file__).resolve().parents[1]


def _model(seed: int = 0) -> KDALanguageModel:
    torch.manual_seed(seed)
    return KDALanguageModel(VOCAB, hidden_size=32, num_layers=2, num_heads=2, head_dim=8, num_v_heads=4)


def test_layer_shapes_state_and_gva_check():
    layer = KimiDeltaAttention(hidden_size=24, num_heads=2, head_dim=8, num_v_heads=4, expand_v=0.75)
    y, (rec, cq, ck, cv) = layer(torch.randn(3, 11, 24))
    assert y.shape == (3, 11, 24)
    assert rec.shape == (3, 4, 8, 6) and rec.dtype == torch.float32
    assert cq.shape == ck.shape == (3, 16, 3) and cv.shape == (3, 24, 3)
    with pytest.raises(ValueError, match="num_v_heads"):
        KimiDeltaAttention(hidden_size=24, num_heads=2, head_dim=8, num_v_heads=3)


def test_incremental_decoding_matches_full_forward():
    model = _model().eval()
    ids = torch.randint(0, VOCAB, (2, 23))
    with torch.no_grad():
        full, _ = model(ids)
        logits, states = model(ids[:, :15])  # prefill
        steps = [logits]
        for t in range(15, 23):  # then one token at a time, through fused_recurrent_kda
            logits, states = model(ids[:, t : t + 1], states, decode=True)
            steps.append(logits)
    # fp32; the chunked and the token-by-token paths order sums differently.
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_compile_model_fullgraph_no_graph_breaks_loss_and_grads_equal_eager():
    torch._dynamo.reset()
    counters.clear()
    eager_model = _model()
    compiled_model = _model()
    compiled = torch.compile(compiled_model, fullgraph=True)
    tokens = MarkovData(VOCAB, seed=1).batch(4, 40)

    def loss_of(m):
        logits, _ = m(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    loss_eager, loss_compiled = loss_of(eager_model), loss_of(compiled)
    loss_eager.backward()
    loss_compiled.backward()
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    # inductor fuses and reorders the fp32 math around the ops
    torch.testing.assert_close(loss_compiled, loss_eager, rtol=1e-5, atol=1e-5)
    for (name, p_e), p_c in zip(eager_model.named_parameters(), compiled_model.parameters()):
        torch.testing.assert_close(p_c.grad, p_e.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def _export(model):
    batch = torch.export.Dim("batch", min=1, max=1024)
    seq = torch.export.Dim("seq", min=1, max=8192)
    example = torch.randint(0, VOCAB, (2, 70))
    return torch.export.export(model, (example,), dynamic_shapes=({0: batch, 1: seq},))


def test_export_dynamic_save_load(tmp_path):
    model = _model().eval()
    ep = _export(model)
    path = tmp_path / "kda_lm.pt2"
    torch.export.save(ep, path)
    loaded = torch.export.load(path).module()
    for B, T in [(2, 70), (5, 3), (1, 130)]:
        ids = torch.randint(0, VOCAB, (B, T))
        with torch.no_grad():
            got, states = loaded(ids)
            want, want_states = model(ids)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(states[0][0], want_states[0][0], rtol=1e-5, atol=1e-5)


@functools.lru_cache(maxsize=None)
def _links_libstdcxx_dynamically(cxx: str) -> bool:
    """Whether ``cxx -shared`` leaves libstdc++ a shared library of the result."""
    with tempfile.TemporaryDirectory() as d:
        src, lib = os.path.join(d, "probe.cpp"), os.path.join(d, "probe.so")
        Path(src).write_text("#include <locale>\nbool probe() { return std::has_facet<std::ctype<char>>(std::locale()); }\n")
        try:
            subprocess.run([cxx, "-shared", "-fPIC", src, "-o", lib], check=True, capture_output=True, timeout=120)
            dynamic = subprocess.run(["readelf", "-d", lib], check=True, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return False
    return "libstdc++" in dynamic.stdout


def _aoti_package(ep, package_path: str) -> str:
    """aoti_compile_and_package with a C++ compiler that links libstdc++ dynamically.

    Inductor compiles the model .so with $CXX. A compiler that links libstdc++
    statically (the GPU image sets CXX=/opt/gcc/bin/g++, which does) puts a second
    copy of the C++ runtime in the .so; loaded beside torch's libstdc++.so.6 the
    two copies' locale facets mix, and the std::regex of AOTI's parse_device_str
    crashes while the package loads: SIGSEGV with GCC 13 (torch 2.11), std::bad_cast
    with GCC 12. Any model, kda_op or not. So take the first of $CXX, g++ and c++
    that links it dynamically; where none does, inductor's own choice."""
    configs = {}
    for cxx in (os.environ.get("CXX"), "g++", "c++"):
        if cxx and _links_libstdcxx_dynamically(cxx):
            configs = {"cpp.cxx": (None, cxx)}
            break
    return torch._inductor.aoti_compile_and_package(ep, package_path=package_path, inductor_configs=configs)


def _run_fresh(script, package, ids_path, mode, env):
    """The package in a new interpreter; faulthandler prints where a crash happens,
    and a hang ends in TimeoutExpired (with the output so far) rather than in the
    runner's limit."""
    return subprocess.run([sys.executable, "-X", "faulthandler", str(script), package, str(ids_path), mode],
                          capture_output=True, text=True, env=env, timeout=600)


_FRESH = textwrap.dedent(
    """
    import sys, torch
    if sys.argv[3] == "import":
        import kda_op  # registers the ops the package calls
    package = torch._inductor.aoti_load_package(sys.argv[1])
    logits, states = package(torch.load(sys.argv[2]))
    torch.save(logits, sys.argv[2] + ".out")
    """
)


def _check_package_in_fresh_process(model, package, ids, tmp_path, tol, needs_import: bool):
    """The package, loaded in a fresh process that imports kda_op, gives the eager
    model's logits on ids. Without the import: where ``needs_import`` (CPU: the
    package calls the op through the dispatcher, and kda_op's ops are Python custom
    ops with no C++ schema, DESIGN.md section 5) it fails naming kda_op; otherwise
    (CUDA: the export op's kernels are compiled into the package) it gives the same
    logits."""
    ids_path = tmp_path / "ids.pt"
    torch.save(ids, ids_path)
    script = tmp_path / "run_package.py"
    script.write_text(_FRESH)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with torch.no_grad():
        want, _ = model(ids)
    run = _run_fresh(script, package, ids_path, "import", env)
    assert run.returncode == 0, (run.returncode, run.stderr[-3000:])
    torch.testing.assert_close(torch.load(str(ids_path) + ".out").to(want.device), want, rtol=tol, atol=tol)
    run = _run_fresh(script, package, ids_path, "no-import", env)
    if needs_import:
        assert run.returncode != 0 and "kda_op" in run.stderr, (run.returncode, run.stderr[-2000:])
    else:
        assert run.returncode == 0, (run.returncode, run.stderr[-3000:])
        torch.testing.assert_close(torch.load(str(ids_path) + ".out").to(want.device), want, rtol=tol, atol=tol)


def test_aoti_package_runs_in_a_fresh_process(tmp_path):
    model = _model().eval()
    package = _aoti_package(_export(model), str(tmp_path / "kda_lm_aoti.pt2"))
    _check_package_in_fresh_process(model, package, torch.randint(0, VOCAB, (3, 41)), tmp_path, tol=1e-5,
                                    needs_import=True)


def test_training_loss_falls():
    torch.manual_seed(0)
    model = _model()
    data = MarkovData(VOCAB, seed=2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        tokens = data.batch(8, 32)
        logits, _ = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.5, losses


@pytest.mark.gpu
def test_cuda_model_compile_fullgraph_equals_eager():
    """On the GPU: the compiled training step's loss and grads equal eager ones."""
    torch._dynamo.reset()
    eager_model, compiled_model = _model().cuda(), _model().cuda()
    compiled = torch.compile(compiled_model, fullgraph=True)
    tokens = MarkovData(VOCAB, seed=3).batch(4, 100).cuda()

    def loss_of(m):
        logits, _ = m(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    loss_e, loss_c = loss_of(eager_model), loss_of(compiled)
    loss_e.backward()
    loss_c.backward()
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-4, atol=1e-4)
    for p_e, p_c in zip(eager_model.parameters(), compiled_model.parameters()):
        torch.testing.assert_close(p_c.grad, p_e.grad, rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
def test_cuda_model_export_and_aoti(tmp_path):
    """On the GPU: torch.export records the KDA forward as the triton_op
    ``kda_op::chunk_kda_fwd_export``; the AOTInductor package compiles its kernels
    in, so a fresh process runs it without importing kda_op, equal to eager (and
    with the import too). Split from the compile test so that a runner's time limit
    shows which part is slow (the combined test ran past 150 s)."""
    model = _model().cuda().eval()
    batch = torch.export.Dim("batch", min=1, max=1024)
    seq = torch.export.Dim("seq", min=1, max=8192)
    ep = torch.export.export(model, (torch.randint(0, VOCAB, (2, 70), device="cuda"),),
                             dynamic_shapes=({0: batch, 1: seq},))
    targets = {str(node.target) for node in ep.graph.nodes if node.op == "call_function"}
    assert "kda_op.chunk_kda_fwd_export.default" in targets, sorted(targets)
    assert "kda_op.chunk_kda_fwd.default" not in targets
    package = _aoti_package(ep, str(tmp_path / "kda_lm_cuda.pt2"))
    ids = torch.randint(0, VOCAB, (3, 41), device="cuda")
    _check_package_in_fresh_process(model, package, ids, tmp_path, tol=1e-4, needs_import=False)
