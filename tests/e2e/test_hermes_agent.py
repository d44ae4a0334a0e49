"""Hermes Agent (PyPI hermes-agent), unmodified, through `polar-mitm run` with its recipe: the shell
task of the fake's default script with each of its providers, token-exact. Its Gemini client trusts
only HERMES_CA_BUNDLE; its OpenRouter provider calls openrouter.ai, which the recipe answers as
Chat Completions; `openai-api` with gpt-4o speaks Responses."""

import pytest

from polar_mitm import recipes
from tests.support.harness import require_binary, run_tool_task

pytestmark = pytest.mark.e2e

# --provider -> (its model, stored style, host)
PROVIDERS = {
    "anthropic": ("claude-sonnet-4-5", "anthropic", "api.anthropic.com"),
    "openai-api": ("gpt-4o", "openai-responses", "api.openai.com"),
    "gemini": ("gemini-2.5-flash", "gemini", "generativelanguage.googleapis.com"),
    "openrouter": ("openai/gpt-4o", "openai-chat", "openrouter.ai"),
}


@pytest.mark.parametrize("provider", list(PROVIDERS))
def test_each_provider_records_its_turns_token_exact(tmp_path, backend, qwen_tokenizer_dir, provider):
    require_binary("hermes")
    model, style, host = PROVIDERS[provider]
    command = ["hermes", "-z", "{instruction}", "--provider", provider, "-m", model, "--yolo"]
    assert recipes.get("hermes-agent").headless_command("x")[0] == "hermes"
    task = run_tool_task(
        "hermes-agent",
        backend,
        qwen_tokenizer_dir,
        tmp_path,
        "hermes-e2e",
        style=style,
        host=host,
        command=command,
    )
    assert "Done. The command finished." in task.result.stdout
    assert all(t.tag is None for t in task.raw.values())
