"""The real Kimi CLI (PyPI kimi-cli 1.51.0 on Python 3.13, in its own virtualenv), unmodified,
through `polar-mitm run` with the recipe's headless command: Moonshot's Chat Completions over SSE
at api.moonshot.ai, its `Shell` tool called by the fake's default script (no rule file)."""

import json

import pytest

from tests.support.harness import require_binary, run_tool_task

pytestmark = pytest.mark.e2e


def test_shell_tool_task_is_done_and_every_turn_is_captured_token_exact(
    tmp_path, backend, qwen_tokenizer_dir
):
    require_binary("kimi")
    task = run_tool_task(
        "kimi-cli",
        backend,
        qwen_tokenizer_dir,
        tmp_path,
        "kimi-e2e",
        style="openai-chat",
        host="api.moonshot.ai",
    )
    assert "Done. The command finished." in task.result.stdout
    assert "session kimi-e2e" in task.result.stderr and "2 turns" in task.result.stderr
    assert task.call["name"] == "Shell"
    req2 = json.loads(task.raw[task.t2.id].request)
    assert req2["stream"] is True and req2["messages"][-1]["role"] == "tool"
