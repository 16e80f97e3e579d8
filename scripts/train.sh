#!/usr/bin/env bash
# Set everything up and train the example on 2 local processes:
#   bash scripts/train.sh [--steps N] [--nproc N] ...   (flags go to examples/train_chars.py)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/train_chars.py "$@"
