"""Claude Code through the Claude Agent SDK for Python (PyPI `claude-agent-sdk`, which bundles its
own Claude Code), by `polar-mitm run -- python script.py`: the command names no harness, so `run`
picks the generic recipe, and Claude Code's rules apply to the requests that carry its user agent.
Its session-title call ("You are naming a coding session…") must be stored as a side call, never
as a main row; the task's two turns are token-exact."""

from __future__ import annotations

import sqlite3
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from polar_mitm.cache import cache_dir
from polar_mitm.store.reader import read_turns
from tests.support.harness import POLAR, assert_turns_match_backend, harness_env, main_turns, polar_run

pytestmark = pytest.mark.e2e

SDK_PYTHON = cache_dir() / "venvs" / "claude-agent-sdk" / "bin" / "python"
CLIENT = Path(__file__).with_name("claude_agent_sdk_client.py")


def test_the_agent_sdk_stores_its_title_call_as_a_side_call(tmp_path, backend, qwen_tokenizer_dir):
    if not SDK_PYTHON.exists():
        pytest.fail(f"{SDK_PYTHON} is missing; scripts/install.sh installs claude-agent-sdk")
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
            "sdk",
        ],
        [str(SDK_PYTHON), str(CLIENT), "Create out.txt containing hi"],
        cwd=work,
        env=harness_env(tmp_path / "home"),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert (work / "out.txt").read_text() == "hi\n"
    assert "result: success Done. The command finished." in r.stdout, r.stdout
    con = sqlite3.connect(db)
    assert con.execute("SELECT harness FROM sessions WHERE id='sdk'").fetchone() == ("generic",)

    turns = list(read_turns(db, with_raw=True))
    titles = [t for t in turns if "You are naming a coding session" in (t.request or "")]
    assert titles and all(t.tag == "title" for t in titles), [(t.tag, t.request_headers) for t in titles]
    assert all("agent-sdk/" in t.request_headers.get("user-agent", "") for t in turns)
    t1, t2 = main_turns(db)  # the title call is no main turn
    assert t1.finish_reason == "tool_calls" and t2.finish_reason == "stop"
    assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.output_ids)] == t1.prompt_ids + t1.output_ids
    assert_turns_match_backend(backend, db)

    out = tmp_path / "traj.parquet"
    e = subprocess.run(
        [*POLAR, "export", "--db", str(db), "--out", str(out), "-q"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert e.returncode == 0, e.stderr
    [row] = pq.read_table(out).to_pylist()  # no row of the title call
    assert row["role"] == "main" and row["turn_ids"] == [t1.id, t2.id]
