#!/usr/bin/env bash
# The static checks, run before the tests (by .ci/run) and before a commit: lint, format, types.
# Uses the virtualenv scripts/install.sh makes (.venv), or the tools on PATH without one.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=.venv/bin
[ -x "$bin/ruff" ] || bin="$(dirname "$(command -v ruff)")"
"$bin/ruff" check polar_mitm tests bench examples scripts
"$bin/ruff" format --check polar_mitm tests bench examples scripts
"$bin/mypy" polar_mitm   # configured in pyproject.toml ([tool.mypy])
echo "check.sh: ruff and mypy clean"
