"""Mistakes a new user makes, each answered fast with one line that says what is wrong and what
to do: a missing tokenizer, a backend that is not there, a misspelt option, a busy port, a
session that does not exist, a pipe closed early."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from polar_mitm.cli import main
from tests.support.harness import Lines, free_port, port_of, printed_url

POLAR = [sys.executable, "-m", "polar_mitm"]


def polar(args: list[str], *, timeout: float = 60, **kw) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    r = subprocess.run([*POLAR, *args], capture_output=True, text=True, timeout=timeout, **kw)
    return r, time.monotonic() - started


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# --- run: the backend and the tokenizer are checked before the harness starts ----------------------


def run_until_checked(tmp_path: Path, *policy: str) -> tuple[subprocess.CompletedProcess, float]:
    """`run POLICY… -- sh -c 'touch started'`: the harness leaves a mark if it ever starts."""
    r, took = polar(
        ["run", *policy, "--db", str(tmp_path / "r.sqlite"), "--", "sh", "-c", "touch started"],
        cwd=tmp_path,
    )
    assert not (tmp_path / "started").exists(), "the harness started although the check failed"
    assert not (tmp_path / "r.sqlite").exists(), "a session was recorded although nothing ran"
    assert r.returncode == 78 and "Traceback" not in r.stderr
    assert len(lines(r.stderr)) == 1, r.stderr
    return r, took


def test_run_without_the_tokenizer_directory_says_how_to_build_one(tmp_path, backend_process):
    r, took = run_until_checked(tmp_path, "--backend", backend_process.url, "--tokenizer", "./qwen3-tok")
    assert took < 15
    assert r.stderr.startswith("polar-mitm: no tokenizer directory ./qwen3-tok")
    assert "polar-mitm tokenizer build --kind qwen --out ./qwen3-tok" in r.stderr


@pytest.mark.slow
def test_run_with_nothing_at_the_backend_url_says_connection_refused(tmp_path, tiny_tokenizer_dir):
    url = f"http://127.0.0.1:{free_port()}"
    r, took = run_until_checked(tmp_path, "--backend", url, "--tokenizer", str(tiny_tokenizer_dir))
    assert took < 15
    assert f"cannot reach the policy backend at {url}: connection refused" in r.stderr


@pytest.mark.slow
def test_run_with_a_backend_url_without_scheme_says_so(tmp_path):
    r, _ = run_until_checked(tmp_path, "--backend", "127.0.0.1:30000")
    assert "--backend '127.0.0.1:30000' has no scheme: pass http://127.0.0.1:30000" in r.stderr


def test_run_with_v1_on_the_backend_url_suggests_dropping_it(tmp_path, backend_process):
    r, _ = run_until_checked(tmp_path, "--backend", backend_process.url + "/v1")
    assert "answered 404 for /health" in r.stderr
    assert f"without /v1 (--backend {backend_process.url})" in r.stderr


def test_run_with_a_tokenizer_directory_lacking_tokenizer_json_says_so(tmp_path, backend_process):
    (tmp_path / "empty").mkdir()
    r, _ = run_until_checked(tmp_path, "--backend", backend_process.url, "--tokenizer", "empty")
    assert "--tokenizer empty has no tokenizer.json" in r.stderr


async def test_check_policy_refuses_a_backend_tokenizer_path_that_is_not_here(tiny_tokenizer_dir):
    import pytest

    from polar_mitm.fake import STATE, FakeBackendConfig, start_fake_backend
    from polar_mitm.harness.preflight import PreflightError, check_policy
    from polar_mitm.policy import PolicyConfig

    runner, url = await start_fake_backend(FakeBackendConfig(tokenizer_path=str(tiny_tokenizer_dir)))
    try:
        info = await check_policy(PolicyConfig(backend_url=url))  # the backend's own path: loads
        assert info.tokenizer_path == str(tiny_tokenizer_dir)
        runner.app[STATE].config.tokenizer_path = "Qwen/Qwen3-8B"  # a hub name, not a directory
        with pytest.raises(PreflightError, match="tokenizer_path='Qwen/Qwen3-8B', which is not a directory"):
            await check_policy(PolicyConfig(backend_url=url))
    finally:
        await runner.cleanup()


# --- run: options end where the command begins ---------------------------------------------------


def test_an_unknown_option_before_the_command_is_a_usage_error(tmp_path):
    with CliRunner().isolated_filesystem(temp_dir=tmp_path):
        r = CliRunner().invoke(main, ["run", "--tokeniser", "foo", "--db", "m.sqlite", "--", "claude"])
        assert r.exit_code == 2
        assert "No such option '--tokeniser'" in r.output and "--tokenizer" in r.output
        assert not Path("m.sqlite").exists() and not Path("polar-mitm.sqlite").exists()


def test_the_harness_flags_pass_through_with_or_without_double_dash(tmp_path, backend_process):
    show_argv = ["python3", "-c", "import sys; print(sys.argv[1:])"]
    common = ["--backend", backend_process.url, "--db", str(tmp_path / "r.sqlite")]
    with_dashes, _ = polar(["run", *common, "--", *show_argv, "-p", "x", "--allowedTools", "Bash"])
    without, _ = polar(["run", *common, *show_argv, "-p", "x", "--db", "theirs"])
    assert with_dashes.returncode == 0 and without.returncode == 0, with_dashes.stderr + without.stderr
    assert with_dashes.stdout.strip() == "['-p', 'x', '--allowedTools', 'Bash']"
    assert without.stdout.strip() == "['-p', 'x', '--db', 'theirs']"  # the harness's --db, not ours


# --- proxy: the lines to paste, and a busy port -----------------------------------------------------


def test_proxy_prints_the_lines_each_harness_needs_and_they_work(tmp_path, backend_process, certs_dir):
    from polar_mitm.harness import node_proxy

    db = tmp_path / "shared.sqlite"
    args = ["proxy", "--listen", "127.0.0.1:0", "--backend", backend_process.url, "--db", str(db)]
    proc = subprocess.Popen(
        [*POLAR, *args, "--certs", str(certs_dir), "--token", "tok"], stderr=subprocess.PIPE, text=True
    )
    try:
        printed = Lines(proc.stderr)
        port = port_of(printed_url(printed.until("polar-mitm proxy on")))
        printed.until("# claude-code: ")
        claude = printed.next()
        printed.until("# generic: ")  # the other recipes, generic last
        printed.next()
        proxy_url = f"http://SESSION:tok@127.0.0.1:{port}"
        assert claude.split() == [
            "export",
            f"HTTPS_PROXY={proxy_url}",
            "NODE_USE_ENV_PROXY=1",
            # Node 18-22's fetch through the proxy too (harness/node_proxy.cjs), where undici is installed.
            *(f"{k}={v}" for k, v in node_proxy.env({}).items()),
            f"NODE_EXTRA_CA_CERTS={certs_dir / 'mitmproxy-ca-cert.pem'}",
            f"SSL_CERT_FILE={certs_dir / 'polar-mitm-bundle.pem'}",
            f"REQUESTS_CA_BUNDLE={certs_dir / 'polar-mitm-bundle.pem'}",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1",
            "DISABLE_AUTOUPDATER=1",
            "ANTHROPIC_AUTH_TOKEN=polar-mitm-dummy",  # without one Claude Code says "Not logged in"
        ]
        everything = "\n".join(printed.seen)
        assert "# gemini-cli: gemini -p" in everything and "GEMINI_API_KEY=" in everything
        assert printed.seen[-2].startswith("# generic: ")
        # Pasted into a shell, the line is all a client needs: proxy, credentials and CA.
        client = (
            "import json, urllib.request; r = urllib.request.urlopen(urllib.request.Request("
            "'https://api.anthropic.com/v1/messages', data=json.dumps({'model': 'm', 'max_tokens': 20, "
            "'messages': [{'role': 'user', 'content': 'hi'}]}).encode(), "
            "headers={'content-type': 'application/json'}), timeout=60); print(json.load(r)['type'])"
        )
        shell = subprocess.run(
            ["bash", "-c", f'{claude.replace("SESSION", "pasted")}; {sys.executable} -c "{client}"'],
            capture_output=True,
            text=True,
            timeout=60,
            env={"PATH": "/usr/bin:/bin"},
        )
        assert shell.stdout.strip() == "message", shell.stderr
    finally:
        proc.terminate()
        proc.wait(20)
    sessions = [r[0] for r in sqlite3.connect(db).execute("SELECT session_id FROM turns")]
    assert sessions == ["pasted"]


def busy_port() -> tuple[object, int]:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


def test_proxy_on_a_busy_port_says_so_in_one_line_and_exits(tmp_path, backend_process, certs_dir):
    sock, port = busy_port()
    with sock:
        r, took = polar(
            ["proxy", "--listen", f"127.0.0.1:{port}", "--backend", backend_process.url]
            + ["--db", str(tmp_path / "p.sqlite"), "--certs", str(certs_dir)],
            timeout=30,
        )
    assert r.returncode == 1 and took < 10
    assert lines(r.stderr) == [
        f"polar-mitm: cannot listen on 127.0.0.1:{port}: address already in use (pass another --listen HOST:PORT)"
    ]


@pytest.mark.slow
def test_fake_backend_on_a_busy_port_says_so_in_one_line_and_exits(tiny_tokenizer_dir):
    sock, port = busy_port()
    with sock:
        r, took = polar(
            ["fake-backend", "--port", str(port), "--tokenizer", str(tiny_tokenizer_dir)], timeout=30
        )
    assert r.returncode == 1 and took < 10
    assert lines(r.stderr) == [
        f"polar-mitm fake-backend: cannot listen on 127.0.0.1:{port}: address already in use"
    ]


# --- after a run: failed runs leave nothing, offline commands find the store and name sessions -------


def test_a_command_that_is_not_there_leaves_no_session(tmp_path, backend_process):
    db = tmp_path / "r.sqlite"
    r, took = polar(["run", "--backend", backend_process.url, "--db", str(db), "--", "no-such-harness-xyz"])
    assert r.returncode == 127 and took < 15
    assert lines(r.stderr) == ["polar-mitm: command not found: no-such-harness-xyz"]
    assert not db.exists() or sqlite3.connect(db).execute("SELECT COUNT(*) FROM sessions").fetchone() == (0,)


async def fill_store(path: Path, sessions: dict[str, int], prompt_len: int = 8) -> None:
    """Sessions (oldest first) with that many one-turn-each generations of `prompt_len` tokens."""
    from polar_mitm.store.turn import Turn
    from polar_mitm.store.writer import Store

    store = await Store.open(path)
    try:
        for n, (session, turns) in enumerate(sessions.items()):
            await store.ensure_session(session)
            for i in range(turns):
                await store.insert_turn(
                    Turn(
                        id=f"{session}-{i}",
                        session_id=session,
                        created_at=1000.0 * (n + 1) + i,
                        style="anthropic",
                        prompt_ids=list(range(i, i + prompt_len)),
                        output_ids=[7, 8],
                        output_logprobs=[-0.5, -0.25],
                        finish_reason="stop",
                    )
                )
    finally:
        await store.close()


async def test_stats_and_export_name_a_session_that_is_not_there(tmp_path):
    db = tmp_path / "runs.sqlite"
    await fill_store(db, {"first": 1, "second": 1})
    for args in (["stats"], ["export", "--out", str(tmp_path / "t.jsonl")]):
        r = CliRunner().invoke(main, [*args, "--db", str(db), "--session", "nope"])
        assert r.exit_code == 1, r.output
        assert r.output.strip() == f"Error: no session 'nope' in {db} (most recent: second, first)"
    assert not (tmp_path / "t.jsonl").exists()
    r = CliRunner().invoke(main, ["reward", "--db", str(db), "--session", "nope", "--value", "1"])
    assert r.exit_code == 1 and "no session 'nope'" in r.output  # as it always said


@pytest.mark.slow
async def test_export_into_a_pipe_closed_early_ends_quietly(tmp_path):
    db = tmp_path / "runs.sqlite"
    await fill_store(db, {"big": 400}, prompt_len=400)  # far more than a pipe holds
    r = subprocess.run(
        [
            "bash",
            "-c",
            f"{sys.executable} -m polar_mitm export --db {db} --strategy per-request --out - | head -1"
            "; exit ${PIPESTATUS[0]}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.stdout.startswith('{"trajectory_id":"big-0"') and r.stdout.count("\n") == 1
    assert r.stderr == "" and r.returncode == 141  # as `cat big | head -1` ends


async def test_the_offline_commands_use_the_store_run_writes_by_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("POLAR_MITM_DB", raising=False)
    await fill_store(tmp_path / "polar-mitm.sqlite", {"s1": 2})
    r = CliRunner().invoke(main, ["stats", "--json"])
    assert r.exit_code == 0, r.output
    assert '"turns": 2' in r.output
    r = CliRunner().invoke(main, ["export", "--out", "t.jsonl", "--strategy", "per-request", "-q"])
    assert r.exit_code == 0 and len(Path("t.jsonl").read_text().splitlines()) == 2
    for command in ("export", "stats", "show", "reward"):
        help_text = "".join(CliRunner().invoke(main, [command, "--help"]).output.split())  # unwrapped
        assert "[envvar:POLAR_MITM_DB;default:polar-mitm.sqlite]" in help_text, command


def test_a_rollout_where_no_sample_can_be_used_exits_non_zero_and_says_why(
    tmp_path, backend_process, tiny_tokenizer_dir
):
    """Every sandbox's setup fails: each sample ends `failed`, and `rollout` says so in one line
    and exits 3, instead of 0 with nothing to train on."""
    task = tmp_path / "t.toml"
    task.write_text('id = "t"\ninstruction = "x"\nsetup = ["exit 7"]\n')
    db = tmp_path / "ro.sqlite"
    r, _ = polar(
        [
            "rollout", str(task), "--harness", "claude-code", "--harness-cmd", "echo {instruction}",
            "--runtime", "local", "--samples", "2", "--retries", "0",
            "--backend", backend_process.url, "--tokenizer", str(tiny_tokenizer_dir), "--db", str(db),
        ]
    )  # fmt: skip
    assert r.returncode == 3, r.stderr
    last = lines(r.stderr)[-1]
    assert "none of the 2 samples can be trained on; 2 ended failed" in last and "setup step 1" in last
    statuses = sqlite3.connect(db).execute("SELECT status FROM samples").fetchall()
    assert statuses == [("failed",), ("failed",)]
