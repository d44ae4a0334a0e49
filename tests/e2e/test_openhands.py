"""The real OpenHands CLI (PyPI openhands, in its own virtualenv), unmodified, through `polar-mitm
run` with the recipe's headless command: litellm's OpenAI Chat Completions at the default URL, its
`terminal` tool called by the fake's default script."""

import pytest

from tests.support.harness import require_binary, run_tool_task

pytestmark = pytest.mark.e2e


def test_terminal_task_is_done_and_every_turn_is_captured_token_exact(tmp_path, backend, qwen_tokenizer_dir):
    require_binary("openhands")
    task = run_tool_task(
        "openhands",
        backend,
        qwen_tokenizer_dir,
        tmp_path,
        "oh-e2e",
        style="openai-chat",
        host="api.openai.com",
    )
    assert "Done. The command finished." in task.result.stdout
    assert "session oh-e2e" in task.result.stderr and "2 turns" in task.result.stderr
    assert task.call["name"] == "terminal"
