"""OpenClaw (npm openclaw, on Node >= 24 from npm's `node` package), unmodified, through
`polar-mitm run` with its recipe's headless command: an OpenAI model over Responses, the shell task
of the fake's default script in two turns, token-exact. Its second request continues on the
server's state: it carries `previous_response_id` (the first turn's response id, resolved from the
store) and only the new input, and its prompt extends the first turn's prompt + sampled ids."""

import json
import subprocess

import pytest

from polar_mitm.reconstruct.export import iter_trajectories
from polar_mitm.strategies import Strategy
from tests.support.harness import (
    assert_turns_match_backend,
    harness_env,
    main_turns,
    polar_run,
    require_binary,
    run_tool_task,
)

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


def test_an_anthropic_model_moves_its_context_and_spawns_no_subagent(tmp_path, backend, qwen_tokenizer_dir):
    """With an Anthropic model OpenClaw moves its internal-context message to the end of every
    request, so turn 2 does not extend turn 1; turn 2 carries the tool result of turn 1's call,
    so the call is answered: no row of either export strategy is a subagent "spawned by exec"."""
    require_binary("openclaw")
    work, db = tmp_path / "work", tmp_path / "runs.sqlite"
    work.mkdir()
    env = harness_env(tmp_path / "home")
    env["ANTHROPIC_API_KEY"] = "sk-ant-polar-mitm-dummy"
    r = polar_run(
        ["--backend", backend.url, "--tokenizer", str(qwen_tokenizer_dir), "--db", str(db), "--session", "claw-a"],
        ["openclaw", "agent", "exec", "--isolated", "--auth-env-only", "--model", "anthropic/claude-sonnet-4-6",
         "Create out.txt containing hi"],
        cwd=work, env=env, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert (work / "out.txt").read_text() == "hi\n"
    t1, t2 = main_turns(db)
    assert t1.style == t2.style == "anthropic" and t1.finish_reason == "tool_calls"
    assert_turns_match_backend(backend, db)
    for strategy in (Strategy.PREFIX_MERGE, Strategy.PER_REQUEST):
        rows = list(iter_trajectories(db, strategy=strategy))
        assert rows and {row.role for row in rows} == {"main"}, (strategy, [row.role for row in rows])
