"""The real mini-swe-agent (PyPI mini-swe-agent, in its own virtualenv), unmodified, through
`polar-mitm run`: litellm's OpenAI Chat Completions at the default URL, its `bash` tool.

mini-swe-agent ends a run only when the model's command is its submit marker, so the fake's
script answers the tool's output with that command (the default script would answer in text,
which mini-swe-agent refuses as a format error and asks again).
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

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
SCRIPT = [
    {"match": "<tool_response>", "shell": SUBMIT},
    {"match": r"[Cc]reate ([^\s\"'`]+) containing ([^\s\"'`]+)", "shell": "printf '%s\\n' '\\2' > '\\1'"},
]


def test_bash_tool_task_is_done_and_every_turn_is_captured_token_exact(tmp_path, qwen_tokenizer_dir):
    require_binary("mini")
    script = tmp_path / "script.json"
    script.write_text(json.dumps(SCRIPT))
    backend = FakeBackend(qwen_tokenizer_dir, "--script", str(script))
    try:
        work, db = tmp_path / "work", tmp_path / "runs.sqlite"
        work.mkdir()
        args = ["--backend", backend.url, "--tokenizer", str(qwen_tokenizer_dir), "--db", str(db)]
        r = polar_run(
            [*args, "--session", "mini-e2e"],
            [
                "mini",
                "-y",
                "--exit-immediately",
                "-l",
                "0",
                "-m",
                "openai/gpt-4o",
                "-t",
                "Create out.txt containing hi",
            ],
            cwd=work,
            env=harness_env(tmp_path / "home"),
            stdin=subprocess.DEVNULL,
        )
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        assert (work / "out.txt").read_text() == "hi\n"  # mini-swe-agent ran the bash call
        assert "session mini-e2e" in r.stderr and "2 turns" in r.stderr
        t1, t2 = main_turns(db)
        assert t1.style == "openai-chat" and {t1.finish_reason, t2.finish_reason} == {"tool_calls"}
        [turn1] = [t for t in read_turns(db, with_raw=True) if t.id == t1.id]
        req = json.loads(turn1.request)
        assert [t["function"]["name"] for t in req["tools"]] == ["bash"]
        assert req["messages"][0]["role"] == "system"
        # Turn 2's prompt begins with turn 1's prompt + sampled ids, token for token.
        assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.output_ids)] == t1.prompt_ids + t1.output_ids
        assert_turns_match_backend(backend, db)
        con = sqlite3.connect(db)
        assert con.execute("SELECT harness, exit_code FROM sessions").fetchone() == ("mini-swe-agent", 0)
        assert {h for (h,) in con.execute("SELECT DISTINCT host FROM turns")} == {"api.openai.com"}
    finally:
        backend.stop()
