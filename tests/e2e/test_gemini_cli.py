"""The real Gemini CLI binary (npm @google/gemini-cli), unmodified, through `polar-mitm run`."""

import json
import sqlite3

import pytest

from polar_mitm.store.reader import read_turns
from polar_mitm.store.requests import RequestReader
from tests.support.harness import (
    FakeBackend,
    assert_turns_match_backend,
    harness_env,
    main_turns,
    polar_run,
    require_binary,
)

pytestmark = pytest.mark.e2e


# A thinking policy that is slow to start: every reply opens with a <think> block, and the first
# token comes after the proxy's 5 s keep-alive interval.
THINKING_SCRIPT = [
    {"match": "<tool_response>", "reasoning": "The file is written.", "text": "Done. The command finished."},
    {
        "match": "[Cc]reate (\\S+) containing (\\S+)",
        "reasoning": "I should use the shell tool.",
        "text": "Creating \\1.",
        "shell": "printf '%s\\n' '\\2' > '\\1'",
    },
]


@pytest.fixture
def thinking_backend(qwen_tokenizer_dir, tmp_path):
    script = tmp_path / "script.json"
    script.write_text(json.dumps(THINKING_SCRIPT))
    b = FakeBackend(qwen_tokenizer_dir, "--script", str(script), "--first-token-delay", "6")
    yield b
    b.stop()


def test_tool_call_is_executed_and_every_turn_is_captured_token_exact(tmp_path, backend, qwen_tokenizer_dir):
    require_binary("gemini")
    work, db = tmp_path / "work", tmp_path / "runs.sqlite"
    work.mkdir()
    r = polar_run(
        [
            "--backend",
            backend.url,
            "--tokenizer",
            str(qwen_tokenizer_dir),
            "--tool-parser",
            "qwen25",
            "--db",
            str(db),
            "--session",
            "gemini-e2e",
        ],
        # --yolo: headless Gemini CLI declares no shell tool unless tool calls are pre-approved.
        ["gemini", "-p", "Create out.txt containing hi", "--yolo"],
        cwd=work,
        env=harness_env(tmp_path / "home"),
    )
    assert r.returncode == 0, r.stderr
    assert (work / "out.txt").read_text() == "hi\n"  # the harness ran run_shell_command
    assert "Done. The command finished." in r.stdout  # ...and printed the final answer
    assert "session gemini-e2e" in r.stderr and "3 turns" in r.stderr  # router + 2 agent turns

    turns = list(read_turns(db, with_raw=True))
    con = sqlite3.connect(db)
    paths = dict(con.execute("SELECT id, path FROM turns"))

    # The router call (JSON constrained by its responseJsonSchema) is tagged, not a main turn.
    [router] = [t for t in turns if t.tag == "router"]
    assert paths[router.id].endswith(":generateContent")
    assert "responseJsonSchema" in json.loads(router.request)["generationConfig"]
    answer = json.loads(json.loads(router.response)["text"])  # schema-valid JSON: the CLI takes it
    assert set(answer) == {"complexity_reasoning", "complexity_score"}
    # A score outside 1-100 (the range is only in the schema's description) makes the CLI print a
    # long stack trace before it falls back to its default model.
    assert 1 <= answer["complexity_score"] <= 100
    assert "complexity_score" not in r.stderr and "    at " not in r.stderr, r.stderr

    t1, t2 = main_turns(db)
    assert t1.finish_reason == "tool_calls" and t2.finish_reason == "stop"
    assert paths[t1.id].endswith(":streamGenerateContent?alt=sse")
    [call] = json.loads(next(t.response for t in turns if t.id == t1.id))["tool_calls"]
    assert call["name"] == "run_shell_command"
    # Turn 2 echoes turn 1's functionCall (the CLI rewrites its id); its prompt still begins with
    # turn 1's prompt + sampled ids, token for token.
    echoed = json.loads(next(t.request for t in turns if t.id == t2.id))["contents"][-2]
    assert echoed["role"] == "model" and echoed["parts"][0]["functionCall"]["id"].endswith(call["id"])
    assert t2.prompt_ref == t1.id
    assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.output_ids)] == t1.prompt_ids + t1.output_ids
    assert_turns_match_backend(backend, db)

    # The dummy API key went out as x-goog-api-key and was never stored.
    headers = RequestReader(con).headers(t1.id)  # stored as what changed since the side call's
    assert headers["x-goog-api-key"] == "[redacted]"
    assert con.execute("SELECT harness, exit_code FROM sessions WHERE id='gemini-e2e'").fetchone() == (
        "gemini-cli",
        0,
    )


def test_thought_parts_and_keepalives_reach_the_real_cli(tmp_path, thinking_backend, qwen_tokenizer_dir):
    """Reasoning streams as `thought: true` parts, which the CLI drops from the history it echoes;
    blank-line keep-alives during a slow first token do not upset the SDK's stream parser."""
    require_binary("gemini")
    work, db = tmp_path / "work", tmp_path / "runs.sqlite"
    work.mkdir()
    r = polar_run(
        ["--backend", thinking_backend.url, "--tokenizer", str(qwen_tokenizer_dir), "--db", str(db)],
        ["gemini", "-p", "Create notes.txt containing thoughts", "--yolo"],
        cwd=work,
        env=harness_env(tmp_path / "home"),
    )
    assert r.returncode == 0, r.stderr
    assert (work / "notes.txt").read_text() == "thoughts\n"
    assert "Done. The command finished." in r.stdout
    assert "I should use the shell tool." not in r.stdout  # thoughts are not the answer

    turns = {t.id: t for t in read_turns(db, with_raw=True)}
    t1, t2 = main_turns(db)
    first = json.loads(turns[t1.id].response)
    assert first["reasoning"].strip() == "I should use the shell tool." and first["tool_calls"]
    echoed = json.loads(turns[t2.id].request)["contents"][-2]
    assert echoed["role"] == "model" and not any(p.get("thought") for p in echoed["parts"])
    assert t2.prompt_ref == t1.id  # the echo without its thoughts still splices
    assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.output_ids)] == t1.prompt_ids + t1.output_ids
    assert_turns_match_backend(thinking_backend, db)


def test_gemini_cli_through_a_shared_proxy_with_two_workers(tmp_path, backend, qwen_tokenizer_dir, certs_dir):
    """The gemini-cli line a `proxy --workers 2` prints, pasted into a shell: the front hands each
    of the CLI's connections to its session's worker, and the turns splice as through one proxy."""
    from tests.support.harness import harness_in_shell, shared_proxy

    require_binary("gemini")
    db = tmp_path / "shared.sqlite"
    with shared_proxy(
        backend, qwen_tokenizer_dir, db, certs_dir, "--workers", "2", "--tool-parser", "qwen25"
    ) as printed:
        printed.until("# gemini-cli: ")
        exports = printed.next().replace("SESSION", "gem-workers")
        harness_in_shell(exports, "gemini -p 'Create out.txt containing hi' --yolo", tmp_path)
    t1, t2 = main_turns(db)
    assert {t.session_id for t in read_turns(db)} == {"gem-workers"}
    assert t2.prompt_ref == t1.id
    assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.output_ids)] == t1.prompt_ids + t1.output_ids
    assert_turns_match_backend(backend, db)
