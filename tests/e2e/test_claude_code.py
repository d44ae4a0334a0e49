"""The real Claude Code binary (npm @anthropic-ai/claude-code), unmodified, through `polar-mitm run`."""

import sqlite3

import pytest

from tests.support.harness import (
    assert_turns_match_backend,
    harness_env,
    main_turns,
    polar_run,
    require_binary,
)

pytestmark = pytest.mark.e2e


def test_tool_call_is_executed_and_every_turn_is_captured_token_exact(tmp_path, backend, qwen_tokenizer_dir):
    require_binary("claude")
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
            "cc-e2e",
        ],
        ["claude", "-p", "Create out.txt containing hi", "--allowedTools", "Bash"],
        cwd=work,
        env=harness_env(tmp_path / "home"),
    )
    assert r.returncode == 0, r.stderr
    assert (work / "out.txt").read_text() == "hi\n"  # the harness ran the Bash tool call
    assert "Done. The command finished." in r.stdout  # ...and printed the final answer
    assert "session cc-e2e" in r.stderr and "2 turns" in r.stderr  # the one-line summary

    t1, t2 = main_turns(db)
    assert t1.finish_reason == "tool_calls" and t2.finish_reason == "stop"
    # Turn 2's prompt begins with turn 1's prompt + sampled ids, token for token.
    assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.output_ids)] == t1.prompt_ids + t1.output_ids
    assert_turns_match_backend(backend, db)
    con = sqlite3.connect(db)
    assert con.execute("SELECT harness, exit_code FROM sessions WHERE id='cc-e2e'").fetchone() == (
        "claude-code",
        0,
    )


def test_untrusted_ca_is_reported_instead_of_hanging(tmp_path, backend, qwen_tokenizer_dir):
    require_binary("claude")
    env = harness_env(tmp_path / "home")
    r = polar_run(
        [
            "--backend",
            backend.url,
            "--tokenizer",
            str(qwen_tokenizer_dir),
            "--db",
            str(tmp_path / "x.sqlite"),
            "--recipe",
            "claude-code",
            "--untrusted-timeout",
            "3",
        ],
        # Strip every CA variable the recipe sets: the harness now distrusts our certificates.
        [
            "env",
            "-u",
            "NODE_EXTRA_CA_CERTS",
            "-u",
            "SSL_CERT_FILE",
            "-u",
            "REQUESTS_CA_BUNDLE",
            "claude",
            "-p",
            "hi",
        ],
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert r.returncode == 69, r.stderr
    assert "refused our CA" in r.stderr and "api.anthropic.com" in r.stderr
    assert "0 turns" in r.stderr


def test_a_longer_session_is_one_spliced_chain_and_one_trajectory(tmp_path, qwen_tokenizer_dir):
    import json
    import subprocess

    import pyarrow.parquet as pq

    from tests.support.harness import POLAR, FakeBackend

    require_binary("claude")
    script = tmp_path / "script.json"
    script.write_text(
        json.dumps(
            [
                {"match": "step2-done", "text": "Finished after two commands."},
                {"match": "step1-done", "shell": "echo step2-done"},
                {"match": "[Bb]egin", "shell": "echo step1-done"},
            ]
        )
    )
    backend = FakeBackend(qwen_tokenizer_dir, "--script", str(script))
    try:
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
                "--task",
                "t-42",
            ],
            ["claude", "-p", "Begin the two-step check", "--allowedTools", "Bash"],
            cwd=work,
            env=harness_env(tmp_path / "home"),
        )
        assert r.returncode == 0, r.stderr
        assert "Finished after two commands." in r.stdout
        t1, t2, t3 = main_turns(db)
        for a, b in ((t1, t2), (t2, t3)):
            assert b.prompt_ref == a.id
            assert b.prompt_ids[: len(a.prompt_ids) + len(a.output_ids)] == a.prompt_ids + a.output_ids
        assert_turns_match_backend(backend, db)
    finally:
        backend.stop()

    out = tmp_path / "traj.parquet"
    e = subprocess.run(
        [*POLAR, "export", "--db", str(db), "--strategy", "prefix-merge", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert e.returncode == 0, e.stderr
    [row] = pq.read_table(out).to_pylist()
    assert row["num_turns"] == 3 and row["task_id"] == "t-42"
    assert row["turn_ids"] == [t1.id, t2.id, t3.id]
    # prompt + response is exactly the last prompt + its sampled ids; mask 1 exactly where sampled.
    assert row["prompt_ids"] + row["response_ids"] == t3.prompt_ids + t3.output_ids
    sampled = [i for i, m in enumerate(row["loss_mask"]) if m == 1]
    assert len(sampled) == len(t1.output_ids) + len(t2.output_ids) + len(t3.output_ids)
    import numpy as np

    want = np.array(t1.output_logprobs + t2.output_logprobs + t3.output_logprobs, dtype=np.float32)
    got = np.array([row["response_logprobs"][i] for i in sampled], dtype=np.float32)
    assert got.tobytes() == want.tobytes()  # bit for bit


@pytest.mark.parametrize("workers", ["1", "2"])
def test_the_lines_a_shared_proxy_prints_run_claude_code(
    tmp_path, backend, qwen_tokenizer_dir, certs_dir, workers
):
    """README's `proxy` example: paste the printed claude-code line into a shell, run claude there;
    with `--workers 2`, through the front that hands each connection to its session's worker."""
    from tests.support.harness import assert_two_spliced_turns, claude_in_shell, shared_proxy

    require_binary("claude")
    db = tmp_path / "shared.sqlite"
    with shared_proxy(backend, qwen_tokenizer_dir, db, certs_dir, "--workers", workers) as printed:
        printed.until("# claude-code: ")
        claude_in_shell(printed.next().replace("SESSION", "from-readme"), tmp_path)
    assert_two_spliced_turns(backend, db, "from-readme")
