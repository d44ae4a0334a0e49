"""Rollouts in real Docker containers of the npm harnesses beyond Claude Code, Codex and Gemini CLI
(tests/e2e/test_rollout_docker.py): Cline, Continue, Copilot CLI, Kilo Code, Qwen Code, Pi,
OpenCode, Factory's Droid, OpenClaw and Kimi Code (the npm ones: the host's installation is mounted
read-only, as for Claude Code; OpenClaw's and Kimi Code's are their own prefixes with npm's Node
24, and that Node),
through `polar-mitm rollout` with each recipe's headless command, the files its recipe writes into
the sample's fresh HOME, and a Harbor task scored by its own test. The PyPI harnesses
(mini-swe-agent, aider, Kimi CLI, OpenHands, hermes-agent) are in
tests/e2e/test_rollout_docker_pypi.py.
"""

from __future__ import annotations

import json

import pytest

from polar_mitm.store.reader import read_turns
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
        ("openclaw", "openclaw"),  # its own prefix and Node 24; stateful Responses (below)
        ("kimi-code", "kimi-code"),  # its own prefix and Node 24, as OpenClaw
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


def test_openclaw_continues_from_the_stored_response_in_docker(
    tmp_path, backend, qwen_tokenizer_dir, docker_client
):
    """OpenClaw in Docker continues on the server's state as under `run`: each sample's second
    request carries only the tool's output and the id of its first reply, which the proxy
    resolves from that sample's stored turns and splices, token-exact."""
    require_binary("openclaw")
    db, rows = solve_answer_task(tmp_path, "openclaw", backend, qwen_tokenizer_dir)
    assert all(row["role"] == "main" for row in rows) and len(rows) == 2
    assert_turns_match_backend(backend, db)
    sessions: dict[str, list] = {}
    for t in read_turns(db, with_raw=True):
        sessions.setdefault(t.session_id, []).append(t)
    assert len(sessions) == 2
    for first, second in sessions.values():
        assert first.finish_reason == "tool_calls" and second.finish_reason == "stop"
        asked, then = json.loads(first.request), json.loads(second.request)
        assert "previous_response_id" not in asked
        issued = json.loads(first.response)["turn_id"].replace("turn_", "resp_", 1)
        assert then["previous_response_id"] == issued
        assert [i["type"] for i in then["input"]] == ["function_call_output"]  # only what is new
        assert second.prompt_ref == first.id  # spliced onto the first turn
        assert second.prompt_ids[: len(first.prompt_ids) + len(first.output_ids)] == (
            first.prompt_ids + first.output_ids
        )
    assert leftovers(docker_client) == []
