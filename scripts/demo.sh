#!/usr/bin/env bash
# The main job: set up, then train a small KDA language model through torch.compile(fullgraph=True),
# export it and run the exported program (cuda if present, else cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m kda_op.train_demo "$@"
