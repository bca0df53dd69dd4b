#!/usr/bin/env bash
# Apply ruff's safe fixes and its formatting to the whole repository, then run the checks CI runs
# (the README's <!-- ci:lint --> block). `tools/lint.sh --check` only checks and changes nothing.
# VENV names another virtual environment than ./.venv.
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${VENV:-.venv}/bin"
if [ "${1:-}" != "--check" ]; then
  "$bin/ruff" check --fix --quiet . || true   # what it cannot fix is reported by the check below
  "$bin/ruff" format --quiet .
fi
"$bin/ruff" check .
"$bin/ruff" format --check .
"$bin/mypy"
