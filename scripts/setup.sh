#!/usr/bin/env bash
# Create .venv (if missing) and install tandem with its test tools into it.
# torch is pinned to the CPU build 2.13.0; other versions are multi-GB downloads.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]' 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, tandem; print('tandem', tandem.__version__, 'on torch', torch.__version__)"
