"""The real OpenCode binary (npm opencode-ai), unmodified, through `polar-mitm run`.

OpenCode speaks OpenAI Responses SSE to api.openai.com with `-m openai/<model>`, makes a separate
title call with the provider's small model, and allows its bash tool without asking by default.
"""

import json
import sqlite3
import subprocess
from pathlib import Path

import pytest

from polar_mitm.store.reader import read_turns
from tests.support.harness import (
    assert_turns_match_backend,
    harness_env,
    main_turns,
    polar_run,
    require_binary,
)

pytestmark = pytest.mark.e2e


def opencode_home(home: Path) -> dict[str, str]:
    """A fresh HOME whose global config directory already counts as installed.

    On start OpenCode installs @opencode-ai/plugin into each config directory from
    registry.npmjs.org, in the background (a failure is only logged). The registry is not ours to
    stub (tasks run npm too), and tests must not leave the machine, so the directory is seeded
    with the state that install would leave behind.
    """
    env = harness_env(home)
    config = home / ".config" / "opencode"
    (config / "node_modules").mkdir(parents=True)
    deps = {"@opencode-ai/plugin": "*"}
    (config / "package.json").write_text(json.dumps({"dependencies": deps}))
    (config / "package-lock.json").write_text(
        json.dumps({"lockfileVersion": 3, "packages": {"": {"dependencies": deps}}})
    )
    return env


def backend_args(backend, tokenizer_dir) -> list[str]:
    return ["--backend", backend.url, "--tokenizer", str(tokenizer_dir), "--tool-parser", "qwen25"]


def test_tool_call_is_executed_and_every_turn_is_captured_token_exact(tmp_path, backend, qwen_tokenizer_dir):
    require_binary("opencode")
    work, db = tmp_path / "work", tmp_path / "runs.sqlite"
    work.mkdir()
    env = opencode_home(tmp_path / "home")
    # OpenCode works in $PWD rather than its cwd; a launcher's stale PWD must not move it there.
    env["PWD"] = str(tmp_path)
    r = polar_run(
        [*backend_args(backend, qwen_tokenizer_dir), "--db", str(db), "--session", "oc-e2e"],
        ["opencode", "run", "-m", "openai/gpt-4o", "Create out.txt containing hi"],
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,  # `opencode run` appends a piped stdin to the message
    )
    assert r.returncode == 0, r.stderr
    # OpenCode sends a one-argument prompt wrapped in double quotes; the file still gets "hi".
    assert (work / "out.txt").read_text() == "hi\n"  # the harness ran the bash tool call
    assert not (tmp_path / "out.txt").exists()
    assert "Done. The command finished." in r.stdout  # ...and printed the final answer
    assert "session oc-e2e" in r.stderr and "3 turns" in r.stderr

    turns = list(read_turns(db, with_raw=True))
    # The title call runs alongside the first main turn, with the provider's small model.
    titles = [t for t in turns if t.tag == "title"]
    assert len(titles) == 1 and len(turns) == 3
    title_request = json.loads(titles[0].request)
    assert "title generator" in title_request["input"][0]["content"]
    assert "tools" not in title_request

    main = [t for t in turns if t.tag is None]
    t1, t2 = main_turns(db)
    assert [t1.id, t2.id] == [main[0].id, main[1].id]
    assert t1.style == t2.style == "openai-responses"
    assert t1.finish_reason == "tool_calls" and t2.finish_reason == "stop"
    call = json.loads(main[0].response)["tool_calls"][0]
    assert call["name"] == "bash" and "out.txt" in call["arguments"]["command"]
    # Turn 2 echoes the call and its result as Responses input items.
    items = json.loads(main[1].request)["input"]
    assert {"type": "function_call", "call_id": call["id"], "name": "bash"}.items() <= items[-2].items()
    assert items[-1]["type"] == "function_call_output" and items[-1]["call_id"] == call["id"]
    # Turn 2's prompt begins with turn 1's prompt + sampled ids, token for token.
    assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.output_ids)] == t1.prompt_ids + t1.output_ids
    assert_turns_match_backend(backend, db)
    session = sqlite3.connect(db).execute("SELECT harness, exit_code FROM sessions WHERE id='oc-e2e'")
    assert session.fetchone() == ("opencode", 0)
