#!/usr/bin/env bash
# Apply ruff's safe fixes and its formatting to the whole repository, split the strings and comments
# the formatter leaves over 119 columns (tools/wrap_long_lines.py: the AST of every file stays the
# same), then run the checks CI runs (the README's <!-- ci:lint --> block).
# `tools/lint.sh --check` only checks and changes nothing. VENV names another environment than ./.venv.
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${VENV:-.venv}/bin"
if [ "${1:-}" != "--check" ]; then
  "$bin/ruff" check --fix --quiet . >/dev/null || true   # what it cannot fix, the check below reports
  "$bin/ruff" format --quiet .
  for _ in 1 2 3; do  # a split part can itself be too long: split again after formatting
    changed=$("$bin/python" tools/wrap_long_lines.py .)
    [ -z "$changed" ] && break
    "$bin/ruff" format --quiet $changed
  done
fi
"$bin/ruff" check .
"$bin/ruff" format --check .
"$bin/mypy"
