"""Decode benchmark: kda_op.fused_recurrent_kda against fla's fused_recurrent_kda
at T = 1 (DESIGN.md section 4: B = 64 and B = 256, HV = 32, H = 16, K = V = 128,
bf16 inputs, fp32 state).

Reports medians of triton.testing.do_bench of an eager step and of the replay of
a captured step (CUDA graph: what serving loops run; small eager steps are bound
by host-side dispatch), ours/fla for both, and the state bytes moved per second
under replay (the fp32 state read once and written once) against the
device-to-device copy ceiling measured in the same process. Needs CUDA and fla.

    python benchmarks/bench_decode.py [--impl ours] [--out benchmarks/RESULTS_decode.md]
        [--settings "RECURRENT_BV=16" "RECURRENT_WARPS=2"] [--inplace-probe]

--settings: after the table, ours alone under other values of settings.py's
RECURRENT_* settings (comma-separated NAME=VALUE, one string per run), each
checked against the defaults' output and final state.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import sys

import torch
import torch.nn.functional as F
import triton
import triton.testing

from bench_chunk_kda import setting_value

SHAPES = [(64, 32, 16), (256, 32, 16)]  # B, HV, H
K = V = 128


def copy_ceiling_bytes_per_s() -> float:
    src = torch.empty(2 * 1024**3 // 4, device="cuda", dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * 4 / (ms * 1e-3)  # bytes read plus bytes written


def same_size_copy_ms(numel: int) -> float:
    """Graph-replay median of a copy kernel over ``numel`` fp32 values (``torch.mul``
    by 1 into another buffer): the bytes a decode step's states move (read once,
    written once) at the size of the step, with the launch, ramp-up and tail that a
    kernel of that size pays too. The 2 GiB copy of copy_ceiling_bytes_per_s pays
    them once for far more bytes. Not ``copy_``: captured in a graph, it became a
    memcpy node that moved 1.07 GB at 2.7 TB/s on the H200 (2026-12-04), slower
    than any kernel."""
    src = torch.empty(numel, device="cuda", dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    torch.mul(src, 1.0, out=dst)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.mul(src, 1.0, out=dst)
    return triton.testing.do_bench(graph.replay, warmup=50, rep=300, return_mode="median")


def make_inputs(B, HV, H, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dt = torch.bfloat16

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    q = randn(B, 1, H, K).to(dt)
    k = F.normalize(randn(B, 1, H, K), dim=-1).to(dt)
    v = randn(B, 1, HV, V).to(dt)
    g = F.logsigmoid(randn(B, 1, HV, K)).clamp_min(-5.0)
    beta = torch.sigmoid(torch.rand(B, 1, HV, device="cuda", generator=gen)).to(dt)
    h0 = randn(B, HV, K, V)
    return q, k, v, g, beta, h0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", choices=["both", "ours"], default="both")
    parser.add_argument("--out", default=None, help="also write the table (markdown) to this file")
    parser.add_argument("--settings", nargs="*", default=[],
                        help="settings.py RECURRENT_* settings to time ours under after the table")
    parser.add_argument("--inplace-probe", action="store_true",
                        help="also time our kernel writing the final state over the initial one")
    args = parser.parse_args()

    from kda_op import fused_recurrent_kda as ours

    impls = {"ours": lambda q, k, v, g, beta, h0: ours(q, k, v, g, beta, initial_state=h0, output_final_state=True)}
    fla_version = "not run"
    if args.impl == "both":
        import fla
        from fla.ops.kda import fused_recurrent_kda as fla_fused

        # fla's public function writes a fresh final state (inplace_final_state=False), as ours.
        impls["fla"] = lambda q, k, v, g, beta, h0: fla_fused(
            q, k, v, g, beta, initial_state=h0, output_final_state=True)
        fla_version = getattr(fla, "__version__", "?")

    ceiling = copy_ceiling_bytes_per_s()
    print(f"copy ceiling: {ceiling / 1e12:.2f} TB/s", flush=True)
    rows = []
    for B, HV, H in SHAPES:
        inputs = make_inputs(B, HV, H)
        state_bytes = 2 * B * HV * K * V * 4
        res, graphed = {}, {}
        with torch.no_grad():
            for label, fn in impls.items():
                fn(*inputs)  # compiles (fla: autotunes)
                res[label] = triton.testing.do_bench(lambda fn=fn: fn(*inputs), warmup=50, rep=300, return_mode="median")
                # A serving loop replays a captured decode step: that time is the GPU's alone,
                # without the host-side dispatch that bounds small eager steps.
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn(*inputs)
                graphed[label] = triton.testing.do_bench(graph.replay, warmup=50, rep=300, return_mode="median")
                print(f"B={B} HV={HV}: {label}: eager {res[label] * 1e3:.1f} us, CUDA graph {graphed[label] * 1e3:.1f} us",
                      flush=True)
        nan = float("nan")
        copy_ms = same_size_copy_ms(B * HV * K * V)
        print(f"B={B} HV={HV}: a copy kernel over the state's bytes, CUDA graph {copy_ms * 1e3:.1f} us", flush=True)
        rows.append((B, HV, H, res["ours"], res.get("fla", nan), graphed["ours"], graphed.get("fla", nan),
                     state_bytes / (graphed["ours"] * 1e-3), copy_ms))

    lines = ["| B | HV | H | eager ours us | eager fla us | eager ours/fla | graph ours us | graph fla us "
             "| graph ours/fla | ours state TB/s (graph) | of copy ceiling | same-size copy us (graph) "
             "| same-size copy's share of ours |", "|" + "---|" * 13]
    for B, HV, H, eo, ef, go, gf, bw, cp in rows:
        lines.append(f"| {B} | {HV} | {H} | {eo * 1e3:.1f} | {ef * 1e3:.1f} | {eo / ef:.2f} | {go * 1e3:.1f} "
                     f"| {gf * 1e3:.1f} | {go / gf:.2f} | {bw / 1e12:.2f} | {bw / ceiling:.0%} | {cp * 1e3:.1f} "
                     f"| {cp / go:.0%} |")
    meta = (f"{datetime.date.today().isoformat()}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"triton {triton.__version__}, fla {fla_version}; copy ceiling {ceiling / 1e12:.2f} TB/s; T = 1, "
            f"K = V = {K}, bf16 inputs, fp32 state")
    table = "\n".join(lines)
    print(meta)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"{meta}\n\nCommand: `python benchmarks/bench_decode.py --impl {args.impl} --out {args.out}`\n\n{table}\n")
    if args.settings:
        time_settings(impls["ours"], args.settings, ceiling)
    if args.inplace_probe:
        time_inplace_probe(ceiling)
    return 0


def time_inplace_probe(ceiling) -> None:
    """Our recurrent kernel writing the final state over the initial one (no
    second state buffer; what fla's lower-level function does by default, not
    its public one): whether an in-place decode op would be faster. The kernel's
    host function is called directly (the ops return a new state)."""
    from kda_op.triton_kernels import kda_recurrent_fwd_triton

    for B, HV, H in SHAPES:
        q, k, v, g, beta, h0 = make_inputs(B, HV, H)
        state_bytes = 2 * B * HV * K * V * 4
        _, want = kda_recurrent_fwd_triton(q, k, v, g, beta, None, h0.clone())
        state = h0.clone()
        _, got = kda_recurrent_fwd_triton(q, k, v, g, beta, None, state, final_state_out=state)
        diff = ((got - want).norm() / want.norm()).item()

        def step():  # the state decays step after step: the same bytes each time
            kda_recurrent_fwd_triton(q, k, v, g, beta, None, state, final_state_out=state)

        eager = triton.testing.do_bench(step, warmup=50, rep=300, return_mode="median")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        replay = triton.testing.do_bench(graph.replay, warmup=50, rep=300, return_mode="median")
        print(f"B={B} HV={HV} [in-place final state]: eager {eager * 1e3:.1f} us, CUDA graph {replay * 1e3:.1f} us, "
              f"{state_bytes / (replay * 1e-3) / ceiling:.0%} of the copy ceiling, "
              f"rel diff to a fresh final state {diff:.1e}", flush=True)


@contextlib.contextmanager
def recurrent_settings(setting: str):
    """settings.py's RECURRENT_* settings changed as ``setting`` says (comma-separated
    NAME=VALUE), the others at their defaults; all restored on exit."""
    from kda_op.triton_kernels import settings as S

    defaults = {n: getattr(S, n) for n in dir(S) if n.startswith("RECURRENT_")}
    try:
        for item in filter(None, setting.split(",")):
            n, value = item.split("=")
            if n not in defaults:
                raise SystemExit(f"unknown setting {n!r}; settings.py has {sorted(defaults)}")
            setattr(S, n, setting_value(defaults[n], value))
        yield
    finally:
        for n, value in defaults.items():
            setattr(S, n, value)


def time_settings(ours, settings, ceiling) -> None:
    """Ours under other launch settings: eager and graph-replay medians, state
    TB/s, and the largest difference of o and the final state to the defaults."""
    for B, HV, H in SHAPES:
        inputs = make_inputs(B, HV, H)
        state_bytes = 2 * B * HV * K * V * 4
        with torch.no_grad():
            reference = [t.float().clone() for t in ours(*inputs)]
            for setting in settings:
                with recurrent_settings(setting):
                    got = [t.float() for t in ours(*inputs)]
                    diff = max(((a - b).norm() / b.norm()).item() for a, b in zip(got, reference))
                    eager = triton.testing.do_bench(lambda: ours(*inputs), warmup=50, rep=300, return_mode="median")
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        ours(*inputs)
                    replay = triton.testing.do_bench(graph.replay, warmup=50, rep=300, return_mode="median")
                print(f"B={B} HV={HV} [{setting}]: eager {eager * 1e3:.1f} us, CUDA graph {replay * 1e3:.1f} us, "
                      f"{state_bytes / (replay * 1e-3) / ceiling:.0%} of the copy ceiling, "
                      f"max rel diff to defaults {diff:.1e}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
