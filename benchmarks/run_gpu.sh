#!/usr/bin/env bash
# On the lent H200 (no registry): install the carried wheels (fla, pytest), run the
# benchmarks, the GPU tests (three pytest processes side by side, so Triton
# compiles in parallel), the sequence sweep with its plot and a profile.
# Everything textual goes to $OUT/log.txt; results files beside it (the device
# tool returns at most 8 files). The wheels, fetched beforehand where pip works:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform any -d .whl flash-linear-attention==0.6.0 \
#     fla-core==0.6.0 einops pytest==9.0.3 pluggy iniconfig packaging pygments
# Knobs: OURS_LIMIT, BENCH_LIMIT, DECODE_LIMIT, TEST_LIMIT (seconds), SWEEP=1 for the
# sequence sweep, its plot and a CUDA profile.
set -uo pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}
LOG="$OUT/log.txt"
step() { echo "== $*" >> "$LOG"; }

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv >> "$LOG" 2>&1
step "benchmark, standard shapes, ours alone (our numbers even if fla's autotuning runs long)"
timeout "${OURS_LIMIT:-120}" python3 benchmarks/bench_chunk_kda.py --impl ours --kernels >> "$LOG" 2>&1
step "benchmark, standard shapes, ours and fla"
timeout "${BENCH_LIMIT:-240}" python3 benchmarks/bench_chunk_kda.py --out "$OUT/RESULTS.md" >> "$LOG" 2>&1
step "decode benchmark"
timeout "${DECODE_LIMIT:-120}" python3 benchmarks/bench_decode.py --out "$OUT/RESULTS_decode.md" >> "$LOG" 2>&1

LIMIT=${TEST_LIMIT:-330}
timeout "$LIMIT" python3 -m pytest -q -ra --tb=short tests/test_cuda.py -k "fp32" > /tmp/t1.txt 2>&1 &
timeout "$LIMIT" python3 -m pytest -q -ra --tb=short tests/test_cuda.py -k "not fp32" > /tmp/t2.txt 2>&1 &
timeout "$LIMIT" python3 -m pytest -q -ra --tb=short tests/ --ignore=tests/test_cuda.py > /tmp/t3.txt 2>&1 &
wait
for f in /tmp/t1.txt /tmp/t2.txt /tmp/t3.txt; do step "tests $f"; tail -n 40 "$f" >> "$LOG"; done

if [ -n "${SWEEP:-}" ]; then
    step "sequence sweep"
    timeout "${SWEEP_LIMIT:-240}" python3 benchmarks/bench_chunk_kda.py --seq-lens 1024 2048 4096 8192 16384 \
        --csv "$OUT/results_seq_sweep.csv" >> "$LOG" 2>&1
    python3 profiling/plot_benchmark.py "$OUT/results_seq_sweep.csv" --out "$OUT/benchmark.png" >> "$LOG" 2>&1
    step "profile"
    timeout 120 python3 profiling/profile_kda.py --target op --device cuda --dtype bfloat16 --seq-len 8192 \
        --heads 16 --value-heads 16 --head-dim 128 --out-dir /tmp/traces >> "$LOG" 2>&1
    cp /tmp/traces/*/*.pt.trace.json "$OUT/" 2>/dev/null
fi
tail -c 6000 "$LOG"
