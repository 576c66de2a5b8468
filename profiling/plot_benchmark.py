"""Plot the benchmark's CSV (benchmarks/bench_chunk_kda.py --csv): per shape family
(B1, B8, ...), tokens/s against sequence length for ours and fla (a colour each),
forward and forward+backward, and ours/fla. Writes a PNG.

    python profiling/plot_benchmark.py benchmarks/results_seq_sweep.csv --out profiling/benchmark.png
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import defaultdict
from pathlib import Path


def read_results(path: str) -> tuple[list[str], list[dict]]:
    """The '#' header lines (date, device, command) and the rows of the CSV."""
    lines = Path(path).read_text().splitlines()
    header = [line[1:].strip() for line in lines if line.startswith("#")]
    rows = list(csv.DictReader(line for line in lines if not line.startswith("#")))
    if not rows:
        raise ValueError(f"{path} holds no timing rows")
    return header, rows


IMPL_COLORS = {"ours": "#1f77b4", "fla": "#ff7f0e"}  # one colour an implementation, in every panel


def plot(path: str, out: str) -> Path:
    """One row of panels a shape family (B1-H16, B8-H16, ...): tokens/s of the
    forward and of forward+backward against T, ours and fla in their own colours,
    and ours/fla (below 1: we are faster)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    header, rows = read_results(path)
    series = defaultdict(dict)  # family -> impl -> {T: (fwd_ms, fwd_bwd_ms, B)}
    for r in rows:
        family = re.sub(r"-T\d+", "", r["shape"])
        series[family].setdefault(r["impl"], {})[int(r["T"])] = (float(r["fwd_ms"]), float(r["fwd_bwd_ms"]),
                                                                  int(r["B"]))
    families = sorted(series, key=lambda f: (int(re.match(r"B(\d+)", f).group(1)) if re.match(r"B\d+", f) else 0, f))
    fig, axes = plt.subplots(len(families), 3, figsize=(14, 3.6 * len(families)), squeeze=False)
    plain = FuncFormatter(lambda x, _: f"{x:g}")
    for row, family in zip(axes, families):
        impls = series[family]
        for ax, column, title in ((row[0], 0, "forward"), (row[1], 1, "forward + backward")):
            for impl, points in sorted(impls.items()):
                Ts = sorted(points)
                tok_s = [points[T][2] * T / (points[T][column] * 1e-3) / 1e6 for T in Ts]
                ax.plot(Ts, tok_s, marker="o", color=IMPL_COLORS.get(impl), label=impl)
            ax.set_title(f"{family}: {title}", fontsize=10)
            ax.set_ylabel("million tokens / s (higher is better)")
            ax.set_ylim(bottom=0)
        ratio_ax = row[2]
        if "ours" in impls and "fla" in impls:
            for column, label, style in ((0, "forward", "-"), (1, "forward + backward", "--")):
                Ts = sorted(set(impls["ours"]) & set(impls["fla"]))
                ratio_ax.plot(Ts, [impls["ours"][T][column] / impls["fla"][T][column] for T in Ts], marker="o",
                              linestyle=style, color=IMPL_COLORS["ours"], label=label)
            ratio_ax.axhline(1.0, color="grey", linewidth=1)
        ratio_ax.set_title(f"{family}: time ours / fla (below 1: kda-op faster)", fontsize=10)
        ratio_ax.set_ylim(0, max(1.5, ratio_ax.get_ylim()[1]))
        for ax in row:
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(plain)
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel("sequence length T")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle("chunk_kda: kda-op against fla" + (f"\n{header[0]}" if header else ""), fontsize=9)
    fig.tight_layout()
    out_path = Path(out)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", help="CSV written by benchmarks/bench_chunk_kda.py --csv")
    parser.add_argument("--out", default="profiling/benchmark.png")
    args = parser.parse_args(argv)
    print(plot(args.csv, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
