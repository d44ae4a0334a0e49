"""Real SGLang on CPU for the `engines` tests: its venv, the tiny model it serves and its server
(the shared parts, and the recording hop, are in tests/support/engines.py).

- `sglang_python`: the interpreter of the CPU SGLang venv that scripts/install.sh builds
  (`$POLAR_MITM_CACHE/venvs/sglang-cpu-0.5.23`, the unchanged PyPI wheel; `POLAR_MITM_SGLANG_VENV`
  names another). The tests skip, saying how to build it, only where that venv is absent.
- `make_tiny_model`: the shared tiny Qwen2, built with SGLang's torch where this venv has none.
- `SGLangServer`: `python -m sglang.launch_server` in its own process group on a free loopback
  port, ready once `/health_generate` answers (a token through the scheduler), stopped by
  signalling the whole group (SGLang's scheduler and detokenizer are child processes).
"""

from __future__ import annotations

import os
from pathlib import Path

from polar_mitm.cache import cache_dir
from tests.support import engines
from tests.support.engines import EngineServer

SGLANG_VERSION = "0.5.23"  # scripts/install.sh pins the same
STAMP = f"sglang=={SGLANG_VERSION}"  # what install.sh writes into the venv once its build passed
# SGLang's CPU path on a machine without a GPU (the build script's launch line).
ENGINE_ARGS = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--disable-overlap-schedule",
    "--dtype",
    "float32",
    "--max-running-requests",
    "4",
    # Its KV pool is sized from the free memory otherwise (17 GB of a 23 GB machine, for this
    # tiny model): with a trainer beside it the kernel's OOM killer took its scheduler.
    "--max-total-tokens",
    "131072",
    # Idle, its scheduler polls without pause: a whole core for the rest of the test session (0.95
    # cores measured over 20 s idle; 0.00 with this flag).
    "--sleep-on-idle",
)


def sglang_venv() -> Path:
    return Path(
        os.environ.get("POLAR_MITM_SGLANG_VENV") or cache_dir() / "venvs" / f"sglang-cpu-{SGLANG_VERSION}"
    )


def sglang_python() -> Path:
    """The SGLang venv's python (skips where there is none, fails where its build did not finish)."""
    return engines.engine_python(
        sglang_venv(),
        STAMP,
        "scripts/install.sh builds it (needs Python 3.11 and ../shared/sglang-cpu/build.sh; "
        "POLAR_MITM_NO_SGLANG=1 skips it)",
    )


def make_tiny_model(tokenizer_dir: Path, out: Path, *, seed: int = 0, eos_share: float = 0.15) -> Path:
    """A tiny Qwen2 over `tokenizer_dir`'s vocabulary in `out`, ready for SGLang to serve."""
    return engines.make_tiny_model(tokenizer_dir, out, python=sglang_python, seed=seed, eos_share=eos_share)


class SGLangServer(EngineServer):
    """`python -m sglang.launch_server` over `model_dir` on 127.0.0.1, its log in `log`."""

    name = "SGLang"
    ready_path = "/health_generate"

    def __init__(self, model_dir: Path, log: Path, *extra: str, ready_timeout: float = 240):
        self.model_dir = model_dir
        py = sglang_python()
        super().__init__(
            lambda port: [
                str(py),
                "-m",
                "sglang.launch_server",
                "--model-path",
                str(model_dir),
                *ENGINE_ARGS,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                *extra,
            ],
            {"SGLANG_USE_CPU_ENGINE": "1"},
            log,
            ready_timeout=ready_timeout,
        )
