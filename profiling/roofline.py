"""Each chunked kernel's achieved bytes/s and FLOP/s against the H200's ceilings,
from its measured GPU time and a count of what it must move and compute.

    python profiling/roofline.py profiling/kernel_times.json --case B1-T8192-H16-layer \
        --out profiling/roofline.png

The times come from ``benchmarks/bench_chunk_kda.py --kernels`` (torch.profiler, ms of
GPU time per step; ``parse_kernel_times`` reads its log) and are kept with their
date, commit and command in ``profiling/kernel_times.json``. The counts are a model
(``kernel_costs``): every tensor a kernel reads or writes counted once, at its
stored dtype; reads repeated across a kernel's programs (K slices, V blocks, value
heads of one key head) are not counted again, so the bytes are a lower bound on
the DRAM traffic, and the TB/s one on what the kernel moved per second. FLOPs
count the dots' multiply-adds (2 per MAC) at the tile sizes the kernels run (64-row
chunks), elementwise work not at all. Ceilings: the device-to-device copy (4.27
TB/s) and bf16 dots (670 TFLOP/s) measured on the H200 (DESIGN.md section 4); TF32
dots (what most intra-chunk dots of bf16 inputs take) taken as half of bf16's, not
measured.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

COPY_TBS = 4.27  # measured device-to-device copy, TB/s
BF16_TFLOPS = 670.0  # measured bf16 dots, TFLOP/s (low end of 670-790)
TF32_TFLOPS = BF16_TFLOPS / 2  # assumed: half of bf16 (not measured)
BT = 64  # the kernels' chunk length
BC = 16  # the row blocks of the diagonal inverses and of the by-row-block kernels


@dataclass(frozen=True)
class Shape:
    """A call: ``lengths`` the sequences (B equal ones or N packed), H key heads,
    HV value heads, head dims K and V, bf16 inputs. ``layer``: fla's layer flags
    (q/k l2 norm, gate in kernel from a bf16 raw gate, beta sigmoid); otherwise g is
    an fp32 log decay. ``block_refs``: the share of chunks whose A's take the block
    references (four dots a K slice instead of one; nearly all with the layer's
    gate). ``initial_state``: each sequence has one; ``final_state_grad``: the
    loss reads the final states (dht). Without them the kernels skip the zero state
    terms (S0 of a sequence's first chunk, dS_C of its last): counted here too.
    ``final_state``: the call returns the final states (``output_final_state``; fla's
    layer trains without). ``packed``: one call over packed sequences (cu_seqlens),
    whose chunk states without initial states are compact (only those entering a
    sequence's chunks after its first; ``_contract.varlen_state_slots``)."""

    lengths: tuple
    H: int
    HV: int
    K: int = 128
    V: int = 128
    layer: bool = False
    block_refs: float = 0.0
    initial_state: bool = False
    final_state_grad: bool = False
    final_state: bool = True
    packed: bool = False


def shape_of(case: dict) -> Shape:
    """A Shape from a case of kernel_times.json: ``B``/``T`` or ``lengths``."""
    lengths = tuple(case["lengths"]) if "lengths" in case else (case["T"],) * case["B"]
    return Shape(lengths=lengths, H=case["H"], HV=case["HV"], K=case.get("K", 128), V=case.get("V", 128),
                 layer=case.get("layer", False), block_refs=case.get("block_refs", 0.0),
                 initial_state=case.get("initial_state", False),
                 final_state_grad=case.get("final_state_grad", False),
                 final_state=case.get("final_state", True), packed="lengths" in case)


def kernel_costs(s: Shape) -> dict:
    """Per kernel name: (bytes, FLOPs, the dots' operand precision) of one training
    step (the forward keeping its intermediates, then the backward from them)."""
    if not s.lengths or min(s.lengths) < 0:
        raise ValueError(f"lengths must be non-negative and not empty, got {s.lengths!r}")
    K, V, HV, H = s.K, s.V, s.HV, s.H
    tokens = sum(s.lengths)
    tok = tokens * HV  # token-heads
    chunks = sum(math.ceil(n / BT) for n in s.lengths) * HV  # chunk-heads
    seqh = len(s.lengths) * HV
    state = K * V
    bf, f4 = 2, 4
    qk = tokens * H * K * bf  # one of q, k
    g_bytes = tok * K * (bf if s.layer else f4)
    ns = math.ceil(K / 64)  # intra_bwd_w's K slices (settings.BKS_W)
    h0 = seqh * state * f4 if s.initial_state else 0
    a_dots = 2 * 2 * BT * BT * K * (1 + 3 * s.block_refs)  # both A's; block refs: four dots a slice
    # chunks whose entering state is read (S0: not a first chunk without h0), whose
    # leaving state's grad is (dS_C: not a last chunk without dht), and either
    seqs = sum(1 for n in s.lengths if n > 0) * HV
    single = sum(1 for n in s.lengths if 0 < n <= BT) * HV
    with_s0 = chunks if s.initial_state else chunks - seqs
    with_dsc = chunks if s.final_state_grad else chunks - seqs
    with_either = chunks if (s.initial_state or s.final_state_grad) else chunks - single
    # ... and the rows (token-heads) of those chunks
    rows_s0 = tok if s.initial_state else (tokens - sum(min(n, BT) for n in s.lengths)) * HV
    rows_either = tok if (s.initial_state or s.final_state_grad) else sum(n for n in s.lengths if n > BT) * HV
    # the forward scan: the chunk states it stores (bf16), and the chunks whose leaving
    # state anything reads (a one-chunk packed sequence without states needs none)
    compact = s.packed and not s.initial_state
    stored_states = chunks - seqs if compact else chunks + seqh
    leaving = chunks - seqs if (compact and not s.final_state) else chunks
    costs = {
        "kda_gam_fwd_kernel": (g_bytes + tok * K * f4, 0, "-"),
        "kda_intra_a_fwd_kernel": (2 * qk + tok * K * f4 + tok * BT * (f4 + bf) + 2 * tok * K * bf,
                                   chunks * a_dots, "tf32"),
        # ... by row blocks (settings.INTRA_A_ROW_PROGRAMS): the same tensors; block b's dots
        # span the columns up to its end rounded up to a power of two (16, 32, 64, 64)
        "kda_intra_a_fwd_rows_kernel": (2 * qk + tok * K * f4 + tok * BT * (f4 + bf) + 2 * tok * K * bf,
                                        chunks * 2 * 2 * BC * K * (BC + 2 * BC + BT + BT), "tf32"),
        # reads the diagonal BC x BC blocks of A_kk (fp32) and beta, writes their inverses
        # (fp32); forward substitutions, no dots
        "kda_diag_inv_kernel": (tok * BC * f4 + tok * bf + tok * BC * f4, 0, "-"),
        # A_kk, k, gam, v, beta, the diagonal inverses in; W, U (bf16), Tm (fp32) out
        "kda_intra_wu_fwd_kernel": (tok * BT * f4 + qk + tok * K * f4 + tok * V * bf + tok * bf + tok * BC * f4
                                    + tok * K * bf + tok * V * bf + tok * BT * f4,
                                    chunks * (3 * 2 * BT ** 3 + 2 * BT * BT * (K + V)), "tf32"),
        # Kr, W, U, h0 in; U', the chunk states and the final states (fp32) out; W S where
        # there is an entering state, Kr^T U' where the leaving one is wanted
        "kda_state_fwd_kernel": (2 * tok * K * bf + tok * V * bf + h0 + tok * V * bf
                                 + stored_states * state * bf + (seqh * state * f4 if s.final_state else 0),
                                 (with_s0 + leaving) * 2 * BT * K * V, "bf16"),
        "kda_output_fwd_kernel": (tok * BT * bf + tok * V * bf + rows_s0 * K * bf + with_s0 * state * bf + tok * V * bf,
                                  with_s0 * 2 * BT * K * V + chunks * 2 * BT * BT * V, "bf16"),
        # the scan that writes the output (settings.FUSED_OUTPUT; where its programs outnumber
        # the SMs, as at B8-T8192-H16): the scan's reads and writes and the output's, but U'
        # and the chunk states are not read back; Qg only where a chunk has an entering state
        "kda_state_output_fwd_kernel": (2 * tok * K * bf + tok * V * bf + h0 + tok * BT * bf + rows_s0 * K * bf
                                        + tok * V * bf + stored_states * state * bf
                                        + (seqh * state * f4 if s.final_state else 0) + tok * V * bf,
                                        (2 * with_s0 + leaving) * 2 * BT * K * V + chunks * 2 * BT * BT * V, "bf16"),
        # Qg^T dO only where dS entering the chunk is wanted (not a first chunk without h0)
        "kda_state_bwd_prep_kernel": (tok * V * bf + tok * BT * bf + tok * V * f4 + rows_s0 * K * bf + with_s0 * state * bf,
                                      chunks * 2 * BT * BT * V + with_s0 * 2 * K * BT * V, "tf32"),
        # the scan's work: chunks with a leaving-state grad (packed sequences without dht
        # skip their last chunks; dense batches run them on zeros)
        "kda_state_bwd_kernel": (2 * tok * K * bf + 2 * tok * V * f4 + 2 * with_dsc * state * bf + h0,
                                 with_dsc * 2 * 2 * BT * K * V, "tf32"),
        # the scan with A_qk^T dO and Qg^T dO inside (settings.SCAN_BWD_FUSED): reads Qg, Kr,
        # W, A_qk and dO, writes dU' and dS_C; every chunk's four dots but Kr dS_C where
        # dS_C is zero (an upper bound: a one-chunk sequence without h0 skips two more)
        "kda_state_bwd_fused_kernel": (3 * tok * K * bf + tok * BT * bf + tok * V * bf + tok * V * f4
                                       + with_dsc * state * bf + h0,
                                       chunks * (2 * BT * BT * V + 2 * 2 * BT * K * V) + with_dsc * 2 * BT * K * V,
                                       "bf16"),
        # a chunk with neither S0 nor dS_C (a one-chunk sequence without states) only stores zeros
        "kda_intra_bwd_w_kernel": (rows_either * (2 * H * K * bf / HV + bf + K * f4 + BT * f4 + V * (bf + f4 + bf))
                                   + (with_s0 + with_dsc) * state * bf + 3 * tok * K * f4 + tok * ns * BT * f4,
                                   with_either * (3 * 2 * BT * V * K + 2 * 2 * BT * BT * K), "tf32"),
        "kda_intra_bwd_kernel": (tok * V * bf + tok * bf + 2 * tok * BT * f4 + tok * V * (bf + f4 + bf)
                                 + tok * ns * BT * f4 + tok * V * bf + tok * bf + 2 * tok * BT * f4,
                                 chunks * (3 * 2 * BT * BT * V + 2 * 2 * BT ** 3), "tf32"),
        "kda_intra_bwd_a_kernel": (2 * qk + tok * K * f4 + 2 * tok * BT * f4 + 3 * tok * K * f4
                                   + (g_bytes if s.layer else 0) + 2 * tok * K * f4 + g_bytes,
                                   chunks * 4 * 2 * BT * BT * K * (1 + 3 * s.block_refs), "tf32"),
        # ... by row blocks (settings.INTRA_BWD_A_ROW_PROGRAMS): q, k, gam and both dA's in,
        # dq, dk, d(gam) (fp32) read and written back; per block two dots over its rows and
        # two over its columns, each [BC, BT] x [BT, K]
        "kda_intra_bwd_a_rows_kernel": (2 * qk + tok * K * f4 + 2 * tok * BT * f4 + 2 * 3 * tok * K * f4,
                                        chunks * (BT // BC) * 4 * 2 * BC * BT * K, "tf32"),
        # d(gam) and each chunk's dGam in, the raw gate (layer), dg out in the gate's dtype
        # and the gate's per-chunk partial sums (fp32); a cumulative sum, no dots
        "kda_dg_of_chunk_kernel": (tok * K * f4 + chunks * K * f4 + (g_bytes if s.layer else 0) + g_bytes
                                   + (2 * chunks * K * f4 if s.layer else 0), 0, "-"),
        "kda_gva_reduce_kernel": (2 * tok * K * f4 + 2 * qk, 0, "-"),
    }
    if s.layer:
        rows = tokens * H
        costs["kda_prep_fwd_kernel"] = (4 * qk + 2 * rows * f4 + 2 * tok * bf, 0, "-")
        costs["kda_prep_bwd_kernel"] = (6 * qk + 2 * rows * f4 + 3 * tok * bf, 0, "-")
    return costs


_TIME_LINE = re.compile(r"^\s+([0-9.]+) ms\s+(\S+)")


def parse_kernel_times(log: str, label: str, phase: str = "forward+backward") -> dict:
    """The kernel table that ``bench_chunk_kda.py --kernels`` printed for ``label``
    (e.g. "B1-T8192-H16 layer-style: ours") and ``phase``: {kernel name: ms}."""
    header = f"{label}: {phase}: "
    times, inside = {}, False
    for line in log.splitlines():
        if line.startswith(header) and "ms of kernels per step" in line:
            times, inside = {}, True
            continue
        if inside:
            m = _TIME_LINE.match(line)
            if not m:
                inside = False
                continue
            times[m.group(2)] = float(m.group(1))
    if not times:
        raise ValueError(f"no kernel table for {header!r} in the log")
    return times


@dataclass(frozen=True)
class Row:
    kernel: str
    ms: float
    gbytes: float
    gflops: float
    precision: str

    @property
    def tbs(self) -> float:
        return self.gbytes / self.ms  # GB per ms = TB/s

    @property
    def tflops(self) -> float:
        return self.gflops / self.ms  # GFLOP per ms = TFLOP/s

    @property
    def intensity(self) -> float:
        return self.gflops / self.gbytes if self.gbytes else 0.0

    def time_at_ceilings_ms(self) -> float:
        """The time the bytes alone or the FLOPs alone would take at the ceilings,
        whichever is longer: how fast the kernel could be."""
        peak = BF16_TFLOPS if self.precision == "bf16" else TF32_TFLOPS
        return max(self.gbytes / COPY_TBS, self.gflops / peak)  # GB / (TB/s) = ms


def rows_for(shape: Shape, times_ms: dict) -> list:
    """One Row per kernel that has both a time and a cost, slowest first."""
    costs = kernel_costs(shape)
    rows = [Row(name, ms, costs[name][0] / 1e9, costs[name][1] / 1e9, costs[name][2])
            for name, ms in times_ms.items() if name in costs and ms > 0]
    return sorted(rows, key=lambda r: -r.ms)


def unmodelled_ms(shape: Shape, times_ms: dict) -> dict:
    """The measured kernels that kernel_costs has no model for (torch's own fills and
    reductions, the packed index): {name: ms}, so that the table's sum is read
    against the whole step."""
    costs = kernel_costs(shape)
    return {name: ms for name, ms in times_ms.items() if name not in costs}


def table(rows: Sequence[Row]) -> str:
    """A markdown table of the rows and their sum."""
    out = ["| kernel | ms | GB (model) | TB/s | of copy ceiling | GFLOP | TFLOP/s | dots | of dot ceiling "
           "| ms at the ceilings |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        peak = BF16_TFLOPS if r.precision == "bf16" else TF32_TFLOPS
        dot_share = f"{r.tflops / peak:.0%}" if r.gflops else "-"
        out.append(f"| {r.kernel.removeprefix('kda_').removesuffix('_kernel')} | {r.ms:.3f} | {r.gbytes:.3f} | "
                   f"{r.tbs:.2f} | {r.tbs / COPY_TBS:.0%} | {r.gflops:.1f} | {r.tflops:.1f} | {r.precision} | "
                   f"{dot_share} | {r.time_at_ceilings_ms():.3f} |")
    total_ms = sum(r.ms for r in rows)
    bound_ms = sum(r.time_at_ceilings_ms() for r in rows)
    out.append(f"| **all** | **{total_ms:.3f}** | {sum(r.gbytes for r in rows):.3f} | | | "
               f"{sum(r.gflops for r in rows):.1f} | | | | **{bound_ms:.3f}** |")
    return "\n".join(out)


def plot(rows: Sequence[Row], title: str, out: str, footer: str = "") -> Path:
    """The roofline: achieved TFLOP/s against FLOP per byte, one point a kernel, the
    copy ceiling's slope and the bf16 / TF32 dot ceilings as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    xs = [10 ** (i / 20) for i in range(0, 61)]  # 1 .. 1000 FLOP/byte
    for peak, name, style in ((BF16_TFLOPS, "bf16 dots (measured)", "-"), (TF32_TFLOPS, "TF32 dots (half of bf16)", "--")):
        ax.plot(xs, [min(peak, x * COPY_TBS) for x in xs], style, color="0.35", lw=1.2, label=name)
    drawn = [r for r in rows if r.gflops]
    colors = plt.cm.tab20.colors
    longest = max(r.ms for r in drawn) if drawn else 1.0
    for i, r in enumerate(drawn):
        name = r.kernel.removeprefix("kda_").removesuffix("_kernel")
        ax.scatter([r.intensity], [r.tflops], s=30 + 400 * r.ms / longest, color=colors[i % len(colors)],
                   edgecolor="black", linewidth=0.5, zorder=3, label=f"{name} ({r.ms:.3f} ms)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(1, 1000)
    ax.set_ylim(1, 2 * BF16_TFLOPS)
    ax.set_xlabel("FLOP per byte (model)")
    ax.set_ylabel("achieved TFLOP/s")
    fmt = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    ax.xaxis.set_major_formatter(fmt)
    ax.yaxis.set_major_formatter(fmt)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    ax.set_title(title, fontsize=10)
    footer = "\n".join(textwrap.wrap(footer, 170))  # a long source line would run off the figure
    fig.text(0.01, 0.01, f"{footer}\ncopy ceiling {COPY_TBS} TB/s (the slope); point size: GPU time; "
             "kernels without dots are not drawn", fontsize=7, color="0.4")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path = Path(out)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("times", help="kernel_times.json (cases of measured kernel times)")
    parser.add_argument("--case", required=True, help="which case of the file")
    parser.add_argument("--out", help="write the roofline plot (PNG) here")
    args = parser.parse_args(argv)
    data = json.loads(Path(args.times).read_text())
    cases = data["cases"]
    if args.case not in cases:
        raise SystemExit(f"unknown case {args.case!r}; the file has {sorted(cases)}")
    case = cases[args.case]
    rows = rows_for(shape_of(case), case["ours_ms"])
    print(f"{args.case}: {case['source']}")
    print(table(rows))
    unmodelled = unmodelled_ms(shape_of(case), case["ours_ms"])
    if unmodelled:
        print("not in the table (no cost model): " + ", ".join(f"{n} {ms:.3f} ms" for n, ms in unmodelled.items()))
    if args.out:
        plot(rows, f"kda-op's kernels, one training step, {args.case}", args.out, footer=case["source"])
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
