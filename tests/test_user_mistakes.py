"""Mistakes a new user makes, each answered fast with one line that says what is wrong and what
to do: a missing tokenizer, a backend that is not there, a misspelt option, a busy port, a
session that does not exist, a pipe closed early."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner

from polar_mitm.cli import main
from tests.e2e.harness import free_port

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


def test_run_with_nothing_at_the_backend_url_says_connection_refused(tmp_path, tiny_tokenizer_dir):
    url = f"http://127.0.0.1:{free_port()}"
    r, took = run_until_checked(tmp_path, "--backend", url, "--tokenizer", str(tiny_tokenizer_dir))
    assert took < 15
    assert f"cannot reach the policy backend at {url}: connection refused" in r.stderr


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

    from polar_mitm.backends.fake import STATE, FakeBackendConfig, start_fake_backend
    from polar_mitm.backends.policy import PolicyConfig
    from polar_mitm.runtime.preflight import PreflightError, check_policy

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
