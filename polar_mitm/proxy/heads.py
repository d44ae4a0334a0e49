"""A client connection's first request head, read before anyone serves the connection.

The proxy's own listener, a sample's channel and `--workers`' front each read the head of a new
connection's first request (a `CONNECT host:port`, or a plain proxy request) before they decide
who serves it: which worker, which session, or whether the gateway takes a provider tunnel
itself (`proxy/addons/handoff.py`). One reader and one header lookup for all of them.
"""

from __future__ import annotations

import asyncio
import re
import socket

HEAD_TIMEOUT = 30.0  # seconds a new connection may take to send its first request head
MAX_HEAD = 64 * 1024  # a first request head longer than this is not read further
CHUNK = 256 * 1024

# A CONNECT's request line, as clients send it: a host name (or IPv4 address) and a port.
_CONNECT = re.compile(rb"CONNECT ([A-Za-z0-9.-]{1,253}):([0-9]{1,5}) HTTP/1\.[01]")


async def read_head(
    conn: socket.socket, *, limit: int = MAX_HEAD, timeout: float = HEAD_TIMEOUT
) -> bytes | None:
    """The bytes read from `conn` (non-blocking) up to the end of its first request head, and
    any that came after it in the same read; b"" when the peer closed before sending a byte
    (a forwarder's hello), None when the head is longer than `limit`, cut short by the close,
    later than `timeout`, or the socket failed."""
    loop = asyncio.get_running_loop()
    buf = b""
    try:
        async with asyncio.timeout(timeout):
            while b"\r\n\r\n" not in buf:
                if len(buf) > limit:
                    return None
                data = await loop.sock_recv(conn, CHUNK)
                if not data:
                    return b"" if not buf else None
                buf += data
    except (TimeoutError, OSError):
        return None
    return buf


def header(head: bytes, name: bytes) -> str | None:
    """The value of header `name` (lower case) in a request head, the first if repeated; None
    when the head has none (lines after the head's end are not looked at)."""
    for line in head.split(b"\r\n")[1:]:
        if not line:
            break
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip().decode("latin-1")
    return None


def connect_target(head: bytes) -> tuple[str, int] | None:
    """(host in lower case, port) of a CONNECT head that is the whole of what was read: its
    request line, headers and empty line, no byte after it (a client sends its TLS hello only
    once the tunnel is answered). None for anything else."""
    end = head.find(b"\r\n\r\n")
    if end < 0 or end + 4 != len(head):
        return None
    line = head.partition(b"\r\n")[0]
    m = _CONNECT.fullmatch(line)
    if m is None:
        return None
    port = int(m.group(2))
    return (m.group(1).decode("ascii").lower(), port) if 0 < port < 65536 else None
