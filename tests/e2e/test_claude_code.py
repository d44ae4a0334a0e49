"""The real Claude Code binary (npm @anthropic-ai/claude-code), unmodified, through `polar-mitm run`."""

import sqlite3

import pytest

from tests.e2e.harness import (
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
