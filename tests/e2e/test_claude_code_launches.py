"""One Claude Code session, launched three ways: `polar-mitm run`, `polar-mitm rollout` (the local
runtime) and a node of `polar-mitm serve` (through `submit`). Each session carries its recipe, so
the same scripted session yields the same rows and the same tags whichever way it was launched
(before, a node's proxy had no recipe and tagged by every recipe's rules)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from polar_mitm.reconstruct.export import export
from polar_mitm.reconstruct.source import Selection
from polar_mitm.store.reader import read_turns
from tests.support.harness import POLAR, FakeBackend, harness_env, polar_run, require_binary
from tests.support.service import served_url

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# A task's words that happen to be another harness's side-call text (Gemini CLI's tool-output
# summary): only Claude Code's rules may judge a Claude Code session.
INSTRUCTION = "Begin the check. Summarize the following tool output in one line."
SCRIPT = [
    {"match": "step1-done", "text": "The check passed."},
    {"match": "[Bb]egin", "shell": "echo step1-done"},
]
TASKS = f'[[tasks]]\nid = "cc"\ninstruction = "{INSTRUCTION}"\nevaluator = {{kind = "session_completed"}}\n'


def shape(rows: list[dict]) -> list[tuple]:
    """What a trainer reads of rows, less what differs by launch alone (ids, the working directory
    in the system prompt): role, the parent's role, turns, finish, tags and the sampled tokens."""
    by_id = {r["trajectory_id"]: r for r in rows}
    out = []
    for r in rows:
        parent = by_id[r["parent_id"]]["role"] if r["parent_id"] in by_id else r["parent_id"]
        sampled = [t for t, m in zip(r["response_ids"], r["loss_mask"], strict=True) if m]
        tags = json.loads(r["metadata"]).get("tags", [])
        out.append((r["role"], parent, r["num_turns"], r["finish_reason"], tuple(tags), tuple(sampled)))
    return sorted(out)


def rows_of(db: Path, tmp: Path, strategy: str) -> list[dict]:
    out = tmp / f"{db.stem}-{strategy}.parquet"
    export(db, out, strategy=strategy, selection=Selection(include_side_calls=True), quiet=True)
    return pq.read_table(out).to_pylist()


def launched_by_serve(tmp: Path, backend: FakeBackend, tok: Path, env: dict[str, str]) -> tuple[Path, Path]:
    tmp.mkdir()
    db, log = tmp / "serve.sqlite", tmp / "serve.log"
    args = ["serve", "--listen", "127.0.0.1:0", "--db", str(db), "--allow-local-runtime"]
    proc = subprocess.Popen(
        [*POLAR, *args, "--backend", backend.url, "--tokenizer", str(tok)],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**env, "POLAR_MITM_SERVICE_TOKEN": "t" * 32},
    )
    try:
        url = served_url(log, proc)
        (tmp / "tasks.toml").write_text(TASKS)
        out = tmp / "served.parquet"
        r = subprocess.run(
            [*POLAR, "submit", str(tmp / "tasks.toml"), "--harness", "claude-code", "--runtime", "local",
             "--server", url, "--wait", "--out", str(out)],
            capture_output=True, text=True, timeout=240, env={**env, "POLAR_MITM_SERVICE_TOKEN": "t" * 32},
        )  # fmt: skip
        assert r.returncode == 0, r.stderr + log.read_text()[-3000:]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    return Path(str(db).replace(".sqlite", ".node0.sqlite")), out


def test_run_rollout_and_a_node_export_the_same_rows_and_tags(tmp_path, qwen_tokenizer_dir):
    require_binary("claude")
    script = tmp_path / "script.json"
    script.write_text(json.dumps(SCRIPT))
    backend = FakeBackend(qwen_tokenizer_dir, "--script", str(script))
    env = harness_env(tmp_path / "home")
    policy = ["--backend", backend.url, "--tokenizer", str(qwen_tokenizer_dir)]
    work = tmp_path / "work"
    work.mkdir()
    try:
        run_db = tmp_path / "run.sqlite"
        headless = ["claude", "-p", INSTRUCTION, "--allowedTools", "Bash,Read,Write,Edit"]  # the recipe's
        r = polar_run([*policy, "--db", str(run_db)], headless, cwd=work, env=env)
        assert r.returncode == 0 and "The check passed." in r.stdout, r.stdout + r.stderr
        rollout_db = tmp_path / "rollout.sqlite"
        (tmp_path / "tasks.toml").write_text(TASKS)
        r = subprocess.run(
            [*POLAR, "rollout", str(tmp_path / "tasks.toml"), "--harness", "claude-code", "--runtime", "local",
             *policy, "--db", str(rollout_db)],
            capture_output=True, text=True, timeout=240, cwd=work, env=env,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        node_db, served = launched_by_serve(tmp_path / "serve", backend, qwen_tokenizer_dir, env)
    finally:
        backend.stop()
    tags = {db.stem: [t.tag for t in read_turns(db)] for db in (run_db, rollout_db, node_db)}
    assert tags["run"] == tags["rollout"] == tags["serve.node0"] == [None, None], tags
    for strategy in ("prefix-merge", "per-request"):
        want = shape(rows_of(run_db, tmp_path, strategy))
        assert {r[0] for r in want} >= {"main"}
        assert shape(rows_of(rollout_db, tmp_path, strategy)) == want, strategy
        assert shape(rows_of(node_db, tmp_path, strategy)) == want, strategy
    # What the trainer got from the server: the node's prefix-merge rows, main ones.
    main_rows = [r for r in shape(rows_of(run_db, tmp_path, "prefix-merge")) if r[0] == "main"]
    assert [r for r in shape(pq.read_table(served).to_pylist()) if r[0] == "main"] == main_rows
    assert sqlite3.connect(rollout_db).execute(
        "SELECT harness FROM sessions WHERE harness IS NOT NULL"
    ).fetchall() == [("claude-code",)]
