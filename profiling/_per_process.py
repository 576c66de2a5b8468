"""The case-grid runner of fused_scan_diff.py and bwd_scan_diff.py: each case in a process of
its own (a GPU fault ends only its own), with launches blocking (the faulting kernel named)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Callable, Sequence


def main(doc: str, cases: Sequence, run_one: Callable[[int], str], script: str, jobs: int = 6) -> int:
    """``script --one I`` prints ``run_one(I)``; ``script`` alone runs every case that way,
    ``--jobs`` side by side, and prints each case's line (or its failure) as it ends, so a
    time limit loses only the unfinished ones."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--one", type=int, default=None, help="run case ONE alone in this process")
    parser.add_argument("--jobs", type=int, default=jobs, help="cases run side by side")
    args = parser.parse_args()
    if args.one is not None:
        print(run_one(args.one), flush=True)
        return 0

    def sub(i: int) -> str:
        env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
        p = subprocess.run([sys.executable, script, "--one", str(i)], capture_output=True, text=True, env=env)
        if p.returncode != 0:
            last = [line for line in p.stderr.strip().splitlines() if line.strip()][-3:]
            return f"case {i:2d} {cases[i]}: FAILED rc={p.returncode}: " + " | ".join(last)[-400:]
        return p.stdout.strip()

    with ThreadPoolExecutor(args.jobs) as pool:
        for done in as_completed([pool.submit(sub, i) for i in range(len(cases))]):
            print(done.result(), flush=True)
    return 0
