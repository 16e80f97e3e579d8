#!/usr/bin/env bash
# Set everything up and type-check tandem with mypy (its settings: pyproject.toml [tool.mypy]).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m mypy "$@"
