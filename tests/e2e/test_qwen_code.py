"""The real Qwen Code binary (npm @qwen-code/qwen-code), unmodified, through `polar-mitm run`.

With `--auth-type openai` Qwen Code calls DashScope's OpenAI-compatible Chat Completions endpoint
(dashscope.aliyuncs.com/compatible-mode/v1). In `-p` mode it offers its shell tool only when shell
calls are approved up front, hence `--yolo`.
"""

import json
import sqlite3

import pytest

from polar_mitm.store.reader import read_turns
from tests.support.harness import (
    FakeBackend,
    assert_turns_match_backend,
    harness_env,
    main_turns,
    polar_run,
    require_binary,
)

pytestmark = pytest.mark.e2e

QWEN = ["qwen", "--auth-type", "openai", "-m", "gpt-4o", "--yolo", "-p"]


def polar_args(backend, tokenizer_dir, db, session):
    return [
        "--backend",
        backend.url,
        "--tokenizer",
        str(tokenizer_dir),
        "--db",
        str(db),
        "--session",
        session,
    ]


def stored(db, turn_id, column) -> dict:
    """The raw request Qwen Code sent, or the neutral completion we answered, as the store's
    reader gives it back (a request may be stored as what changed since an earlier one)."""
    assert column in ("request", "response")
    [turn] = [t for t in read_turns(db, with_raw=True) if t.id == turn_id]
    return json.loads(getattr(turn, column))


def test_shell_tool_call_is_executed_and_every_turn_is_captured_token_exact(
    tmp_path, backend, qwen_tokenizer_dir
):
    require_binary("qwen")
    work, db = tmp_path / "work", tmp_path / "runs.sqlite"
    work.mkdir()
    r = polar_run(
        polar_args(backend, qwen_tokenizer_dir, db, "qwen-e2e"),
        [*QWEN, "Create out.txt containing hi"],
        cwd=work,
        env=harness_env(tmp_path / "home"),
    )
    assert r.returncode == 0, r.stderr
    assert (work / "out.txt").read_text() == "hi\n"  # Qwen Code ran the run_shell_command call
    assert "Done. The command finished." in r.stdout  # ...and printed the final answer
    assert "session qwen-e2e" in r.stderr and "2 turns" in r.stderr

    t1, t2 = main_turns(db)
    assert t1.style == "openai-chat" and t1.finish_reason == "tool_calls" and t2.finish_reason == "stop"
    [call] = stored(db, t1.id, "response")["tool_calls"]
    assert call["name"] == "run_shell_command" and "out.txt" in call["arguments"]["command"]
    # Qwen Code streamed with usage, and echoed our call (id and arguments) in turn 2.
    req1, req2 = stored(db, t1.id, "request"), stored(db, t2.id, "request")
    assert req1["stream"] is True and req1["stream_options"] == {"include_usage": True}
    echoed = [m for m in req2["messages"] if m["role"] == "assistant" and m.get("tool_calls")]
    assert echoed[-1]["tool_calls"][0]["id"] == call["id"]
    assert req2["messages"][-1]["role"] == "tool" and req2["messages"][-1]["tool_call_id"] == call["id"]
    # Turn 2's prompt begins with turn 1's prompt + sampled ids, token for token.
    assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.output_ids)] == t1.prompt_ids + t1.output_ids
    assert t2.prompt_ref == t1.id
    assert_turns_match_backend(backend, db)
    con = sqlite3.connect(db)
    assert con.execute("SELECT harness, exit_code FROM sessions WHERE id='qwen-e2e'").fetchone() == (
        "qwen-code",
        0,
    )
    assert {h for (h,) in con.execute("SELECT DISTINCT host FROM turns")} == {"dashscope.aliyuncs.com"}


def test_reasoning_reaches_qwen_code_and_the_memory_extractor_is_tagged(tmp_path, qwen_tokenizer_dir):
    """A plain answer makes Qwen Code run its managed-memory extractor after the turn, as a
    forked agent that re-sends the conversation; that side call is tagged in the store."""
    require_binary("qwen")
    script = tmp_path / "script.json"
    script.write_text(
        json.dumps(
            [
                {"match": "Managed memory directory", "text": "Nothing durable to save."},
                {
                    "match": "",
                    "reasoning": "The user greets me.",
                    "text": "Hello from Qwen through polar-mitm.",
                },
            ]
        )
    )
    backend = FakeBackend(qwen_tokenizer_dir, "--script", str(script))
    try:
        work, db = tmp_path / "work", tmp_path / "runs.sqlite"
        work.mkdir()
        r = polar_run(
            polar_args(backend, qwen_tokenizer_dir, db, "qwen-side"),
            [*QWEN, "hi"],
            cwd=work,
            env=harness_env(tmp_path / "home"),
        )
        assert r.returncode == 0, r.stderr
        assert "Hello from Qwen through polar-mitm." in r.stdout
        [main] = main_turns(db)
        assert main.finish_reason == "stop"
        assert stored(db, main.id, "response")["reasoning"].strip() == "The user greets me."
        side = [t for t in read_turns(db) if t.tag is not None]
        assert side and {t.tag for t in side} == {"memory-extract"}
        # The extractor re-sends the main conversation: our reasoning came back as reasoning_content.
        history = stored(db, side[0].id, "request")["messages"]
        replies = [m for m in history if m["role"] == "assistant" and m.get("reasoning_content")]
        assert replies and replies[-1]["reasoning_content"].strip() == "The user greets me."
        assert_turns_match_backend(backend, db)
    finally:
        backend.stop()
