#!/usr/bin/env bash
# Harness drift: the newest release of each recipe harness, installed into a scratch prefix, its
# end-to-end tests run against it, one table printed (scripts/harness_drift.py says how). Slow
# (minutes per harness that changed): run it before a training run, after upgrading a harness.
#   bash scripts/harness-drift.sh [--all] [--scratch DIR] [RECIPE ...]
set -euo pipefail
cd "$(dirname "$0")/.."
exec nice -n 10 .venv/bin/python scripts/harness_drift.py "$@"
