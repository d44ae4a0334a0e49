"""A sample's own channel to the proxy: a Unix socket on the host, relayed to the proxy's port.

A container sandbox has no network (`--network none`). Its one way out is a Unix socket the host
creates for that sample alone, in a directory of ours the sandbox cannot write, and binds into
the container (read-only: connecting to a socket needs no write access to its mount). Inside, a
small forwarder (`sandbox/forwarder/`) listens on 127.0.0.1:FORWARD_PORT and passes each TCP
connection to the socket, so harnesses keep an `http://127.0.0.1:PORT` HTTPS_PROXY unchanged.

The host end (`Channel`, in the pipeline's process, next to the proxy) is where the sample's
identity is bound. Each connection's first request head (a CONNECT, or a plain proxy request)
has every Proxy-Authorization the sandbox sent replaced by the sample's own credentials before
it reaches the proxy, and the proxy keeps a connection in the session its first request named
(`proxy/addons/sessions.py`). So nothing a sandbox can learn or send makes it another session: its
bytes reach the proxy only through its own socket, under its own name.

A channel also bounds what one sample can make the host spend: at most MAX_OPEN connections open
at once (each one more is answered 429 and closed at once), and an accept that fails for want of
descriptors is retried, not the end of the channel. A flood fills the flooding sample's own slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

from polar_mitm.proxy.addons.sessions import basic_auth
from polar_mitm.proxy.heads import read_head  # a head past heads.MAX_HEAD is refused

log = logging.getLogger("polar_mitm.channel")

FORWARD_PORT = 3128  # where the forwarder listens inside a sandbox (its own loopback)
SOCKET_NAME = "proxy.sock"
FORWARDER_DIR = Path(__file__).parent / "forwarder"  # mounted read-only into sandboxes
CHUNK = 256 * 1024
BAD_REQUEST = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
# Connections one sample may hold open at once (a harness needs a handful: its model calls, a
# side call, telemetry). Each costs the proxy's process about three descriptors, so one sample's
# flood stops here and leaves the process's limit to the others.
MAX_OPEN = 64
_TOO_MANY = (
    "polar-mitm: this sandbox already holds {n} open connections to the proxy (the limit per "
    "sample); close some before opening more.\n"
)
ACCEPT_RETRY = 0.1  # seconds to wait when accept fails for want of descriptors (EMFILE, ENFILE)


def too_many(n: int) -> bytes:
    body = _TOO_MANY.format(n=n).encode()
    return (
        b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: text/plain\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body
    )


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


Serve = Callable[[socket.socket, bytes], Awaitable[None]]


class Channel:
    """One sample's socket and its way to the proxy.

    With `serve` (the embedded proxy's `adopt`: the pipeline's case) each connection, its first
    head rewritten, is handed to mitmproxy as it is: no TCP hop, no copy in between. Without it,
    the bytes are relayed to the proxy's TCP port 127.0.0.1:`proxy_port`.

    `socket_path` is what a runtime binds into the sandbox; `ready` is set when the forwarder
    inside has said it listens (it connects once and closes without a byte). `close()` stops
    listening, ends the sample's open connections and removes the directory."""

    def __init__(
        self,
        session: str,
        token: str,
        proxy_port: int = 0,
        *,
        serve: Serve | None = None,
        proxy_host: str = "127.0.0.1",
    ):
        self.session = session
        self.authorization = basic_auth(session, token)
        self.proxy = (proxy_host, proxy_port)
        self.serve = serve
        # A short path of our own (sun_path holds 108 bytes), readable by us alone; the socket
        # itself is open to every user, so an unprivileged harness inside can connect.
        self.dir = Path(tempfile.mkdtemp(prefix="polar-ch-"))
        self.socket_path = self.dir / SOCKET_NAME
        self.connections = 0
        self.max_open = MAX_OPEN
        self.refused = 0  # connections refused past max_open
        self.ready = asyncio.Event()
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._open: set[asyncio.Task] = set()

    async def start(self) -> Channel:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(self.socket_path))
        os.chmod(self.socket_path, 0o666)
        s.listen(256)
        s.setblocking(False)
        self._listener = s
        self._accepting = asyncio.create_task(self._accept())
        return self

    async def wait_ready(self, timeout: float) -> None:
        """Until the forwarder inside listens; SandboxError-worthy TimeoutError after `timeout`."""
        await asyncio.wait_for(self.ready.wait(), timeout)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._listener)
            except OSError as e:  # EMFILE / ENFILE: the process is out of descriptors for now
                log.warning("channel of %s: accept failed (%s); retrying", self.session, e)
                await asyncio.sleep(ACCEPT_RETRY)
                continue
            if len(self._open) >= self.max_open:
                self.refused += 1
                if self.refused == 1 or self.refused % 1000 == 0:
                    log.warning(
                        "channel of %s: %d connections refused past its limit of %d open",
                        self.session,
                        self.refused,
                        self.max_open,
                    )
                conn.setblocking(False)
                with contextlib.suppress(OSError):
                    conn.send(too_many(self.max_open))  # best effort: never wait on a flooder
                conn.close()
                continue
            t = asyncio.create_task(self._serve(conn))
            self._open.add(t)
            t.add_done_callback(self._open.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        conn.setblocking(False)
        handed = False
        try:
            buf = await read_head(conn)
            if buf == b"":
                self.ready.set()
                return
            if buf is None:
                with contextlib.suppress(OSError):
                    await loop.sock_sendall(conn, BAD_REQUEST)
                return
            self.connections += 1
            end = buf.index(b"\r\n\r\n") + 4
            data = rewrite_head(buf[:end], self.authorization) + buf[end:]
            if self.serve is not None:
                handed = True  # mitmproxy owns the socket from here
                await self.serve(conn, data)
            else:
                await self._relay(conn, data)
        except (ConnectionError, OSError) as e:
            log.debug("channel of %s: %s", self.session, e)
        finally:
            if not handed:
                conn.close()

    async def _relay(self, conn: socket.socket, data: bytes) -> None:
        reader, writer = await asyncio.open_unix_connection(sock=conn)
        up_reader, upstream = await asyncio.open_connection(*self.proxy)
        try:
            upstream.write(data)
            await asyncio.gather(_pipe(reader, upstream), _pipe(up_reader, writer))
        finally:
            upstream.close()
            writer.close()

    async def close(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            self._accepting = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for t in list(self._open):
            t.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._open, return_exceptions=True)
        shutil.rmtree(self.dir, ignore_errors=True)


async def open_channel(
    session: str, token: str, *, serve: Serve | None = None, proxy_port: int = 0
) -> Channel:
    return await Channel(session, token, proxy_port, serve=serve).start()
