"""A sample's own channel to the proxy: a Unix socket on the host, relayed to the proxy's port.

A container sandbox has no network (`--network none`). Its one way out is a Unix socket the host
creates for that sample alone, in a directory of ours the sandbox cannot write, and binds into
the container (read-only: connecting to a socket needs no write access to its mount). Inside, a
small forwarder (`runtime/forwarder/`) listens on 127.0.0.1:FORWARD_PORT and passes each TCP
connection to the socket, so harnesses keep an `http://127.0.0.1:PORT` HTTPS_PROXY unchanged.

The host end (`Channel`, an asyncio server in the pipeline's process) is where the sample's
identity is bound. Each connection's first request head (a CONNECT, or a plain proxy request)
has every Proxy-Authorization the sandbox sent replaced by the sample's own credentials before
it reaches the proxy, and the proxy keeps a connection in the session its first request named
(`addons/sessions.py`). So nothing a sandbox can learn or send makes it another session: its
bytes reach the proxy only through its own socket, under its own name.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from polar_mitm.addons.sessions import basic_auth

log = logging.getLogger("polar_mitm.channel")

FORWARD_PORT = 3128  # where the forwarder listens inside a sandbox (its own loopback)
SOCKET_NAME = "proxy.sock"
FORWARDER_DIR = Path(__file__).parent / "forwarder"  # mounted read-only into sandboxes
MAX_HEAD = 64 * 1024  # a first request head larger than this is refused
HEAD_TIMEOUT = 30.0
CHUNK = 256 * 1024


def rewrite_head(head: bytes, authorization: str) -> bytes:
    """`head` (a request head ending in CRLF CRLF) with every Proxy-Authorization line replaced
    by one carrying `authorization`."""
    lines = head[:-4].split(b"\r\n")
    kept = [x for x in lines[1:] if not x.split(b":", 1)[0].strip().lower() == b"proxy-authorization"]
    out = [lines[0], b"Proxy-Authorization: " + authorization.encode("latin-1"), *kept]
    return b"\r\n".join(out) + b"\r\n\r\n"


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()  # half-close: the other direction may still be talking
    except (ConnectionError, OSError):
        writer.close()


class Channel:
    """One sample's socket and its relay to the proxy at 127.0.0.1:`proxy_port`.

    `socket_path` is what a runtime binds into the sandbox. `close()` stops listening, ends the
    sample's open connections and removes the directory."""

    def __init__(self, session: str, token: str, proxy_port: int, proxy_host: str = "127.0.0.1"):
        self.session = session
        self.authorization = basic_auth(session, token)
        self.proxy = (proxy_host, proxy_port)
        # A short path of our own (sun_path holds 108 bytes), readable by us alone; the socket
        # itself is open to every user, so an unprivileged harness inside can connect.
        self.dir = Path(tempfile.mkdtemp(prefix="polar-ch-"))
        self.socket_path = self.dir / SOCKET_NAME
        self.connections = 0
        self._server: asyncio.base_events.Server | None = None
        self._open: set[asyncio.Task] = set()

    async def start(self) -> Channel:
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.socket_path))
        os.chmod(self.socket_path, 0o666)
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._open.add(task)
        self.connections += 1
        upstream: asyncio.StreamWriter | None = None
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT)
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
                writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                return
            up_reader, upstream = await asyncio.open_connection(*self.proxy, limit=MAX_HEAD)
            upstream.write(rewrite_head(head, self.authorization))
            await asyncio.gather(_pipe(reader, upstream), _pipe(up_reader, writer))
        except (ConnectionError, OSError) as e:
            log.debug("channel of %s: %s", self.session, e)
        finally:
            self._open.discard(task)
            for w in (upstream, writer):
                if w is not None:
                    w.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for t in list(self._open):
            t.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._open, return_exceptions=True)
        shutil.rmtree(self.dir, ignore_errors=True)


async def open_channel(session: str, token: str, proxy_port: int) -> Channel:
    return await Channel(session, token, proxy_port).start()
