"""The real Grok CLI (npm @vibe-kit/grok-cli 0.0.34), unmodified, through `polar-mitm run` with the
generic recipe, as a new user runs it: the OpenAI SDK's Chat Completions at api.x.ai, with the
recipe's dummy GROK_API_KEY (api.x.ai was not answered: 0 turns, exit 0)."""

import json

import pytest

from tests.support.harness import require_binary, run_tool_task

pytestmark = pytest.mark.e2e


def test_grok_cli_does_the_shell_task_through_the_generic_recipe(tmp_path, backend, qwen_tokenizer_dir):
    require_binary("grok")
    task = run_tool_task(
        "generic",
        backend,
        qwen_tokenizer_dir,
        tmp_path,
        "grok-e2e",
        style="openai-chat",
        host="api.x.ai",
        command=["grok", "-p", "{instruction}"],
    )
    assert "Done. The command finished." in task.result.stdout
    assert "is not read by polar-mitm" not in task.result.stderr  # search_parameters: ignored, said why
    assert task.call["name"] == "bash"
    assert json.loads(task.raw[task.t1.id].request)["search_parameters"] == {"mode": "off"}
