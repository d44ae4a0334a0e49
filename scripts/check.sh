#!/usr/bin/env bash
# The static checks, run before the tests (by .ci/run) and before a commit: lint, format, types.
# Uses the active virtualenv ($VIRTUAL_ENV), else the one scripts/install.sh makes (.venv), else
# the tools on PATH. Clean either way: with only the test extras installed or with the trainers too
# (mypy reads the extras' modules as untyped where they are missing: pyproject.toml's overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${VIRTUAL_ENV:-.venv}/bin"
[ -x "$bin/mypy" ] || bin="$(dirname "$(command -v mypy)")"
"$bin/ruff" check polar_mitm tests bench examples scripts
"$bin/ruff" format --check polar_mitm tests bench examples scripts
"$bin/mypy" polar_mitm   # configured in pyproject.toml ([tool.mypy])
echo "check.sh: ruff and mypy clean"
