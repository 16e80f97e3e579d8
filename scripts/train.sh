#!/usr/bin/env bash
# Set everything up and train the example on 2 local processes through the launcher:
#   bash scripts/train.sh [--steps N] ...        (flags go to examples/train_chars.py)
#   NPROC=4 bash scripts/train.sh                (more ranks)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m tandem.run --standalone --nproc-per-node "${NPROC:-2}" \
  examples/train_chars.py "$@"
