#!/usr/bin/env bash
# Set everything up and train the example on local processes through the launcher:
#   bash scripts/train.sh [--steps N] [--quick] ...   (flags go to examples/train_chars.py;
#                                                       --help lists them)
#   bash scripts/train.sh --nproc 4                   (ranks; default 2, or $NPROC)
#   bash scripts/train.sh --elastic                   (a killed rank is replaced in place;
#                                                       the launcher gets --max-restarts 3,
#                                                       or $MAX_RESTARTS, and --spares
#                                                       $SPARES, default 0)
set -euo pipefail
cd "$(dirname "$0")/.."
nproc=${NPROC:-2}
args=()
launcher=()
while [ $# -gt 0 ]; do
  case "$1" in
    --nproc) [ $# -ge 2 ] || { echo "train.sh: --nproc needs a number" >&2; exit 2; }
             nproc=$2; shift 2;;
    --nproc=*) nproc=${1#--nproc=}; shift;;
    --elastic) args+=("$1"); shift
               launcher=(--max-restarts "${MAX_RESTARTS:-3}" --spares "${SPARES:-0}");;
    *) args+=("$1"); shift;;
  esac
done
case "$nproc" in
  ''|*[!0-9]*|0) echo "train.sh: --nproc must be a positive number of ranks, got '$nproc'" >&2
                 exit 2;;
esac
# the example's flags are checked (and --help answered) before set-up and before any worker
# starts; the check imports nothing but the standard library
status=0
"${PYTHON:-python3}" examples/train_chars/cli.py "${args[@]+"${args[@]}"}" || status=$?
case $status in
  0) ;;
  3) exit 0;;  # the help was shown
  *) exit "$status";;
esac
bash scripts/setup.sh
exec .venv/bin/python -m tandem.run --standalone --nproc-per-node "$nproc" \
  "${launcher[@]+"${launcher[@]}"}" examples/train_chars.py "${args[@]+"${args[@]}"}"
