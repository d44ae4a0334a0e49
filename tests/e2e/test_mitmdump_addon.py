"""polar-mitm loaded into a user's own mitmdump (`mitmdump -s`), beside another addon of theirs,
runs the real Claude Code CLI: its turns are stored, spliced and token-exact."""

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from polar_mitm import recipes
from polar_mitm.harness.local import shell_exports
from polar_mitm.proxy.certs import ensure_ca
from tests.support.harness import Lines, assert_two_spliced_turns, claude_in_shell, free_port, require_binary

pytestmark = pytest.mark.e2e

USER_ADDON = """
from pathlib import Path
OUT = Path(__file__).with_suffix(".seen")
class Count:
    def client_connected(self, client):
        OUT.write_text(str(int(OUT.read_text() or 0) + 1) if OUT.exists() else "1")
addons = [Count()]
"""


def test_claude_code_through_mitmdump_with_the_polar_addon(tmp_path, backend, qwen_tokenizer_dir, certs_dir):
    require_binary("claude")
    entry = subprocess.run(
        [sys.executable, "-m", "polar_mitm.mitmdump"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert Path(entry).name == "mitmdump.py"
    user = tmp_path / "mine.py"
    user.write_text(USER_ADDON)
    port, db = free_port(), tmp_path / "runs.sqlite"
    mitmdump = Path(sys.executable).parent / "mitmdump"
    proc = subprocess.Popen(
        [
            str(mitmdump),
            "-s",
            entry,
            "-s",
            str(user),
            "--listen-host",
            "127.0.0.1",
            "--listen-port",
            str(port),
        ]
        + ["--set", f"confdir={certs_dir}", "--set", f"polar_backend={backend.url}"]
        + ["--set", f"polar_tokenizer={qwen_tokenizer_dir}", "--set", f"polar_db={db}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out = Lines(proc.stdout)
        while "polar-mitm: model calls go to" not in out.next(60):  # lines start with a time
            pass
        ca = ensure_ca(certs_dir)
        exports = shell_exports(recipes.get("claude-code"), f"http://cc-mitmdump:x@127.0.0.1:{port}", ca)
        claude_in_shell(exports, tmp_path)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(20)
    assert_two_spliced_turns(backend, db, "cc-mitmdump")
    assert int(user.with_suffix(".seen").read_text()) > 0  # the user's own addon ran beside ours
