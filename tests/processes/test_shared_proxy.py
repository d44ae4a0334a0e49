"""`polar-mitm proxy` as its own process: sessions by proxy credentials, and a killed proxy."""

import json
import signal
import sqlite3
import subprocess
import sys

import httpx
import pytest

from polar_mitm.store.reader import read_turns
from tests.support.harness import FakeBackend, port_of, printed_url
from tests.support.helpers import MESSAGES_URL, stored_bytes

URL = MESSAGES_URL


@pytest.fixture
def shared_proxy(request, tmp_path, certs_dir, qwen_tokenizer_dir):
    extra = getattr(request, "param", [])
    backend = FakeBackend(qwen_tokenizer_dir, "--token-delay", "0.02")
    db = tmp_path / "shared.sqlite"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "polar_mitm",
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--backend",
            backend.url,
            "--tokenizer",
            str(qwen_tokenizer_dir),
            "--db",
            str(db),
            "--certs",
            str(certs_dir),
            *extra,
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stderr.readline()
    assert "polar-mitm proxy on" in line, line
    port = port_of(printed_url(line))
    yield port, db, proc, certs_dir
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        proc.wait(20)
    backend.stop()


def client(port, certs_dir, session):
    return httpx.Client(
        proxy=f"http://{session}:secret-token@127.0.0.1:{port}",
        verify=str(certs_dir / "mitmproxy-ca-cert.pem"),
        timeout=60,
    )


def body(text, stream=False):
    return {
        "model": "m",
        "max_tokens": 200,
        "stream": stream,
        "messages": [{"role": "user", "content": text}],
    }


@pytest.mark.slow
def test_shared_proxy_keeps_sessions_apart(shared_proxy):
    port, db, _, certs = shared_proxy
    for session in ("worker-1", "worker-2", "worker-1"):
        with client(port, certs, session) as c:
            assert c.post(URL, json=body("hi")).status_code == 200
    sessions = [t.session_id for t in read_turns(db)]
    assert sessions == ["worker-1", "worker-2", "worker-1"]
    assert b"secret-token" not in stored_bytes(db)


# Streamed from the backend, so the proxy dies while the reply is still being sampled.
@pytest.mark.slow
@pytest.mark.parametrize("shared_proxy", [["--backend-stream", "stream"]], indirect=True)
def test_a_killed_proxy_leaves_the_database_consistent_with_what_the_harness_saw(shared_proxy):
    port, db, proc, certs = shared_proxy
    with client(port, certs, "s") as c:
        done = c.post(URL, json=body("hi")).json()  # one complete turn first
        assert done["stop_reason"] == "end_turn"
        seen = []
        with pytest.raises(httpx.HTTPError):
            with c.stream("POST", URL, json=body("hello there, please talk a while", stream=True)) as r:
                for line in r.iter_lines():
                    seen.append(line)
                    if line.startswith("event: content_block_delta"):
                        proc.send_signal(signal.SIGKILL)  # the proxy dies mid-reply
    assert not any("message_stop" in s for s in seen)
    proc.wait(20)  # the killed proxy is gone before the database is read
    con = sqlite3.connect(db)
    assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    rows = con.execute("SELECT status, response FROM turns").fetchall()
    # The finished turn survived; the interrupted one was never committed, as the harness saw no end.
    assert len(rows) == 1 and rows[0][0] == "ok"
    assert json.loads(rows[0][1])["text"] == done["content"][0]["text"]


@pytest.mark.slow
@pytest.mark.parametrize("shared_proxy", [["--token", "secret-token"]], indirect=True)
def test_a_proxy_with_a_token_refuses_clients_without_it(shared_proxy):
    port, db, _, certs = shared_proxy
    with httpx.Client(
        proxy=f"http://intruder:wrong@127.0.0.1:{port}",
        verify=str(certs / "mitmproxy-ca-cert.pem"),
        timeout=30,
    ) as c:
        with pytest.raises(httpx.ProxyError, match="407"):
            c.post(URL, json=body("hi"))
    with client(port, certs, "worker-1") as c:  # the right token, any session name
        assert c.post(URL, json=body("hi")).status_code == 200
    assert [t.session_id for t in read_turns(db)] == ["worker-1"]
