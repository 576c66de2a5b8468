"""Benchmark: kda_op.chunk_kda against flash-linear-attention's chunk_kda.

Same process, same inputs, triton.testing.do_bench medians; prints a table of
milliseconds and ours/fla ratios (lower is faster) for the forward and for
forward+backward, on the standard shapes of DESIGN.md section 4 (bf16, K = V = 128,
k l2-normalised, g = logsigmoid(randn) clamped to >= -5 in fp32,
beta = sigmoid(rand), fp32 initial state). Needs a CUDA GPU and fla.

    python benchmarks/bench_chunk_kda.py [--out benchmarks/RESULTS.md]
    python benchmarks/bench_chunk_kda.py --mode layer    # fla's layer flags on (LAYER_FLAGS)
    python benchmarks/bench_chunk_kda.py --mode varlen   # packed sequences, layer flags
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import re
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
import triton.testing

SHAPES = [  # name, B, T, H, HV
    ("B1-T8192-H16", 1, 8192, 16, 16),
    ("B2-T8192-H8-HV32", 2, 8192, 8, 32),
    # the speed issue's: a GPU-bound batch, and a long single sequence
    ("B8-T8192-H16", 8, 8192, 16, 16),
    ("B1-T32768-H16", 1, 32768, 16, 16),
]
K = V = 128


def make_inputs(B, T, H, HV, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dt = torch.bfloat16

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    q = randn(B, T, H, K).to(dt)
    k = F.normalize(randn(B, T, H, K), dim=-1).to(dt)
    v = randn(B, T, HV, V).to(dt)
    g = F.logsigmoid(randn(B, T, HV, K)).clamp_min(-5.0)
    beta = torch.sigmoid(torch.rand(B, T, HV, device="cuda", generator=gen)).to(dt)
    h0 = randn(B, HV, K, V)
    do = randn(B, T, HV, V).to(dt)
    return [x.requires_grad_(True) for x in (q, k, v, g, beta, h0)], do


# fla's layer as Kimi-Linear-style models train with it (fla/layers/kda.py): raw q,
# k, gate and beta logits, every in-kernel option on, no states.
LAYER_FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                   safe_gate=True, lower_bound=-5.0)
VARLEN_H = 16


def make_layer_inputs(B, T, H, HV, seed=0):
    """Layer-style inputs: what fla's layer hands chunk_kda (bf16 projections, fp32
    A_log [HV] and dt_bias [HV * K]); the parameters take grads too."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    dt = torch.bfloat16
    q, k, v, g, beta = (randn(B, T, H, K).to(dt), randn(B, T, H, K).to(dt), randn(B, T, HV, V).to(dt),
                        randn(B, T, HV, K).to(dt), randn(B, T, HV).to(dt))
    A_log = torch.empty(HV, device="cuda").uniform_(1, 16, generator=gen).log()
    dt_bias = randn(HV * K) * 0.5
    do = randn(B, T, HV, V).to(dt)
    return [x.requires_grad_(True) for x in (q, k, v, g, beta)], dict(A_log=A_log.requires_grad_(True),
                                                                    dt_bias=dt_bias.requires_grad_(True)), do


def varlen_lengths(name: str) -> list:
    """The varlen rows' sequence lengths: 8192 tokens of mixed lengths (1, 63, 65
    among them), or 2048 sequences of 1 to 64 tokens."""
    if name == "varlen-mixed-T8192":
        head = [1, 63, 65, 64, 2, 129, 1000, 3000]
        return head + [8192 - sum(head) - 700, 700]
    gen = torch.Generator().manual_seed(1)
    return torch.randint(1, 65, (2048,), generator=gen).tolist()


