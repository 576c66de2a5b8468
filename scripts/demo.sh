#!/usr/bin/env bash
# The main job: set up, then KDA forward+backward through torch.compile(fullgraph=True)
# on the default device (cuda if present, else cpu), checked against eager.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 -m kda_op.demo "$@"
