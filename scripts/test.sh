#!/usr/bin/env bash
# Set everything up and run the tests; other arguments go to pytest.
#   bash scripts/test.sh            the whole suite, files spread over parallel workers
#   bash scripts/test.sh --fast     the edit loop: every test that runs in one process
#                                   (threads, loopback) and one spawn smoke test a package
#   bash scripts/test.sh --types    the type check alone (scripts/typecheck.sh)
# Most tests wait on sockets, sleeps and child processes rather than the CPU, so even a
# 2-core machine runs several files at once; WORKERS=N sets how many (WORKERS=0: serial).
# A file stays on one worker: its module fixtures (one batched spawn for many tests) run once.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--types" ]; then
  shift
  exec bash scripts/typecheck.sh "$@"
fi
bash scripts/setup.sh
workers=${WORKERS:-3}
for arg in "$@"; do
  case $arg in -n|-n*|--numprocesses*|--dist*) workers=0 ;; esac  # the caller's choice
done
parallel=()
if [ "$workers" != 0 ]; then
  parallel=(-n "$workers" --dist loadfile)
fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider "${parallel[@]}" "$@"
