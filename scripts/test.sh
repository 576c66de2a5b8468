#!/usr/bin/env bash
# Set up, then run the test suite (GPU tests are skipped where there is no CUDA device).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m pytest -q -ra "$@"
