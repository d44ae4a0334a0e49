"""The real Codex CLI binary (npm @openai/codex), unmodified, through `polar-mitm run`.

Codex speaks OpenAI Responses SSE to api.openai.com. Its default model uses the "responses-lite"
shape and code mode (the command runs inside the freeform `exec` tool's JavaScript); `-m gpt-5.5`
gets the classic shape with an `exec_command` function tool. `codex exec` is read-only by default,
so the tests pass `-s workspace-write`, as a user who wants files written would.
"""

import json
import sqlite3
import subprocess
from pathlib import Path

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

CODEX = ["codex", "exec", "--skip-git-repo-check", "-s", "workspace-write"]


def run_codex(
    tmp_path: Path,
    backend: FakeBackend,
    tokenizer_dir: Path,
    session: str,
    *codex_args: str,
    turns: int = 2,
    polar_args: tuple[str, ...] = (),
):
    require_binary("codex")
    work, db = tmp_path / "work", tmp_path / "runs.sqlite"
    work.mkdir()
    r = polar_run(
        [
            "--backend",
            backend.url,
            "--tokenizer",
            str(tokenizer_dir),
            "--tool-parser",
            "qwen25",
            "--db",
            str(db),
            "--session",
            session,
            *polar_args,
        ],
        [*CODEX, *codex_args, "Create out.txt containing hi"],
        cwd=work,
        env=harness_env(tmp_path / "home"),
        stdin=subprocess.DEVNULL,  # `codex exec` appends a piped stdin to the prompt
    )
    assert r.returncode == 0, r.stderr
    assert (work / "out.txt").read_text() == "hi\n"  # the harness ran the shell tool call
    assert "Done. The command finished." in r.stdout  # ...and printed the final answer
    assert f"session {session}" in r.stderr and f"{turns} turns" in r.stderr
    return db


def assert_spliced_and_exact(backend: FakeBackend, db: Path, session: str) -> None:
    t1, t2 = main_turns(db)
    assert t1.style == t2.style == "openai-responses"
    assert t1.finish_reason == "tool_calls" and t2.finish_reason == "stop"
    # Turn 2's prompt begins with turn 1's prompt + sampled ids, token for token.
    assert t2.prompt_ref == t1.id
    assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.output_ids)] == t1.prompt_ids + t1.output_ids
    assert_turns_match_backend(backend, db)
    row = (
        sqlite3.connect(db)
        .execute(f"SELECT harness, exit_code FROM sessions WHERE id='{session}'")
        .fetchone()
    )
    assert row == ("codex", 0)


def test_default_model_code_mode_tool_call_is_executed_and_captured_token_exact(
    tmp_path, backend, qwen_tokenizer_dir
):
    db = run_codex(tmp_path, backend, qwen_tokenizer_dir, "codex-e2e")
    turns = list(read_turns(db, with_raw=True))
    assert [t.tag for t in turns] == [None, None]
    first = json.loads(turns[0].request)
    # The responses-lite shape: no top-level tools, an additional_tools item with namespaces.
    assert not first.get("tools") and first["input"][0]["type"] == "additional_tools"
    call = json.loads(turns[0].response)["tool_calls"][0]
    assert call["name"] == "exec" and "tools.exec_command" in call["arguments"]["input"]
    # Turn 2 echoes the freeform call (as we rendered it) and its output.
    items = json.loads(turns[1].request)["input"]
    echoed = [i for i in items if i.get("type") == "custom_tool_call"]
    assert [(i["call_id"], i["name"], i["input"]) for i in echoed] == [
        (call["id"], "exec", call["arguments"]["input"])
    ]
    assert items[-1]["type"] == "custom_tool_call_output" and items[-1]["call_id"] == call["id"]
    assert_spliced_and_exact(backend, db, "codex-e2e")


