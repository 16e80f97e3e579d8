#!/usr/bin/env bash
# Create .venv (if missing) and install tandem with its test tools, the example's extras,
# the docs site's tools and Ray (tandem.ray's tests run a real Ray cluster) into it. torch is pinned to the CPU build 2.13.0; other versions are multi-GB
# downloads. A second run with nothing changed skips pip entirely (5.6 s measured on a busy 2-core machine).
#   PYTHON=python3.12 bash scripts/setup.sh      # pick the interpreter for a new .venv
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
say() { printf 'setup: %s\n' "$*"; }

# Everything pip's result depends on; when it is unchanged since the last successful
# set-up, nothing needs installing.
stamp_of() {
  cat pyproject.toml scripts/setup.sh
  .venv/bin/python -c 'import sys; print(sys.version)'
}

# Run pip quietly, but if it fails show everything it said and stop.
pip_install() {
  local log
  log=$(mktemp)
  if ! .venv/bin/python -m pip install --disable-pip-version-check "$@" >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    say "pip install $* failed (its output is above)" >&2
    exit 1
  fi
  rm -f "$log"
}

if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $("$PY" --version 2>&1)"
  "$PY" -m venv .venv
fi
# Compile tandem's modules ahead, as pip does for an installed wheel: where
# PYTHONDONTWRITEBYTECODE is set, every rank of a job compiled them again on its own
# (0.5 s of CPU each; 16 ranks on 2 cores spent 4 s of their start-up on it).
compile_tandem() {
  .venv/bin/python -m compileall -q tandem >/dev/null
}

if [ -f .venv/.tandem-setup ] && [ "$(stamp_of | cksum)" = "$(cat .venv/.tandem-setup)" ] \
   && .venv/bin/python -c 'import torch, tandem' 2>/dev/null; then
  compile_tandem
  say "nothing changed since the last set-up; .venv is ready"
  exit 0
fi
rm -f .venv/.tandem-setup
say "installing torch 2.13.0 (CPU build; it lies on this machine's disk, seconds)"
pip_install torch==2.13.0
say "installing tandem (editable) with its test tools, the example's, the docs' and Ray's extras"
pip_install -e '.[test,example,docs,ray]'
.venv/bin/python -c "import torch, tandem; print('setup: tandem', tandem.__version__, 'on torch', torch.__version__)"
compile_tandem
stamp_of | cksum > .venv/.tandem-setup
