"""The real gptme (PyPI gptme 0.35.1, in its own virtualenv), unmodified, through `polar-mitm run`
with the recipe's headless command: Chat Completions over SSE at api.openai.com, native tool calls
(`--tool-format tool`). gptme ends when the model calls its `complete` tool, so the fake's script
answers the shell's output with that call. After each reply gptme asks for the conversation's
title (Responses, gpt-5-mini): a side call, tagged, not a row of its own."""

import json
import sqlite3
import subprocess

import pytest

from polar_mitm import recipes
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

SCRIPT = [
    {"match": "<tool_response>", "tool_call": {"name": "complete", "arguments": {}}},
    {"match": r"[Cc]reate ([^\s\"'`]+) containing ([^\s\"'`]+)", "shell": "printf '%s\\n' '\\2' > '\\1'"},
    {"match": "", "text": "Done."},
]


def test_gptme_does_the_shell_task_and_its_titles_are_side_calls(tmp_path, qwen_tokenizer_dir):
    require_binary("gptme")
    script = tmp_path / "script.json"
    script.write_text(json.dumps(SCRIPT))
    backend = FakeBackend(qwen_tokenizer_dir, "--script", str(script))
    try:
        work, db = tmp_path / "work", tmp_path / "runs.sqlite"
        work.mkdir()
        r = polar_run(
            ["--backend", backend.url, "--tokenizer", str(qwen_tokenizer_dir), "--db", str(db)]
            + ["--session", "gptme-e2e"],
            recipes.get("gptme").headless_command("Create out.txt containing hi"),
            cwd=work,
            env=harness_env(tmp_path / "home"),
            stdin=subprocess.DEVNULL,
        )
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        assert (work / "out.txt").read_text() == "hi\n"  # gptme ran the shell tool call
        t1, t2 = main_turns(db)  # the shell call, then `complete`
        raw = {t.id: t for t in read_turns(db, with_raw=True)}
        calls = [json.loads(raw[t.id].response)["tool_calls"][0]["name"] for t in (t1, t2)]
        assert calls == ["shell", "complete"] and t1.style == t2.style == "openai-chat"
        assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.output_ids)] == t1.prompt_ids + t1.output_ids
        assert_turns_match_backend(backend, db)
    finally:
        backend.stop()
    titles = [t for t in raw.values() if t.tag == "title"]
    assert titles and {t.style for t in titles} == {"openai-responses"}
    assert len(raw) == 2 + len(titles)  # nothing else
    con = sqlite3.connect(db)
    assert con.execute("SELECT harness, exit_code FROM sessions").fetchone() == ("gptme", 0)
