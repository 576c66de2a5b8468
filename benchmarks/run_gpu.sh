#!/usr/bin/env bash
# On the lent H200 (no registry): install the carried wheels (fla, pytest), run the
# benchmark, then the GPU tests (three pytest processes side by side, so Triton
# compiles in parallel). Logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
timeout "${BENCH_LIMIT:-240}" python3 benchmarks/bench_chunk_kda.py --kernels --out "$OUT/RESULTS.md" > "$OUT/bench.txt" 2>&1
LIMIT=${TEST_LIMIT:-330}
timeout "$LIMIT" python3 -m pytest -q -ra --tb=short tests/test_cuda.py -k "fp32" > "$OUT/tests_cuda_fp32.txt" 2>&1 &
timeout "$LIMIT" python3 -m pytest -q -ra --tb=short tests/test_cuda.py -k "not fp32" > "$OUT/tests_cuda_rest.txt" 2>&1 &
timeout "$LIMIT" python3 -m pytest -q -ra --tb=short tests/ --ignore=tests/test_cuda.py > "$OUT/tests_other.txt" 2>&1 &
wait
cat "$OUT/bench.txt"
for f in "$OUT"/tests_*.txt; do echo "== $f"; tail -n 25 "$f"; done
timeout "${DECODE_LIMIT:-120}" python3 benchmarks/bench_decode.py --out "$OUT/RESULTS_decode.md" > "$OUT/bench_decode.txt" 2>&1
cat "$OUT/bench_decode.txt"
timeout "${SWEEP_LIMIT:-240}" python3 benchmarks/bench_chunk_kda.py --seq-lens 1024 2048 4096 8192 16384 --csv "$OUT/results_seq_sweep.csv" > "$OUT/bench_sweep.txt" 2>&1
python3 profiling/plot_benchmark.py "$OUT/results_seq_sweep.csv" --out "$OUT/benchmark.png"
timeout 120 python3 profiling/profile_kda.py --target op --device cuda --dtype bfloat16 --seq-len 8192 --heads 16 --value-heads 16 --head-dim 128 --out-dir "$OUT/traces" > "$OUT/profile_op_cuda.txt" 2>&1
