"""The real Kimi Code (npm @moonshot-ai/kimi-code 2.1.0, on the Node of its own prefix), unmodified,
through `polar-mitm run`: Moonshot's Chat Completions over SSE at api.moonshot.ai, its model from
the environment (KIMI_MODEL_NAME, KIMI_MODEL_API_KEY). Run as the kimi-code recipe's launcher, and
as `kimi`, the npm binary a new user has, which is Kimi CLI's name too: the kimi-cli recipe is
then picked, and it must give Node our CA (it gave only Python's: "harness refused our CA")."""

import json
import os
from pathlib import Path

import pytest

from polar_mitm.cache import cache_dir
from tests.support.harness import harness_env, require_binary, run_tool_task

pytestmark = pytest.mark.e2e


def test_kimi_code_does_the_shell_task_and_every_turn_is_captured_token_exact(
    tmp_path, backend, qwen_tokenizer_dir
):
    require_binary("kimi-code")
    task = run_tool_task(
        "kimi-code",
        backend,
        qwen_tokenizer_dir,
        tmp_path,
        "kimi-code-e2e",
        style="openai-chat",
        host="api.moonshot.ai",
    )
    assert "Done. The command finished." in task.result.stdout
    assert "is not read by polar-mitm" not in task.result.stderr  # its `thinking` is read
    assert task.call["name"] == "Bash"
    req1 = json.loads(task.raw[task.t1.id].request)
    assert req1["model"] == "kimi-k2-turbo-preview" and req1["thinking"]["type"] == "enabled"


def _kimi_code_bin() -> Path:
    """The directory of Kimi Code's own `kimi`: install.sh's prefix, else one on PATH (the drift
    script's scratch prefix)."""
    dirs = [cache_dir() / "kimi-code" / "bin", *map(Path, os.environ.get("PATH", "").split(os.pathsep))]
    for d in dirs:
        if "@moonshot-ai/kimi-code" in str((d / "kimi").resolve()):
            return d
    pytest.fail("Kimi Code is not installed; scripts/install.sh installs it")


def test_kimi_code_run_as_kimi_gets_the_kimi_recipe_with_nodes_ca(tmp_path, backend, qwen_tokenizer_dir):
    prefix_bin = _kimi_code_bin()
    env = harness_env(tmp_path / "home")
    env["PATH"] = os.pathsep.join([str(prefix_bin), env["PATH"]])  # its `kimi` before Kimi CLI's
    task = run_tool_task(
        "kimi-cli",
        backend,
        qwen_tokenizer_dir,
        tmp_path,
        "kimi-as-kimi",
        style="openai-chat",
        host="api.moonshot.ai",
        env=env,
        command=["kimi", "-p", "{instruction}"],
    )
    assert "kimi version 2.1.0" in task.result.stderr  # Kimi Code, not Kimi CLI
    assert task.call["name"] == "Bash"
