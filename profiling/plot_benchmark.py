"""Plot the benchmark's CSV (benchmarks/bench_chunk_kda.py --csv): time against
sequence length, ours and fla, forward and forward+backward, one line per
implementation and shape family. Writes a PNG.

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


def plot(path: str, out: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    header, rows = read_results(path)
    series = defaultdict(list)  # (family, impl) -> [(T, fwd, fwd_bwd)]
    for r in rows:
        family = re.sub(r"-T\d+", "", r["shape"])
        series[(family, r["impl"])].append((int(r["T"]), float(r["fwd_ms"]), float(r["fwd_bwd_ms"])))

    families = sorted({family for family, _ in series})
    colors = {family: f"C{i}" for i, family in enumerate(families)}  # one colour a shape family
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, column, title in ((axes[0], 1, "forward"), (axes[1], 2, "forward + backward")):
        for (family, impl), points in sorted(series.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[column] for p in points], marker="o", color=colors[family],
                    linestyle="-" if impl == "ours" else "--", label=f"{impl} {family}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel("ms (median, do_bench)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("chunk_kda: kda-op vs fla" + (f"\n{header[0]}" if header else ""), fontsize=9)
    fig.tight_layout()
    out_path = Path(out)
    fig.savefig(out_path, dpi=120)
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
