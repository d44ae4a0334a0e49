"""The docker runtime's daemon client (`sandbox.docker.DaemonCalls`) against a stand-in daemon on a
Unix socket: the multiplexed output read back as written, the daemon's refusals named, and a
kept-alive connection the daemon closed tried once more (never the start, which runs the
command). The real daemon answers it in every Docker test (tests/processes, tests/e2e)."""

from __future__ import annotations

import io
import itertools
import json
import socketserver
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polar_mitm.sandbox.daemon import DaemonCalls, DaemonClosed, DaemonRefused, _Connection, exec_output


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


# -- the reply's framing (`_Connection`), read from bytes as the daemon's server writes them ------


def reading(raw: bytes) -> _Connection:
    conn = _Connection.__new__(_Connection)  # no socket: the reader is what is under test
    conn.rfile = io.BufferedReader(io.BytesIO(raw), 7)  # a small buffer: lines split across reads
    conn.reusable = True
    return conn


def framed(body: bytes, how: str, cuts: list[int]) -> bytes:
    if how == "length":
        return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nApi-Version: 1.41\r\n\r\n" % len(body) + body
    if how == "chunked":
        at = sorted({c % (len(body) + 1) for c in cuts} | {0, len(body)})
        parts = [body[a:b] for a, b in itertools.pairwise(at) if b > a]
        chunks = b"".join(b"%x;ext=1\r\n" % len(p) + p + b"\r\n" for p in parts)
        return (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: Chunked\r\n\r\n" + chunks + b"0\r\nX-Trailer: t\r\n\r\n"
        )
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/vnd.docker.raw-stream\r\n\r\n" + body
    )  # to the close


@given(
    st.lists(
        st.tuples(
            st.binary(max_size=200),
            st.sampled_from(["length", "chunked"]),
            st.lists(st.integers(0, 400), max_size=6),
        ),
        min_size=1,
        max_size=4,
    ),
    st.binary(max_size=200),
)
def test_replies_on_one_connection_are_read_each_whole_and_no_further(replies, last):
    """Framed by a length or in chunks (extensions, trailers, any split), each reply's body is
    exactly what was sent, so the next reply on the kept-alive connection starts where it should;
    a body that runs to the close ends the connection's reuse."""
    raw = b"HTTP/1.1 100 Continue\r\n\r\n" + b"".join(framed(b, how, cuts) for b, how, cuts in replies)
    conn = reading(raw + framed(last, "close", []))
    for body, _how, _cuts in replies:
        reply = conn.reply()
        assert reply.status == 200 and conn.read_body(reply) == body and conn.reusable
    reply = conn.reply()
    assert b"".join(conn.body(reply, 16)) == last and not conn.reusable


def test_no_body_for_204_whatever_the_headers_say():
    conn = reading(
        b"HTTP/1.1 204 No Content\r\nContent-Length: 9\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"
    )
    assert conn.read_body(conn.reply()) == b""
    assert conn.read_body(conn.reply()) == b"{}"


@pytest.mark.parametrize(
    "raw, error",
    [
        (b"", DaemonClosed),  # closed before answering: a kept-alive connection is tried again
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{}", ConnectionError),  # body cut short
        (b"HTTP/1.1 200 OK\r\nContent-Le", ConnectionError),  # headers cut short
        (b"SSH-2.0-OpenSSH\r\n", ConnectionError),  # not HTTP
    ],
)
def test_a_reply_cut_short_or_not_http_is_an_error(raw, error):
    """(The caller closes a connection after any error.)"""
    conn = reading(raw)
    with pytest.raises(error):
        conn.read_body(conn.reply())


CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(
    "rest",
    [
        b"10\r\nabc",  # within a chunk
        b"3\r\nabc\r\n",  # before the next chunk's size line
        b"3\r\nab",  # before a chunk's end
        b"3\r\nabcdef\r\n0\r\n\r\n",  # a chunk longer than its size
        b"zz\r\nabc\r\n",  # a size that is not hex
        b"-3\r\nabc\r\n",  # nor a size
    ],
)
def test_a_chunked_reply_cut_short_or_misframed_is_a_connection_error(rest):
    """The same error as any broken connection (the caller closes the connection and names it),
    never a ValueError from deep inside the reader."""
    conn = reading(CHUNKED + rest)
    with pytest.raises(ConnectionError):
        conn.read_body(conn.reply())


@pytest.mark.parametrize("length", [b"ten", b"-1", b""])
def test_a_length_that_is_not_one_is_a_connection_error(length):
    conn = reading(b"HTTP/1.1 200 OK\r\nContent-Length: " + length + b"\r\n\r\n{}")
    with pytest.raises(ConnectionError):
        conn.read_body(conn.reply())
