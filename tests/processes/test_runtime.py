"""Launching harnesses: CA files, child environment, recipes, exit codes and signals."""

import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from polar_mitm import recipes
from polar_mitm.harness.local import child_env
from polar_mitm.proxy.certs import ensure_ca
from tests.support.helpers import process_gone, wait_until


def test_ca_is_created_once_with_a_private_key_only_its_owner_reads(tmp_path):
    ca = ensure_ca(tmp_path)
    assert stat.S_IMODE(os.stat(ca.key_and_cert).st_mode) == 0o600
    first = ca.cert.read_bytes()
    again = ensure_ca(tmp_path)
    assert again.cert.read_bytes() == first  # reused, not regenerated
    bundle = ca.bundle.read_bytes()
    assert bundle.endswith(first) and bundle.count(b"BEGIN CERTIFICATE") > 10  # system roots + ours


def test_child_env_for_claude_code(tmp_path):
    ca = ensure_ca(tmp_path)
    rec = recipes.for_command(["claude", "-p", "hi"])
    env = child_env({"PATH": "/bin", "NO_PROXY": "corp.internal"}, rec, "http://127.0.0.1:1234", ca, "s1")
    for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        assert env[k] == "http://127.0.0.1:1234"
    assert env["NO_PROXY"].split(",")[:2] == ["corp.internal", "127.0.0.1"] and "localhost" in env["no_proxy"]
    assert env["NODE_EXTRA_CA_CERTS"] == str(ca.cert)
    assert env["SSL_CERT_FILE"] == env["REQUESTS_CA_BUNDLE"] == str(ca.bundle)
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    assert env["ANTHROPIC_AUTH_TOKEN"] and "ANTHROPIC_API_KEY" not in env  # a dummy credential …
    kept = child_env({"ANTHROPIC_API_KEY": "mine"}, rec, "http://x", ca, "s1")
    assert kept["ANTHROPIC_API_KEY"] == "mine" and "ANTHROPIC_AUTH_TOKEN" not in kept  # … or the user's own


def test_recipe_is_chosen_by_binary_looking_past_wrappers():
    assert recipes.for_command(["/usr/bin/claude", "-p", "x"]).name == "claude-code"
    assert recipes.for_command(["env", "-u", "X", "claude"]).name == "claude-code"
    assert recipes.for_command(["python", "script.py"]).name == "generic"
    with pytest.raises(KeyError, match="unknown recipe"):
        recipes.get("nope")


def polar(args, **kw):
    return subprocess.Popen(
        [sys.executable, "-m", "polar_mitm", *args], stderr=subprocess.PIPE, text=True, **kw
    )


def test_run_exits_with_the_harness_exit_code(tmp_path, certs_dir, backend_process):
    p = polar(
        [
            "run",
            "--backend",
            backend_process.url,
            "--certs",
            str(certs_dir),
            "--db",
            str(tmp_path / "r.sqlite"),
            "--",
            sys.executable,
            "-c",
            "import sys; sys.exit(7)",
        ]
    )
    _, err = p.communicate(timeout=60)
    assert p.returncode == 7
    assert "0 turns" in err and "exit 7" in err


def test_run_forwards_signals_to_the_harness(tmp_path, certs_dir, backend_process):
    marker = tmp_path / "got-term"
    child = (
        "import signal, sys, time, pathlib\n"
        f"signal.signal(signal.SIGTERM, lambda *a: (pathlib.Path({str(marker)!r}).write_text('yes'), sys.exit(3)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    p = polar(
        [
            "run",
            "--backend",
            backend_process.url,
            "--certs",
            str(certs_dir),
            "--db",
            str(tmp_path / "r.sqlite"),
            "--",
            sys.executable,
            "-c",
            child,
        ],
        stdout=subprocess.PIPE,
    )
    assert p.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=30)
    assert marker.read_text() == "yes"  # the harness got the signal …
    assert p.returncode == 3  # … and its exit code came back


def test_missing_command_is_a_clear_error(tmp_path, certs_dir, backend_process):
    p = polar(
        [
            "run",
            "--backend",
            backend_process.url,
            "--certs",
            str(certs_dir),
            "--db",
            str(tmp_path / "r.sqlite"),
            "--",
            "no-such-harness-xyz",
        ]
    )
    _, err = p.communicate(timeout=60)
    assert p.returncode == 127 and "command not found: no-such-harness-xyz" in err


def test_helpers_the_harness_spawned_do_not_outlive_the_run(tmp_path, certs_dir, backend_process):
    pidfile = tmp_path / "grandchild.pid"
    # The grandchild ignores SIGTERM, as Qwen Code's re-launched child does; the harness itself exits.
    script = f"(trap '' TERM; exec sleep 300) & echo $! > {pidfile}; echo ready; wait"
    p = polar(
        [
            "run",
            "--backend",
            backend_process.url,
            "--certs",
            str(certs_dir),
            "--db",
            str(tmp_path / "r.sqlite"),
            "--",
            "sh",
            "-c",
            script,
        ],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    assert p.stdout.readline().strip() == "ready"
    grandchild = int(pidfile.read_text())
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=30)
    # Gone, or a zombie waiting for init to reap it: either way no longer running.
    wait_until(lambda: process_gone(grandchild), timeout=1, message="the grandchild to end")
    assert process_gone(grandchild)


def test_generic_harnesses_get_every_ca_variable_both_proxy_cases_and_a_dummy_key_per_provider(tmp_path):
    from polar_mitm.harness.local import child_env
    from polar_mitm.proxy.certs import CA

    ca = CA(
        dir=tmp_path, key_and_cert=tmp_path / "k", cert=tmp_path / "ca.pem", bundle=tmp_path / "bundle.pem"
    )
    env = child_env({"OPENAI_API_KEY": "mine"}, recipes.get("generic"), "http://s:t@127.0.0.1:1", ca, "s")
    for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        assert env[k] == "http://s:t@127.0.0.1:1"
    assert env["NODE_EXTRA_CA_CERTS"] == str(ca.cert)
    for k in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO", "AWS_CA_BUNDLE"):
        assert env[k] == str(ca.bundle)
    assert env["OPENAI_API_KEY"] == "mine"  # the user's own key wins
    for k in ("ANTHROPIC_API_KEY", "GEMINI_API_KEY", "XAI_API_KEY", "MOONSHOT_API_KEY", "DASHSCOPE_API_KEY"):
        assert env[k] == "polar-mitm-dummy"
    harvest = child_env({}, recipes.get("generic"), "http://p", ca, "s", harvest=True)
    assert "ANTHROPIC_API_KEY" not in harvest  # harvest mode: the harness's own credentials only
