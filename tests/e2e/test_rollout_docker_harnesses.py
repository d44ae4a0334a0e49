"""Rollouts in real Docker containers of the npm harnesses beyond Claude Code, Codex and Gemini CLI
(tests/e2e/test_rollout_docker.py): Cline, Continue, Copilot CLI, Kilo Code, Qwen Code, Pi,
OpenCode and Factory's Droid (the npm ones: the host's installation is mounted read-only, as for Claude Code), through
`polar-mitm rollout` with each recipe's headless command, the files its recipe writes into the
sample's fresh HOME, and a Harbor task scored by its own test. The PyPI harnesses (mini-swe-agent,
aider, Kimi CLI, OpenHands) are in tests/e2e/test_rollout_docker_pypi.py.
"""

from __future__ import annotations

import pytest

from tests.support.docker_rollout import leftovers, solve_answer_task
from tests.support.harness import assert_turns_match_backend, require_binary

pytestmark = [pytest.mark.e2e, pytest.mark.docker]


@pytest.mark.parametrize(
    "harness,binary",
    [
        ("cline", "cline"),
        ("continue", "cn"),
        ("copilot", "copilot"),
        ("kilo", "kilo"),
        # The recipe harnesses that had only run under `run` until now.
        ("qwen-code", "qwen"),
        ("pi", "pi"),
        ("opencode", "opencode"),
        ("droid", "droid"),  # its BYOK settings file written into the sample's HOME
    ],
)
def test_harness_solves_a_task_in_docker(
    tmp_path, backend, qwen_tokenizer_dir, docker_client, harness, binary
):
    require_binary(binary)
    db, rows = solve_answer_task(tmp_path, harness, backend, qwen_tokenizer_dir)
    assert all(row["role"] == "main" for row in rows)  # side calls (titles) are tagged, not trajectories
    assert_turns_match_backend(backend, db)
    assert leftovers(docker_client) == []
