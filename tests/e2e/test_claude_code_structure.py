"""Real Claude Code's structure in the export, both strategies: a subagent (its Agent tool) is a
`subagent` row whose parent_id is the main row, linked through the Agent call's id; a compacted
conversation (its own /compact, or the compaction it makes when the policy refuses a prompt past
its context) is a `compaction` row whose parent is the summarized row, never a subagent."""

import json
import subprocess

import pyarrow.parquet as pq
import pytest

from polar_mitm.store.reader import read_turns
from tests.support.harness import (
    CLAUDE_SUBAGENT_SCRIPT,
    POLAR,
    FakeBackend,
    assert_turns_match_backend,
    harness_env,
    polar_run,
    require_binary,
)

pytestmark = pytest.mark.e2e


def test_a_subagent_exports_as_a_subagent_row_linked_to_the_main_row(tmp_path, qwen_tokenizer_dir):
    require_binary("claude")
    script = tmp_path / "script.json"
    script.write_text(json.dumps(CLAUDE_SUBAGENT_SCRIPT))
    backend = FakeBackend(qwen_tokenizer_dir, "--script", str(script))
    try:
        work, db = tmp_path / "work", tmp_path / "runs.sqlite"
        work.mkdir()
        r = polar_run(
            ["--backend", backend.url, "--tokenizer", str(qwen_tokenizer_dir), "--db", str(db)],
            ["claude", "-p", "Begin the check with a subagent", "--allowedTools", "Agent,Bash"],
            cwd=work,
            env=harness_env(tmp_path / "home"),
        )
        assert r.returncode == 0, r.stderr
        assert "Main agent done." in r.stdout, r.stdout
        assert_turns_match_backend(backend, db)
    finally:
        backend.stop()
    out = tmp_path / "traj.parquet"
    e = subprocess.run(
        [*POLAR, "export", "--db", str(db), "--out", str(out), "-q"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert e.returncode == 0, e.stderr
    rows = pq.read_table(out).to_pylist()
    [main] = [r for r in rows if r["role"] == "main"]
    [sub] = [r for r in rows if r["role"] == "subagent"]
    assert main["parent_id"] is None and sub["parent_id"] == main["trajectory_id"]
    meta = json.loads(sub["metadata"])
    assert meta["spawned_by_tool"] == "Agent" and meta["spawned_by_tool_call"]
    assert meta["parent_turn_id"] in main["turn_ids"]
    # Before 2.1.33x the Agent call waited for the subagent (2 main turns); since, the agent runs
    # in the background: the call is answered at once, the main agent answers that, and once more
    # when it is told the agent finished (3).
    assert main["num_turns"] in (2, 3) and sub["num_turns"] >= 1
    # Per-request rows take role and parent from the same pass: the subagent's turns are
    # `subagent` rows whose parent is the turn that made the Agent call (a row of its own).
    per = tmp_path / "turns.parquet"
    e = subprocess.run(
        [*POLAR, "export", "--db", str(db), "--strategy", "per-request", "--out", str(per), "-q"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert e.returncode == 0, e.stderr
    turns = {r["trajectory_id"]: r for r in pq.read_table(per).to_pylist()}
    assert {t: turns[t]["role"] for t in sub["turn_ids"]} == dict.fromkeys(sub["turn_ids"], "subagent")
    assert {turns[t]["parent_id"] for t in sub["turn_ids"]} == {meta["parent_turn_id"]}
    assert {turns[t]["role"] for t in main["turn_ids"]} == {"main"}


COMPACT_SCRIPT = [
    {"match": "SUMMARY-MARKER", "in": "prompt", "text": "Carrying on after the compaction."},
    {
        "match": "[Ss]ummar",
        "text": "SUMMARY-MARKER The user asked to begin the check. The assistant ran it and reported that "
        "everything passed; nothing else is pending. The next step is to wait for new instructions "
        "from the user about the repository and its tests.",
    },
    {"match": "step2-done", "text": "First answer."},
    {"match": "step1-done", "shell": "echo step2-done"},
    {"match": "[Bb]egin", "shell": "echo step1-done"},
]


def test_a_compacted_session_exports_a_compaction_row_linked_to_the_summarized_row(
    tmp_path, qwen_tokenizer_dir
):
    """Claude Code's own /compact, driven headless (`-p --continue "/compact"`), then one more
    prompt: the conversation that carries the summary is a `compaction` row whose parent is the
    row of the conversation it summarized."""
    require_binary("claude")
    script = tmp_path / "script.json"
    script.write_text(json.dumps(COMPACT_SCRIPT))
    backend = FakeBackend(qwen_tokenizer_dir, "--script", str(script))
    work, db = tmp_path / "work", tmp_path / "runs.sqlite"
    work.mkdir()
    env = harness_env(tmp_path / "home")
    opts = [
        "--backend",
        backend.url,
        "--tokenizer",
        str(qwen_tokenizer_dir),
        "--db",
        str(db),
        "--session",
        "cc",
    ]
    try:
        for args, says in (
            (["-p", "Begin the check", "--allowedTools", "Bash"], "First answer."),
            (["-p", "--continue", "/compact"], ""),
            (["-p", "--continue", "What next?"], "Carrying on after the compaction."),
        ):
            r = polar_run(opts, ["claude", *args], cwd=work, env=env)
            assert r.returncode == 0 and says in r.stdout, r.stdout + r.stderr
        assert_turns_match_backend(backend, db)
    finally:
        backend.stop()
    out = tmp_path / "traj.parquet"
    e = subprocess.run(
        [*POLAR, "export", "--db", str(db), "--out", str(out), "-q"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert e.returncode == 0, e.stderr
    rows = {r["trajectory_id"]: r for r in pq.read_table(out).to_pylist()}
    [compaction] = [r for r in rows.values() if r["role"] == "compaction"]
    parent = rows[compaction["parent_id"]]
    assert parent["role"] == "main" and parent["num_turns"] == 3  # the conversation that was summarized
    meta = json.loads(compaction["metadata"])
    assert meta["summary_turn_id"] in rows and meta["summary_turn_id"] != parent["trajectory_id"]


REACTIVE_SCRIPT = [
    {"match": "SUMMARY-MARKER", "in": "prompt", "text": "Carrying on after the compaction."},
    {
        "match": "[Ss]ummar",
        "text": "<summary>SUMMARY-MARKER The user asked to begin the check. The assistant ran a command "
        "that printed a long list of words, one after another, and read all of it; the check is under "
        "way and nothing else is pending. The next step is to report that the check passed.</summary>",
    },
    {"match": "[Bb]egin", "shell": "python3 -c \"print('word ' * 1500)\""},
]


def test_a_session_past_the_policys_context_compacts_into_a_compaction_row_not_a_subagent(
    tmp_path, qwen_tokenizer_dir
):
    """A small-context policy: turn 1 (Claude Code's system prompt and tools, ~11.7k tokens) fits,
    turn 2 (with ~1.5k tokens of tool output) is past it,
    the gateway answers 'prompt is too long' and Claude Code compacts on its own. The refused
    request is never stored, so the Bash call looks open: the conversation that carries the
    summary is still a `compaction` row whose parent is the summarized row, no `subagent` (before
    the structure pass it was a subagent "spawned by Bash"), in both strategies."""
    require_binary("claude")
    script = tmp_path / "script.json"
    script.write_text(json.dumps(REACTIVE_SCRIPT))
    backend = FakeBackend(qwen_tokenizer_dir, "--script", str(script))
    work, db = tmp_path / "work", tmp_path / "runs.sqlite"
    work.mkdir()
    try:
        r = polar_run(
            ["--backend", backend.url, "--tokenizer", str(qwen_tokenizer_dir), "--db", str(db),
             "--context-length", "12800"],
            ["claude", "-p", "Begin the check", "--allowedTools", "Bash"],
            cwd=work,
            env=harness_env(tmp_path / "home"),
        )  # fmt: skip
        assert r.returncode == 0 and "Carrying on after the compaction." in r.stdout, r.stdout + r.stderr
        assert_turns_match_backend(backend, db)
    finally:
        backend.stop()
    first = next(read_turns(db)).id
    for strategy in ("prefix-merge", "per-request"):
        out = tmp_path / f"{strategy}.parquet"
        e = subprocess.run(
            [*POLAR, "export", "--db", str(db), "--strategy", strategy, "--out", str(out), "-q"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert e.returncode == 0, e.stderr
        rows = {r["trajectory_id"]: r for r in pq.read_table(out).to_pylist()}
        assert "subagent" not in {r["role"] for r in rows.values()}, strategy
        [compaction] = [r for r in rows.values() if r["role"] == "compaction"]
        parent = rows[compaction["parent_id"]]
        # The summarized conversation: the one whose Bash call the refused request answered.
        assert parent["role"] == "main" and parent["turn_ids"][0] == first, strategy
        meta = json.loads(compaction["metadata"])
        assert meta["summary_turn_id"] not in compaction["turn_ids"] + parent["turn_ids"], strategy


TOOL_SEARCH_SCRIPT = [
    {"match": "hi-written", "text": "Done: out.txt is written."},
    {
        "match": "Create out.txt",
        "tool_call": {"name": "ToolSearch", "arguments": {"query": "select:NotebookEdit"}},
    },
    {"match": "", "shell": "echo hi > out.txt && echo hi-written"},
]


def test_a_deferred_tool_loaded_with_toolsearch_then_bash_exports_only_main_rows(
    tmp_path, qwen_tokenizer_dir
):
    """ToolSearch loads a deferred tool (NotebookEdit): Claude Code's `tools` grows, so turn 2's
    prompt does not extend turn 1's, but turn 2 carries ToolSearch's call and result; then Bash runs.
    Every row of both strategies is `main` (before, the rest was a subagent "spawned by ToolSearch")."""
    require_binary("claude")
    script = tmp_path / "script.json"
    script.write_text(json.dumps(TOOL_SEARCH_SCRIPT))
    backend = FakeBackend(qwen_tokenizer_dir, "--script", str(script))
    try:
        work, db = tmp_path / "work", tmp_path / "runs.sqlite"
        work.mkdir()
        r = polar_run(
            ["--backend", backend.url, "--tokenizer", str(qwen_tokenizer_dir), "--db", str(db)],
            ["claude", "-p", "Create out.txt containing hi", "--allowedTools", "Bash,ToolSearch"],
            cwd=work,
            env=harness_env(tmp_path / "home"),
        )
        assert r.returncode == 0, r.stderr
        assert (work / "out.txt").read_text() == "hi\n" and "Done" in r.stdout, r.stdout
        assert_turns_match_backend(backend, db)
    finally:
        backend.stop()
    turns = [t for t in read_turns(db, with_raw=True) if t.tag is None]
    tools = [[x["name"] for x in json.loads(t.request).get("tools", [])] for t in turns]
    calls = [[c["name"] for c in json.loads(t.response).get("tool_calls") or []] for t in turns]
    assert calls[:2] == [["ToolSearch"], ["Bash"]], calls
    assert "NotebookEdit" not in tools[0] and "NotebookEdit" in tools[1]  # the prompt really changed
    for strategy in ("prefix-merge", "per-request"):
        out = tmp_path / f"{strategy}.parquet"
        e = subprocess.run(
            [*POLAR, "export", "--db", str(db), "--strategy", strategy, "--out", str(out), "-q"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert e.returncode == 0, e.stderr
        rows = pq.read_table(out).to_pylist()
        assert rows and {row["role"] for row in rows} == {"main"}, (strategy, [row["role"] for row in rows])
