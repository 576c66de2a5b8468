#!/usr/bin/env bash
# Installs kda-op and what its tests need into the current python3.
# torch: the pinned CPU build when no torch is installed (a GPU machine keeps its own).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import torch" 2>/dev/null; then
    python3 -m pip install --quiet "torch==2.13.0"
fi
python3 -m pip install --quiet -e ".[test]"
