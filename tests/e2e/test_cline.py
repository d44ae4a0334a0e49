"""The real Cline CLI (npm cline), unmodified, through `polar-mitm run` with the recipe's headless
command: OpenAI Responses over SSE, its `run_commands` tool called by the fake's default script."""

import json
import sqlite3
import subprocess

import pytest

from polar_mitm import recipes
from polar_mitm.store.db import read_turns
from tests.e2e.harness import assert_turns_match_backend, harness_env, main_turns, polar_run, require_binary

pytestmark = pytest.mark.e2e


def test_run_commands_task_is_done_and_every_turn_is_captured_token_exact(
    tmp_path, backend, qwen_tokenizer_dir
):
    require_binary("cline")
    work, db = tmp_path / "work", tmp_path / "runs.sqlite"
    work.mkdir()
    cmd = recipes.get("cline").headless_command("Create out.txt containing hi")
    r = polar_run(
        [
            "--backend",
            backend.url,
            "--tokenizer",
            str(qwen_tokenizer_dir),
            "--db",
            str(db),
            "--session",
            "cline-e2e",
        ],
        cmd,
        cwd=work,
        env=harness_env(tmp_path / "home"),
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert (work / "out.txt").read_text() == "hi\n"  # Cline ran the run_commands call
    assert "Done. The command finished." in r.stdout
    assert "session cline-e2e" in r.stderr and "2 turns" in r.stderr
    t1, t2 = main_turns(db)
    assert t1.style == "openai-responses" and t1.finish_reason == "tool_calls" and t2.finish_reason == "stop"
    raw = {t.id: t for t in read_turns(db, with_raw=True)}
    [call] = json.loads(raw[t1.id].response)["tool_calls"]
    assert call["name"] == "run_commands" and call["arguments"]["commands"] == [
        "printf '%s\\n' 'hi' > 'out.txt'"
    ]
    assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.output_ids)] == t1.prompt_ids + t1.output_ids
    assert_turns_match_backend(backend, db)
    con = sqlite3.connect(db)
    assert con.execute("SELECT harness, exit_code FROM sessions").fetchone() == ("cline", 0)
    assert {h for (h,) in con.execute("SELECT DISTINCT host FROM turns")} == {"api.openai.com"}
    # The API key flag's value is not stored.
    [(command,)] = con.execute("SELECT command FROM sessions").fetchall()
    assert "sk-polar-mitm-dummy" not in command and "[redacted]" in command
    # No background hub daemon outlives the run (it would keep this run's proxy address).
    ps = subprocess.run(["ps", "-eww", "-o", "pid=,args="], capture_output=True, text=True).stdout
    left = [
        line.split(None, 1) for line in ps.splitlines() if "--cline-hub-daemon" in line and str(work) in line
    ]
    for pid, _ in left:  # ours (started in this test's work directory): do not leave it running
        subprocess.run(["kill", pid], check=False)
    assert not left
