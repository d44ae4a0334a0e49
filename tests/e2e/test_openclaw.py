"""OpenClaw (npm openclaw, on Node >= 24 from npm's `node` package), unmodified, through
`polar-mitm run` with its recipe's headless command: an OpenAI model over Responses, the shell task
of the fake's default script in two turns, token-exact. Its second request continues on the
server's state: it carries `previous_response_id` (the first turn's response id, resolved from the
store) and only the new input, and its prompt extends the first turn's prompt + sampled ids."""

import json

import pytest

from tests.support.harness import require_binary, run_tool_task

pytestmark = pytest.mark.e2e


def test_two_turn_tool_task_continues_from_the_stored_response(tmp_path, backend, qwen_tokenizer_dir):
    require_binary("openclaw")
    task = run_tool_task(
        "openclaw",
        backend,
        qwen_tokenizer_dir,
        tmp_path,
        "claw-e2e",
        style="openai-responses",
        host="api.openai.com",
    )
    assert "Done. The command finished." in task.result.stdout
    first, second = json.loads(task.raw[task.t1.id].request), json.loads(task.raw[task.t2.id].request)
    assert "previous_response_id" not in first
    assert second["previous_response_id"] == json.loads(task.raw[task.t1.id].response)["turn_id"].replace(
        "turn_", "resp_", 1
    )
    assert [i["type"] for i in second["input"]] == ["function_call_output"]  # only what is new
    assert second["input"][0]["call_id"] == task.call["id"]
    assert task.t2.prompt_ref == task.t1.id  # spliced onto the first turn
    assert all(t.tag is None for t in task.raw.values())
