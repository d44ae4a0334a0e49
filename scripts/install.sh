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

say() { echo "install: $*" >&2; }

if [ ! -x .venv/bin/python ]; then say "creating .venv with $PY"; "$PY" -m venv .venv; fi
# Reinstall the package only when its dependencies changed (a stamp holds pyproject.toml's hash).
stamp=.venv/.polar-mitm-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "installing polar-mitm and its test extras into .venv (a few minutes the first time)"
  .venv/bin/pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/pip install -q -e '.[test]'
  echo "$want" > "$stamp"
else
  say "Python packages up to date"
fi

# Trainers (torch, transformers, TRL; verl's types): the tests of polar_mitm.bridges and of
# `fake-backend --mode hf` skip without them. Off with POLAR_MITM_NO_TRAINERS=1.
if [ "${POLAR_MITM_NO_TRAINERS:-}" = 1 ]; then
  say "skipping the trainer extras (POLAR_MITM_NO_TRAINERS=1): their tests will skip"
elif .venv/bin/python -c 'import torch, trl, verl' 2>/dev/null; then
  say "trainer extras present"
else
  say "installing the trainer extras (torch, transformers, trl, verl types): a few minutes the first time"
  # pip's cache (~/.cache/pip) is kept: the next install reuses torch's wheels.
  .venv/bin/pip install -q -e '.[trl]'
  # verl pins transformers<5.11 and pulls ray[default], wandb, tensorboard, peft, vLLM-era
  # pins: its agent-loop types only, with the few small modules that module imports.
  .venv/bin/pip install -q --no-deps 'verl==0.9.1'
  .venv/bin/pip install -q 'tensordict==0.10.0' 'hydra-core>=1.3' codetiming pylatexenc pillow cachetools
fi

# tmux drives the interactive-terminal end-to-end test.
if command -v tmux >/dev/null 2>&1; then
  say "tmux present"
elif command -v apt-get >/dev/null 2>&1; then
  say "installing tmux with apt-get (for the interactive Claude Code test)"
  (apt-get update -qq && apt-get install -y -qq tmux) >/dev/null 2>&1 || say "could not install tmux; that one test will fail"
else
  say "no tmux and no apt-get: install tmux yourself for the interactive Claude Code test"
fi

if ! command -v npm >/dev/null 2>&1; then
  say "npm not found: install Node.js 20 or newer with npm (e.g. apt-get install nodejs npm), then run this again"
  exit 1
fi

# Harness CLIs, pinned to the versions the end-to-end tests were written against.
NPM_PACKAGES=(
  "@anthropic-ai/claude-code@2.1.197"
  "@openai/codex@0.171.0"
  "@google/gemini-cli@0.61.0"
  "@qwen-code/qwen-code@0.15.10"
  "@mariozechner/pi-coding-agent@0.73.1"
  "opencode-ai@1.18.33"
  # Not a harness: the fetch proxy preload (polar_mitm/runtime/node_proxy.cjs) takes undici's
  # EnvHttpProxyAgent from it, so Node 18-22's fetch honours HTTPS_PROXY.
  "undici@6.29.1"
)
missing=()
for spec in "${NPM_PACKAGES[@]}"; do
  name="${spec%@*}"
  want="${spec##*@}"
  have=$(npm ls -g --depth=0 --json 2>/dev/null | .venv/bin/python -c "import json,sys; d=json.load(sys.stdin).get('dependencies',{}); print(d.get('$name',{}).get('version',''))" || true)
  [ "$have" = "$want" ] || missing+=("$spec")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing harness CLIs from npm: ${missing[*]}"
  npm install -g --no-fund --no-audit "${missing[@]}"
else
  say "harness CLIs up to date"
fi

# Docker for the rollout tests: Debian's docker.io, a daemon in the background, the base image.
if [ "${POLAR_MITM_NO_DOCKER:-}" = 1 ]; then
  say "skipping Docker (POLAR_MITM_NO_DOCKER=1): run the tests with -m 'not docker'"
else
  bash scripts/docker.sh
fi
say "done"