def peak_step_bytes(step) -> int:
    """Peak device memory of one call of ``step`` above what was allocated before it
    (the inputs, dO): torch.cuda.max_memory_allocated, the caching allocator's view."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def bench(fn, grad_to_none=None):
    return triton.testing.do_bench(fn, warmup=50, rep=300, grad_to_none=grad_to_none, return_mode="median")


def rel_err(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def kernel_times(step, grads_of=(), reps: int = 5) -> dict:
    """CUDA time per step of each kernel (torch.profiler). The grads of ``grads_of``
    are reset before every step (as do_bench's grad_to_none does), so that
    autograd's accumulation into .grad does not show up as kernels."""
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            for x in grads_of:
                x.grad = None
            step()
        torch.cuda.synchronize()
    out = collections.defaultdict(float)
    for e in prof.key_averages():
        if e.device_time_total > 0:
            out[e.key] += e.device_time_total / reps / 1e3  # ms per step
    return dict(out)


def print_kernel_times(title: str, times: dict, limit: int = 14) -> None:
    print(f"{title}: {sum(times.values()):.3f} ms of kernels per step", flush=True)
    for key, ms in sorted(times.items(), key=lambda kv: -kv[1])[:limit]:
        print(f"    {ms:8.3f} ms  {key[:100]}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="also write the table (markdown) to this file")
    parser.add_argument("--kernels", action="store_true",
                        help="also print each implementation's kernels by GPU time (forward, then forward+backward)")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=None,
                        help="sequence lengths to time each shape at (default: each shape's own T, as its name says)")
    parser.add_argument("--csv", default=None,
                        help="also write every timing as CSV (what profiling/plot_benchmark.py plots)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="timing rounds, alternating between the implementations (median reported)")
    parser.add_argument("--shapes", nargs="+", default=[name for name, *_ in SHAPES],
                        help="which standard shapes (by name) to time; default all")
    parser.add_argument("--impl", choices=["both", "ours"], default="both",
                        help="'ours' skips fla (no ratios), e.g. to time our kernels without fla's autotuning")
    parser.add_argument("--mode", choices=["standard", "layer", "varlen", "varlen-standard"], default="standard",
                        help="standard: the standard shapes' inputs; layer: fla's layer flags on (LAYER_FLAGS) at "
                             "the standard shapes; varlen: packed sequences with the layer flags; varlen-standard: "
                             "the same packed sequences with the standard inputs (fp32 log decays, no flags, no "
                             "initial states)")
    parser.add_argument("--variants", nargs="*", default=[],
                        help="also time ours under other launch settings (comma-separated NAME=VALUE of "
                             "kda_op/triton_kernels/settings.py's upper-case settings, one string per variant)")
    args = parser.parse_args()

    from kda_op import chunk_kda as ours_chunk_kda

    impls = {"ours": ours_chunk_kda}
    contexts = {}  # label -> the launch settings its forward and backward run under
    for variant in args.variants:
        impls[f"ours[{variant}]"] = ours_chunk_kda
        contexts[f"ours[{variant}]"] = launch_settings(variant)
    fla_version = "not run"
    if args.impl == "both":
        import fla
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        impls["fla"] = fla_chunk_kda
        fla_version = getattr(fla, "__version__", "?")
    rows = []
    csv_rows = []
    unknown = set(args.shapes) - {name for name, *_ in SHAPES}
    if unknown:
        raise SystemExit(f"unknown shapes {sorted(unknown)}; the standard ones are {[n for n, *_ in SHAPES]}")
    # each shape at its own T, or at each of --seq-lens (renamed to say so). Before
    # 2026-12-04 every shape ran at the default 8192: "B1-T32768-H16" rows were T = 8192.
    cases = [(re.sub(r"-T\d+-", f"-T{T}-", name), B, T, H, HV) for name, B, T0, H, HV in SHAPES
             if name in args.shapes for T in (args.seq_lens or [T0])]
    cases = list(dict.fromkeys(cases))  # B1-T8192 and B1-T32768 at one --seq-lens are one case
    packed = args.mode.startswith("varlen")  # varlen, varlen-standard
    if packed:
        cases = [(name, 1, None, VARLEN_H, VARLEN_H) for name in ("varlen-mixed-T8192", "varlen-2048x1-64")]
    for name, B, T, H, HV in cases:
        if packed:  # the row's lengths, the same for both modes
            lengths = varlen_lengths(name)
            T = sum(lengths)
            cu = torch.tensor([0] + lengths, device="cuda").cumsum(0)
            cu_kwargs = dict(cu_seqlens=cu, cu_seqlens_cpu=cu.cpu())
        if args.mode == "standard":
            inputs, do = make_inputs(B, T, H, HV)
            q, k, v, g, beta, h0 = inputs
            kwargs = dict(initial_state=h0, output_final_state=True)
        elif args.mode == "varlen-standard":
            # the packed rows' lengths with the standard rows' inputs: the kernels' per-chunk
            # paths (no bounded gate), as a caller that forms g itself would run them
            inputs, do = make_inputs(1, T, H, HV)
            inputs = inputs[:5]  # no initial states
            q, k, v, g, beta = inputs
            kwargs = dict(output_final_state=True, **cu_kwargs)
            name = f"{name} standard"
        else:
            inputs, params, do = make_layer_inputs(B, T, H, HV)
            q, k, v, g, beta = inputs
            inputs = inputs + list(params.values())
            kwargs = dict(LAYER_FLAGS, **params, output_final_state=True, **(cu_kwargs if packed else {}))
            name = name if packed else f"{name} layer-style"
        outs = {}
        steps = {}
        peaks = {}
        for label, fn in impls.items():
            print(f"{name}: {label}: first call (compiles; fla also autotunes)", flush=True)

            context = contexts.get(label, contextlib.nullcontext)

            # The layer-style and varlen rows are timed as fla's layer trains: without
            # the final state (use_cache=False); the first call keeps it, to compare.
            timed = kwargs if args.mode == "standard" else dict(kwargs, output_final_state=False)

            def fwd(fn=fn, context=context, kw=timed):
                with torch.no_grad(), context():
                    return fn(q, k, v, g, beta, **kw)

            def fwd_bwd(fn=fn, context=context):
                with context():
                    o, _ = fn(q, k, v, g, beta, **timed)
                    o.backward(do)

            o, ht = fwd(kw=kwargs)
            fwd_bwd()
            outs[label] = (o, ht)
            steps[label] = (fwd, fwd_bwd)
            for x in inputs:
                x.grad = None
            peaks[label] = peak_step_bytes(fwd_bwd)
            for x in inputs:
                x.grad = None
        # Rounds alternate between the implementations, so that a drift of the GPU
        # (clocks, temperature) during the run touches both; the table takes the
        # median of the rounds' medians, the log shows every round.
        times = {label: ([], []) for label in impls}
        for r in range(args.rounds):
            for label, (fwd, fwd_bwd) in steps.items():
                f, fb = bench(fwd), bench(fwd_bwd, grad_to_none=inputs)
                times[label][0].append(f)
                times[label][1].append(fb)
                print(f"{name}: {label}: round {r + 1}: forward {f:.3f} ms, forward+backward {fb:.3f} ms", flush=True)
        res = {label: (statistics.median(f), statistics.median(fb)) for label, (f, fb) in times.items()}
        for label in impls:
            csv_rows.append(f"{name},{B},{T},{H},{HV},{label},{res[label][0]:.6f},{res[label][1]:.6f}")
        nan = float("nan")
        fla_fwd, fla_fb = res.get("fla", (nan, nan))
        err_o = rel_err(outs["ours"][0], outs["fla"][0]) if "fla" in outs else nan
        err_h = rel_err(outs["ours"][1], outs["fla"][1]) if "fla" in outs else nan
        fla_peak = peaks.get("fla", float("nan"))
        rows.append((name, res["ours"][0], fla_fwd, res["ours"][1], fla_fb, err_o, err_h, peaks["ours"], fla_peak))
        for label in impls:
            if label.startswith("ours["):
                err_o = rel_err(outs[label][0], outs["fla"][0]) if "fla" in outs else nan
                err_h = rel_err(outs[label][1], outs["fla"][1]) if "fla" in outs else nan
                rows.append((f"{name} {label}", res[label][0], fla_fwd, res[label][1], fla_fb, err_o, err_h,
                             peaks[label], fla_peak))
        write_table(rows, args, fla_version, csv_rows)  # after every shape: a time limit keeps what ran
        if args.kernels:
            for label, (fwd, fwd_bwd) in steps.items():
                print_kernel_times(f"{name}: {label}: forward", kernel_times(fwd))
                print_kernel_times(f"{name}: {label}: forward+backward", kernel_times(fwd_bwd, grads_of=inputs))
    return 0


def parse_setting(setting: str) -> dict:
    """``"A=1,B=2"`` -> ``{"A": "1", "B": "2"}``."""
    return dict(item.split("=") for item in filter(None, setting.split(",")))


def setting_value(default, value: str):
    """A setting's value from text, typed as its default (int where None; 0/1 or
    False/True for bools); "None" gives None."""
    if value == "None":
        return None
    if default is None:
        return int(value)
    if isinstance(default, bool):
        if value in ("True", "False"):
            return value == "True"
        return bool(int(value))
    return type(default)(value)


def setting_modules() -> dict:
    """Every upper-case setting the benchmarks may change, by name: settings.py's, and
    kda_op._contract's storage dtypes (STORAGE_SETTINGS: BF16_RESIDUALS, U and U' in bf16, ...)."""
    from kda_op import _contract
    from kda_op.triton_kernels import settings

    owners = {n: settings for n in dir(settings) if n.isupper()}
    owners.update({n: _contract for n in _contract.STORAGE_SETTINGS})
    return owners


def launch_settings(variant: str):
    """A context (factory) in which some of those settings are changed, e.g.
    ``"SCAN_BF16_DOTS=1,OUTPUT_WARPS=4"``; restored on exit."""
    owners = setting_modules()
    changes = {}
    for n, value in parse_setting(variant).items():
        if n not in owners:
            raise SystemExit(f"unknown setting {n!r} in --variants {variant!r}")
        changes[n] = setting_value(getattr(owners[n], n), value)

    @contextlib.contextmanager
    def settings():
        saved = {n: getattr(owners[n], n) for n in changes}
        for n, value in changes.items():
            setattr(owners[n], n, value)
        try:
            yield
        finally:
            for n, value in saved.items():
                setattr(owners[n], n, value)

    return settings


def write_table(rows, args, fla_version, csv_rows) -> None:
    header = ("| shape | fwd ours ms | fwd fla ms | fwd ours/fla | fwd+bwd ours ms | fwd+bwd fla ms "
              "| fwd+bwd ours/fla | rel diff o | rel diff final state | fwd+bwd peak ours GiB | fla GiB | ours/fla |")
    lines = [header, "|" + "---|" * 12]
    gib = 2**30
    for name, fo, ff, bo, bf, eo, eh, po, pf in rows:
        lines.append(f"| {name} | {fo:.3f} | {ff:.3f} | {fo / ff:.2f} | {bo:.3f} | {bf:.3f} | {bo / bf:.2f} | {eo:.1e} "
                     f"| {eh:.1e} | {po / gib:.2f} | {pf / gib:.2f} | {po / pf:.2f} |")
    meta = (f"{datetime.date.today().isoformat()}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"triton {triton.__version__}, fla {fla_version}")
    table = "\n".join(lines)
    print(meta)
    print(table)
    if args.csv:
        with open(args.csv, "w") as f:
            f.write(f"# {meta}\n# python benchmarks/bench_chunk_kda.py --impl {args.impl} "
                    f"--shapes {' '.join(args.shapes)} --rounds {args.rounds} "
                    f"{'--seq-lens ' + ' '.join(map(str, args.seq_lens)) + ' ' if args.seq_lens else ''}"
                    f"--csv {args.csv}\n")
            f.write("shape,B,T,H,HV,impl,fwd_ms,fwd_bwd_ms\n" + "\n".join(csv_rows) + "\n")
    if args.out:
        with open(args.out, "w") as f:
            # the varlen modes have shapes of their own (--shapes is not read)
            shapes = "" if args.mode.startswith("varlen") else f" --shapes {' '.join(args.shapes)}"
            f.write(f"{meta}\n\nCommand: `python benchmarks/bench_chunk_kda.py --mode {args.mode} --impl {args.impl}"
                    f"{shapes} --rounds {args.rounds}"
                    + (" --variants " + " ".join(f'"{v}"' for v in args.variants) if args.variants else "")
                    + f" --out {args.out}`\n\n{table}\n")


if __name__ == "__main__":
    sys.exit(main())
