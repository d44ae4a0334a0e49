"""Factory's Droid CLI (npm droid), unmodified, through `polar-mitm run` with the settings file its
recipe writes into a fresh HOME: one bring-your-own-key model per API style (Responses, Messages,
Chat Completions), each doing the shell task of the fake's default script token-exact."""

import json

import pytest

from polar_mitm import recipes
from tests.support.harness import harness_env, require_binary, run_tool_task

pytestmark = pytest.mark.e2e

# settings model -> (stored style, host)
STYLES = {
    "polar-mitm-responses": ("openai-responses", "api.openai.com"),
    "polar-mitm-messages": ("anthropic", "api.anthropic.com"),
    "polar-mitm-chat": ("openai-chat", "api.openai.com"),
}


@pytest.mark.parametrize("model", list(STYLES))
def test_each_byok_style_does_the_task_token_exact(tmp_path, backend, qwen_tokenizer_dir, model):
    require_binary("droid")
    home = tmp_path / "home"
    env = harness_env(home)
    recipe = recipes.get("droid")
    assert recipe.write_home_files(home) == [home / ".factory" / "settings.json"]
    style, host = STYLES[model]
    command = [a.replace("polar-mitm-responses", model) for a in recipe.headless]
    task = run_tool_task(
        "droid",
        backend,
        qwen_tokenizer_dir,
        tmp_path,
        "droid-e2e",
        style=style,
        host=host,
        env=env,
        command=command,
    )
    assert "Done. The command finished." in task.result.stdout
    # The system prompt and the tools reached the engine (the first request offers its shell tool).
    request = json.loads(task.raw[task.t1.id].request)
    assert request.get("tools") and (
        request.get("system") or request.get("instructions") or request.get("messages")
    )
    assert all(t.tag is None for t in task.raw.values())
