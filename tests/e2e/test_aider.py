"""The real aider (PyPI aider-chat, in its own virtualenv), unmodified, through `polar-mitm run`:
litellm's OpenAI Chat Completions over SSE at the default URL.

aider has no tools: the model writes the file in aider's `whole` edit format, aider applies it and
commits it in the git repository with a message from its weak model, a side call the recipe tags.
"""

import json
import sqlite3
import subprocess

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

COMMIT = "feat: add out.txt"
SCRIPT = [
    {"match": "one-line Git commit messages", "in": "prompt", "text": COMMIT},
    # aider's whole-file edit format: the file name, then its whole content fenced.
    {"match": r"[Cc]reate ([^\s\"'`]+) containing ([^\s\"'`]+)", "text": "\\1\n```\n\\2\n```"},
]


def test_file_edit_is_applied_and_committed_and_the_commit_message_call_is_tagged(
    tmp_path, qwen_tokenizer_dir
):
    require_binary("aider")
    script = tmp_path / "script.json"
    script.write_text(json.dumps(SCRIPT))
    backend = FakeBackend(qwen_tokenizer_dir, "--script", str(script))
    try:
        work, db = tmp_path / "work", tmp_path / "runs.sqlite"
        work.mkdir()
        git = ["git", "-C", str(work), "-c", "user.email=t@example.com", "-c", "user.name=t"]
        subprocess.run(["git", "init", "-q", str(work)], check=True)
        subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "init"], check=True)
        args = ["--backend", backend.url, "--tokenizer", str(qwen_tokenizer_dir), "--db", str(db)]
        r = polar_run(
            [*args, "--session", "aider-e2e"],
            [
                "aider",
                "--model",
                "openai/gpt-4o",
                "--edit-format",
                "whole",
                "--message",
                "Create out.txt containing hi",
            ],
            cwd=work,
            env=harness_env(tmp_path / "home"),
            stdin=subprocess.DEVNULL,
        )
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        assert (work / "out.txt").read_text() == "hi\n"  # aider applied the model's edit
        log = subprocess.run([*git, "log", "--format=%s"], capture_output=True, text=True, check=True).stdout
        assert log.splitlines()[0] == COMMIT  # ...and committed it with the weak model's message
        [main] = main_turns(db)
        assert main.style == "openai-chat" and main.finish_reason == "stop"
        [side] = [t for t in read_turns(db, with_raw=True) if t.tag is not None]
        assert side.tag == "commit-message" and side.model == "gpt-4o-mini"
        [raw] = [t for t in read_turns(db, with_raw=True) if t.id == main.id]
        req = json.loads(raw.request)
        assert req["stream"] is True and req["messages"][0]["role"] == "system"
        assert "whole" in r.stdout  # "with whole edit format"
        assert_turns_match_backend(backend, db)
        con = sqlite3.connect(db)
        assert con.execute("SELECT harness, exit_code FROM sessions").fetchone() == ("aider", 0)
        assert {h for (h,) in con.execute("SELECT DISTINCT host FROM turns")} == {"api.openai.com"}
    finally:
        backend.stop()
