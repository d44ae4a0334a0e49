"""The docker runtime's daemon client (`sandbox.docker.DaemonCalls`) against a stand-in daemon on a
Unix socket: the multiplexed output read back as written, the daemon's refusals named, and a
kept-alive connection the daemon closed tried once more (never the start, which runs the
command). The real daemon answers it in every Docker test (tests/processes, tests/e2e)."""

from __future__ import annotations

import json
import socketserver
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polar_mitm.sandbox.docker import DaemonCalls, DaemonRefused, exec_output


def frames(chunks: list[tuple[int, bytes]]) -> bytes:
    return b"".join(bytes([s, 0, 0, 0]) + len(c).to_bytes(4, "big") + c for s, c in chunks)


@given(st.lists(st.tuples(st.sampled_from([1, 2]), st.binary(max_size=300)), max_size=20))
def test_the_output_is_every_frames_payload_in_order(chunks):
    assert exec_output(frames(chunks)) == b"".join(c for _, c in chunks)


@given(
    st.lists(st.tuples(st.sampled_from([1, 2]), st.binary(min_size=1, max_size=300)), min_size=1, max_size=8),
    st.data(),
)
def test_a_stream_cut_short_keeps_what_came(chunks, data):
    whole = frames(chunks)
    cut = data.draw(st.integers(0, len(whole)))
    out = exec_output(whole[:cut])
    assert b"".join(c for _, c in chunks).startswith(out)


class Daemon(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str, *, close_after_create: bool = False, refuse: int = 0):
        self.calls: list[str] = []
        self.close_after_create = close_after_create
        self.refuse = refuse
        super().__init__(path, Handler)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Daemon

    def log_message(self, *args) -> None:
        pass

    def address_string(self) -> str:
        return "unix"

    def _reply(self, status: int, body: bytes, close: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        if close:
            self.close_connection = True

    def do_POST(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(n) or b"{}")
        self.server.calls.append(f"POST {self.path}")
        if self.path.endswith("/exec") and self.server.refuse:
            self._reply(self.server.refuse, json.dumps({"message": "container c is not running"}).encode())
        elif self.path.endswith("/exec"):
            assert body["Cmd"] == ["echo", "hi"] and body["Env"] == ["A=1"] and body["User"] == "u"
            # The daemon drops the kept-alive connection after answering: the next call must open another.
            self._reply(201, b'{"Id": "e1"}', close=self.server.close_after_create)
        else:  # start: the daemon takes the connection over and closes it at the end
            self.send_response(200)
            self.send_header("Content-Type", "application/vnd.docker.raw-stream")
            self.end_headers()
            self.wfile.write(frames([(1, b"out\n"), (2, b"err\n")]))
            self.close_connection = True

    def do_GET(self) -> None:
        self.server.calls.append(f"GET {self.path}")
        self._reply(200, b'{"ExitCode": 3, "Running": false}')


@pytest.fixture
def daemon_at(tmp_path):
    servers: list[Daemon] = []

    def start(**kw) -> tuple[Daemon, DaemonCalls]:
        path = str(tmp_path / f"d{len(servers)}.sock")
        d = Daemon(path, **kw)
        servers.append(d)
        threading.Thread(target=d.serve_forever, daemon=True).start()
        return d, DaemonCalls(path, "1.41", timeout=5)

    yield start
    for d in servers:
        d.shutdown()
        d.server_close()


def test_an_exec_is_three_calls_and_its_output_as_written(daemon_at):
    d, calls = daemon_at()
    assert calls.run("c", ["echo", "hi"], {"A": "1"}, "/app", "u") == (3, b"out\nerr\n")
    assert d.calls == [
        "POST /v1.41/containers/c/exec",
        "POST /v1.41/exec/e1/start",
        "GET /v1.41/exec/e1/json",
    ]
    # Again: the kept-alive connection serves the next exec.
    assert calls.run("c", ["echo", "hi"], {"A": "1"}, "/app", "u") == (3, b"out\nerr\n")


def test_a_connection_the_daemon_closed_is_opened_again(daemon_at):
    d, calls = daemon_at(close_after_create=True)
    for _ in range(3):  # the connection kept from each inspect is closed by the next create's reply
        assert calls.run("c", ["echo", "hi"], {"A": "1"}, "/", "u") == (3, b"out\nerr\n")
    assert d.calls.count("POST /v1.41/exec/e1/start") == 3  # each command ran once


def test_a_refusal_is_named_with_the_daemons_message(daemon_at):
    _, calls = daemon_at(refuse=409)
    with pytest.raises(DaemonRefused, match="409: container c is not running"):
        calls.run("c", ["echo", "hi"], {"A": "1"}, "/", "u")


def test_no_daemon_is_an_error_not_a_hang(tmp_path):
    calls = DaemonCalls(str(Path(tmp_path) / "none.sock"), "1.41", timeout=5)
    with pytest.raises(FileNotFoundError):
        calls.run("c", ["true"], {}, "/")
