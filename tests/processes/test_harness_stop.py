"""`run` stops a harness that refuses our CA: SIGTERM, a grace of 5 s, then SIGKILL (procs.stop_async),
and exits 69, even when the harness ignores SIGTERM. The harness is a real process that keeps
opening TLS through the proxy with a trust store that lacks our CA (nothing leaves loopback: the
proxy connects upstream only for a request, and no request gets through a failed handshake)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

HARNESS = """
import os, signal, socket, ssl, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a harness that will not stop when asked
host, port = os.environ["HTTPS_PROXY"].rsplit("@", 1)[-1].removeprefix("http://").rstrip("/").rsplit(":", 1)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
ctx.load_default_certs()  # the system's roots: not our CA
while True:
    try:
        s = socket.create_connection((host, int(port)), timeout=5)
        s.sendall(b"CONNECT api.anthropic.com:443 HTTP/1.1\\r\\nHost: api.anthropic.com:443\\r\\n\\r\\n")
        s.recv(4096)
        ctx.wrap_socket(s, server_hostname="api.anthropic.com").close()
    except (OSError, ssl.SSLError):
        pass
    time.sleep(0.2)
"""


def test_a_harness_that_refuses_our_ca_and_ignores_sigterm_is_killed(tmp_path, certs_dir, backend_process):
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "polar_mitm", "run", "--backend", backend_process.url, "--certs", str(certs_dir),
         "--db", str(tmp_path / "r.sqlite"), "--recipe", "claude-code", "--untrusted-timeout", "1",
         "--", sys.executable, "-c", HARNESS],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    took = time.monotonic() - t0
    assert r.returncode == 69, r.stderr
    assert "refused our CA for api.anthropic.com" in r.stderr
    assert took >= 5, "the harness was not given its grace"


# A harness that gives up by itself after three refused handshakes, as Claude Code 2.1.33x does.
GIVES_UP = (
    HARNESS.replace("signal.signal(signal.SIGTERM, signal.SIG_IGN)", "import sys").replace(
        "while True:", "for _ in range(3):"
    )
    + "\nsys.exit(1)\n"
)


def test_a_harness_that_refuses_our_ca_and_exits_before_the_timeout_is_said_to(
    tmp_path, certs_dir, backend_process
):
    r = subprocess.run(
        [sys.executable, "-m", "polar_mitm", "run", "--backend", backend_process.url, "--certs", str(certs_dir),
         "--db", str(tmp_path / "r.sqlite"), "--recipe", "claude-code", "--untrusted-timeout", "60",
         "--", sys.executable, "-c", GIVES_UP],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert r.returncode == 69, r.stderr
    assert "refused our CA for api.anthropic.com" in r.stderr and "before the harness exited" in r.stderr
