"""The real GitHub Copilot CLI (npm @github/copilot) with BYOK, unmodified, through `polar-mitm run`
with the recipe's headless command: OpenAI Chat Completions at api.openai.com, its `bash` tool
called by the fake's default script, no GitHub login."""

import json
import sqlite3
import subprocess

import pytest

from polar_mitm import recipes
from polar_mitm.store.db import read_turns
from tests.e2e.harness import assert_turns_match_backend, harness_env, main_turns, polar_run, require_binary

pytestmark = pytest.mark.e2e


def test_bash_task_is_done_and_every_turn_is_captured_token_exact(tmp_path, backend, qwen_tokenizer_dir):
    require_binary("copilot")
    work, db = tmp_path / "work", tmp_path / "runs.sqlite"
    work.mkdir()
    r = polar_run(
        [
            "--backend",
            backend.url,
            "--tokenizer",
            str(qwen_tokenizer_dir),
            "--db",
            str(db),
            "--session",
            "copilot-e2e",
        ],
        recipes.get("copilot").headless_command("Create out.txt containing hi"),
        cwd=work,
        env=harness_env(tmp_path / "home"),
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert (work / "out.txt").read_text() == "hi\n"  # Copilot CLI ran the bash call
    assert "session copilot-e2e" in r.stderr and "2 turns" in r.stderr
    t1, t2 = main_turns(db)
    assert t1.style == "openai-chat" and t1.finish_reason == "tool_calls" and t2.finish_reason == "stop"
    raw = {t.id: t for t in read_turns(db, with_raw=True)}
    [call] = json.loads(raw[t1.id].response)["tool_calls"]
    assert call["name"] == "bash"
    tools = json.loads(raw[t1.id].request)["tools"]
    # Its apply_patch grammar tool comes as a Chat `custom` tool, and is accepted.
    assert ("custom", "apply_patch") in {
        (t["type"], (t.get("function") or t.get("custom") or {}).get("name")) for t in tools
    }
    assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.output_ids)] == t1.prompt_ids + t1.output_ids
    assert_turns_match_backend(backend, db)
    con = sqlite3.connect(db)
    assert con.execute("SELECT harness, exit_code FROM sessions").fetchone() == ("copilot", 0)
    assert {h for (h,) in con.execute("SELECT DISTINCT host FROM turns")} == {"api.openai.com"}
