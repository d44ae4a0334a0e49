"""The real Kilo Code CLI (npm @kilocode/cli), unmodified, through `polar-mitm run` with the recipe's
headless command: OpenAI Responses over SSE, its `bash` tool called by the fake's default script,
and its title call (a small model) tagged, so it is no second trajectory.

Kilo sends the title call only some of the time (not on every fresh start, unlike OpenCode), so
the run test checks that any call it made is tagged, and tests/test_recipe_side_calls.py checks
the tag on the request Kilo sends."""

import json
import sqlite3
import subprocess

import pytest

from polar_mitm import recipes
from polar_mitm.store.db import read_turns
from tests.e2e.harness import assert_turns_match_backend, harness_env, main_turns, polar_run, require_binary

pytestmark = pytest.mark.e2e


def test_bash_task_is_done_the_title_call_tagged_and_every_turn_token_exact(
    tmp_path, backend, qwen_tokenizer_dir
):
    require_binary("kilo")
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
            "kilo-e2e",
        ],
        recipes.get("kilo").headless_command("Create out.txt containing hi"),
        cwd=work,
        env=harness_env(tmp_path / "home"),
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert (work / "out.txt").read_text() == "hi\n"  # Kilo ran the bash call
    assert "Done. The command finished." in r.stdout
    t1, t2 = main_turns(db)
    assert t1.style == "openai-responses" and t1.finish_reason == "tool_calls" and t2.finish_reason == "stop"
    raw = {t.id: t for t in read_turns(db, with_raw=True)}
    [call] = json.loads(raw[t1.id].response)["tool_calls"]
    assert call["name"] == "bash"
    # Every other call is the title call, on its small model, and tagged.
    assert {(t.tag, t.model) for t in raw.values() if t.tag is not None or t.model != "gpt-4o"} <= {
        ("title", "gpt-5.4-nano")
    }
    assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.output_ids)] == t1.prompt_ids + t1.output_ids
    assert_turns_match_backend(backend, db)
    con = sqlite3.connect(db)
    assert con.execute("SELECT harness, exit_code FROM sessions").fetchone() == ("kilo", 0)
    assert {h for (h,) in con.execute("SELECT DISTINCT host FROM turns")} == {"api.openai.com"}
