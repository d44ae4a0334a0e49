#!/usr/bin/env bash
# Install polar-mitm and everything its tests drive, from nothing: a Python 3.12 virtualenv with
# the package and its test extras, and the real harness CLIs from npm.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=""
for cand in python3.12 "$HOME/.pyenv/versions/3.12.1/bin/python3.12" python3 python; do
  if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
    PY="$cand"; break
  fi
done
if [ -z "$PY" ]; then echo "install: Python 3.12 not found (mitmproxy 12 needs it)" >&2; exit 1; fi

if [ ! -x .venv/bin/python ]; then "$PY" -m venv .venv; fi
.venv/bin/pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/pip install -q -e '.[test]'

# tmux drives the interactive-terminal end-to-end test.
if ! command -v tmux >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && apt-get install -y -qq tmux) >/dev/null 2>&1 || echo "install: could not install tmux" >&2
fi

# Harness CLIs, pinned to the versions the end-to-end tests were written against.
NPM_PACKAGES=(
  "@anthropic-ai/claude-code@2.1.197"
  "@openai/codex@0.171.0"
  "@google/gemini-cli@0.61.0"
  "@qwen-code/qwen-code@0.15.10"
  "@mariozechner/pi-coding-agent@0.73.1"
  "opencode-ai@1.18.33"
)
missing=()
for spec in "${NPM_PACKAGES[@]}"; do
  name="${spec%@*}"
  want="${spec##*@}"
  have=$(npm ls -g --depth=0 --json 2>/dev/null | .venv/bin/python -c "import json,sys; d=json.load(sys.stdin).get('dependencies',{}); print(d.get('$name',{}).get('version',''))" || true)
  [ "$have" = "$want" ] || missing+=("$spec")
done
if [ ${#missing[@]} -gt 0 ]; then
  npm install -g --no-fund --no-audit "${missing[@]}"
fi
