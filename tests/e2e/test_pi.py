"""The real Pi binary (npm @mariozechner/pi-coding-agent), unmodified, through `polar-mitm run`.

Pi speaks OpenAI Responses SSE to api.openai.com with `--provider openai`; it has no permission
prompts, so its bash tool runs unattended in print mode (-p).
"""

import json
import sqlite3
import subprocess

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


def backend_args(backend, tokenizer_dir) -> list[str]:
    return ["--backend", backend.url, "--tokenizer", str(tokenizer_dir), "--tool-parser", "qwen25"]


def test_tool_call_is_executed_and_every_turn_is_captured_token_exact(tmp_path, backend, qwen_tokenizer_dir):
    require_binary("pi")
    work, db = tmp_path / "work", tmp_path / "runs.sqlite"
    work.mkdir()
    r = polar_run(
        [*backend_args(backend, qwen_tokenizer_dir), "--db", str(db), "--session", "pi-e2e"],
        ["pi", "-p", "--provider", "openai", "--model", "gpt-4o", "Create out.txt containing hi"],
        cwd=work,
        env=harness_env(tmp_path / "home"),
        stdin=subprocess.DEVNULL,  # Pi reads a piped stdin to its end before it starts
    )
    assert r.returncode == 0, r.stderr
    assert (work / "out.txt").read_text() == "hi\n"  # the harness ran the bash tool call
    assert "Done. The command finished." in r.stdout  # ...and printed the final answer
    assert "session pi-e2e" in r.stderr and "2 turns" in r.stderr

    turns = list(read_turns(db, with_raw=True))
    assert [t.tag for t in turns] == [None, None]  # Pi makes no side calls
    t1, t2 = main_turns(db)
    assert t1.style == t2.style == "openai-responses"
    assert t1.finish_reason == "tool_calls" and t2.finish_reason == "stop"
    call = json.loads(turns[0].response)["tool_calls"][0]
    assert call["name"] == "bash" and "out.txt" in call["arguments"]["command"]
    # Turn 2 echoes the call and its result as Responses input items.
    items = json.loads(turns[1].request)["input"]
    assert {"type": "function_call", "call_id": call["id"], "name": "bash"}.items() <= items[-2].items()
    assert items[-1]["type"] == "function_call_output" and items[-1]["call_id"] == call["id"]
    # Turn 2's prompt begins with turn 1's prompt + sampled ids, token for token.
    assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.output_ids)] == t1.prompt_ids + t1.output_ids
    assert_turns_match_backend(backend, db)
    session = sqlite3.connect(db).execute("SELECT harness, exit_code FROM sessions WHERE id='pi-e2e'")
    assert session.fetchone() == ("pi", 0)