def test_classic_shape_function_call_is_executed_and_captured_token_exact(
    tmp_path, backend, qwen_tokenizer_dir
):
    db = run_codex(tmp_path, backend, qwen_tokenizer_dir, "codex-classic", "-m", "gpt-5.5")
    turns = list(read_turns(db, with_raw=True))
    first = json.loads(turns[0].request)
    assert "exec_command" in [t.get("name") for t in first["tools"]]
    call = json.loads(turns[0].response)["tool_calls"][0]
    assert call["name"] == "exec_command" and "out.txt" in call["arguments"]["cmd"]
    items = json.loads(turns[1].request)["input"]
    assert {"type": "function_call", "call_id": call["id"], "name": "exec_command"}.items() <= items[
        -2
    ].items()
    assert items[-1]["type"] == "function_call_output" and items[-1]["call_id"] == call["id"]
    assert_spliced_and_exact(backend, db, "codex-classic")


REASONING_SCRIPT = [
    {"match": "<tool_response>", "reasoning": "It ran.", "text": "Done. The command finished."},
    {
        "match": "[Cc]reate (\\S+) containing (\\S+)",
        "reasoning": "I should write \\1.",
        "shell": "printf '%s\\n' '\\2' > '\\1'",
    },
]


def test_reasoning_is_echoed_back_and_still_spliced(tmp_path, qwen_tokenizer_dir):
    script = tmp_path / "script.json"
    script.write_text(json.dumps(REASONING_SCRIPT))
    backend = FakeBackend(qwen_tokenizer_dir, "--script", str(script))
    try:
        db = run_codex(tmp_path, backend, qwen_tokenizer_dir, "codex-reasoning")
        turns = list(read_turns(db, with_raw=True))
        assert json.loads(turns[0].response)["reasoning"].strip() == "I should write out.txt."
        # Codex keeps our reasoning item, encrypted_content included, and sends it back.
        [item] = [i for i in json.loads(turns[1].request)["input"] if i.get("type") == "reasoning"]
        assert item["encrypted_content"].startswith("polar-r1:")
        assert_spliced_and_exact(backend, db, "codex-reasoning")
    finally:
        backend.stop()


def test_backend_breaking_mid_stream_is_retried_by_codex(tmp_path, backend, qwen_tokenizer_dir):
    """A policy backend that dies mid-reply must look retryable to Codex (it gives up at once on
    OpenAI's "server_is_overloaded" code, which it reads as "model at capacity")."""
    backend.post("/_fake/fault", {"mode": "drop_midstream", "count": 1})
    # Streamed from the backend, so the tokens sampled before the break arrive and are kept (by
    # default a cumulative backend's reply is asked for whole: a break then leaves no tokens).
    stream = ("--backend-stream", "stream")
    db = run_codex(tmp_path, backend, qwen_tokenizer_dir, "codex-retry", turns=3, polar_args=stream)
    statuses = [t.status for t in read_turns(db)]
    assert statuses[0] == "error" and statuses[1:] == ["ok", "ok"]


COMPACTION_SCRIPT = [
    {"match": "<tool_response>", "text": "Done. The command finished."},
    {"match": "Summary of the earlier conversation", "text": "Done. The command finished."},
    {"match": "Context checkpoint", "text": "The user asked for out.txt containing hi; it was written."},
    {"match": "[Cc]reate (\\S+) containing (\\S+)", "shell": "printf '%s\\n' '\\2' > '\\1'"},
]


def test_auto_compaction_is_answered_by_the_policy_and_tagged(tmp_path, qwen_tokenizer_dir):
    script = tmp_path / "script.json"
    script.write_text(json.dumps(COMPACTION_SCRIPT))
    backend = FakeBackend(qwen_tokenizer_dir, "--script", str(script))
    try:
        # A tiny auto-compaction limit makes Codex compact after the first tool call.
        db = run_codex(
            tmp_path,
            backend,
            qwen_tokenizer_dir,
            "codex-compact",
            "-c",
            "model_auto_compact_token_limit=3000",
            turns=3,
        )
        t1, compact, t3 = list(read_turns(db, with_raw=True))
        assert compact.tag == "compaction" and t1.tag is None and t3.tag is None
        assert compact.prompt_ref == t1.id  # the summary request extends the conversation so far
        # Codex replaced its history with our compaction item, which reads back as the summary.
        [item] = [i for i in json.loads(t3.request)["input"] if i.get("type") == "compaction"]
        assert item["encrypted_content"].startswith("polar-c1:")
        assert_turns_match_backend(backend, db)
    finally:
        backend.stop()
