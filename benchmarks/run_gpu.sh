#!/usr/bin/env bash
# On the lent H200 (no registry): install the carried wheels (fla, pytest), run the
# whole test suite and the benchmark, logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
python3 -m pytest -q -ra ${PYTEST_ARGS:-tests/} 2>&1 | tee "$OUT/tests.txt"
python3 benchmarks/bench_chunk_kda.py --kernels --out "$OUT/RESULTS.md" 2>&1 | tee "$OUT/bench.txt"
