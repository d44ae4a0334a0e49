"""The real Mistral Vibe (PyPI mistral-vibe 3.0.2, in its own virtualenv), unmodified, through
`polar-mitm run` with the generic recipe, as a new user runs it: Mistral's SDK, Chat Completions
over SSE at api.mistral.ai, with the recipe's dummy MISTRAL_API_KEY. Mistral's SDK requires
`function.name` in every streamed tool-call chunk: with the arguments in a later chunk of their
own it exited after turn 1."""

import json

import pytest

from tests.support.harness import require_binary, run_tool_task

pytestmark = pytest.mark.e2e


def test_mistral_vibe_does_the_shell_task_through_the_generic_recipe(tmp_path, backend, qwen_tokenizer_dir):
    require_binary("vibe")
    task = run_tool_task(
        "generic",
        backend,
        qwen_tokenizer_dir,
        tmp_path,
        "vibe-e2e",
        style="openai-chat",
        host="api.mistral.ai",
        command=["vibe", "-p", "{instruction}", "--auto-approve", "--trust"],
    )
    assert "Done. The command finished." in task.result.stdout
    assert task.call["name"] == "bash"
    req2 = json.loads(task.raw[task.t2.id].request)
    assert req2["stream"] is True and req2["messages"][-1]["role"] == "tool"
