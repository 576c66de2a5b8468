#!/usr/bin/env bash
# Set up, then run the test suite (GPU tests are skipped where there is no CUDA device).
# Tests run in pytest-xdist workers, KDA_TEST_WORKERS of them (a number, or "auto": one
# per core): under Triton's interpreter each test is single-threaded Python, and on CI's
# two cores two workers halve the suite (2026-12-06, torch 2.13 / Triton 3.9 on a 2-core
# machine: 1,464 s against about 3,200 s in one process). On a machine with a CUDA device
# the default is 0 (one process: the tests share one card, and some of them need
# most of its memory).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ -z "${KDA_TEST_WORKERS:-}" ]; then
    if [ -e /dev/nvidia0 ] || [ -e /dev/nvidiactl ]; then KDA_TEST_WORKERS=0; else KDA_TEST_WORKERS=auto; fi
fi
# worksteal: an idle worker takes queued tests from a busy one, so that the few
# minute-long tests do not leave one worker running alone at the end
python3 -m pytest -q -ra -n "$KDA_TEST_WORKERS" --dist worksteal "$@"
