#!/usr/bin/env bash
# Installs kda-op and what its tests need into the current python3.
# torch: when none is installed, KDA_TORCH (a pip requirement; CI sets it from its
# environment's pins), else torch 2.13.0, whose CPU build lies on this project's
# development machines (a GPU machine keeps its own torch).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import torch" 2>/dev/null; then
    python3 -m pip install --quiet "${KDA_TORCH:-torch==2.13.0}"
fi
python3 -m pip install --quiet -e ".[test]"
