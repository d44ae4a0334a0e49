"""The real Kilo Code CLI (npm @kilocode/cli), unmodified, through `polar-mitm run` with the recipe's
headless command: OpenAI Responses over SSE, its `bash` tool called by the fake's default script,
and its title call (a small model) tagged, so it is no second trajectory.

Kilo sends the title call only some of the time (not on every fresh start, unlike OpenCode), so
the run test checks that any call it made is tagged, and tests/unit/test_recipe_side_calls.py checks
the tag on the request Kilo sends."""

import pytest

from tests.support.harness import require_binary, run_tool_task

pytestmark = pytest.mark.e2e


def test_bash_task_is_done_the_title_call_tagged_and_every_turn_token_exact(
    tmp_path, backend, qwen_tokenizer_dir
):
    require_binary("kilo")
    task = run_tool_task(
        "kilo",
        backend,
        qwen_tokenizer_dir,
        tmp_path,
        "kilo-e2e",
        style="openai-responses",
        host="api.openai.com",
    )
    assert "Done. The command finished." in task.result.stdout
    assert task.call["name"] == "bash"
    # Every other call is the title call, on its small model, and tagged.
    assert {(t.tag, t.model) for t in task.raw.values() if t.tag is not None or t.model != "gpt-4o"} <= {
        ("title", "gpt-5.4-nano")
    }
