"""The real Continue CLI (npm @continuedev/cli, `cn`), unmodified, through `polar-mitm run` with the
recipe's headless command and the config file its recipe writes into a fresh HOME: OpenAI Chat
Completions over SSE, its `Bash` tool called by the fake's default script."""

import json

import pytest

from polar_mitm import recipes
from tests.support.harness import harness_env, require_binary, run_tool_task

pytestmark = pytest.mark.e2e


def test_bash_task_is_done_and_every_turn_is_captured_token_exact(tmp_path, backend, qwen_tokenizer_dir):
    require_binary("cn")
    home = tmp_path / "home"
    env = harness_env(home)
    recipe = recipes.get("continue")
    assert recipe.write_home_files(home) == [home / ".continue" / "config.yaml"]
    task = run_tool_task(
        "continue",
        backend,
        qwen_tokenizer_dir,
        tmp_path,
        "cn-e2e",
        style="openai-chat",
        host="api.openai.com",
        env=env,
    )
    assert "Done. The command finished." in task.result.stdout
    assert "session cn-e2e" in task.result.stderr and "2 turns" in task.result.stderr
    assert task.call["name"] == "Bash"
    assert json.loads(task.raw[task.t1.id].request)["stream"] is True
