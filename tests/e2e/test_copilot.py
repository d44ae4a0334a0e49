"""The real GitHub Copilot CLI (npm @github/copilot) with BYOK, unmodified, through `polar-mitm run`
with the recipe's headless command: OpenAI Chat Completions at api.openai.com, its `bash` tool
called by the fake's default script, no GitHub login."""

import json

import pytest

from tests.support.harness import require_binary, run_tool_task

pytestmark = pytest.mark.e2e


def test_bash_task_is_done_and_every_turn_is_captured_token_exact(tmp_path, backend, qwen_tokenizer_dir):
    require_binary("copilot")
    task = run_tool_task(
        "copilot",
        backend,
        qwen_tokenizer_dir,
        tmp_path,
        "copilot-e2e",
        style="openai-chat",
        host="api.openai.com",
    )
    assert "session copilot-e2e" in task.result.stderr and "2 turns" in task.result.stderr
    assert task.call["name"] == "bash"
    tools = json.loads(task.raw[task.t1.id].request)["tools"]
    # Its apply_patch grammar tool comes as a Chat `custom` tool, and is accepted.
    assert ("custom", "apply_patch") in {
        (t["type"], (t.get("function") or t.get("custom") or {}).get("name")) for t in tools
    }
