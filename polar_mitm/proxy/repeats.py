"""Repeated request headers read as the providers read them.

aiohttp's request parser refuses any second copy of a "singleton" header (User-Agent,
Content-Type, Host, ...) with `400 Duplicate 'User-Agent' header found.`. The providers' front
ends accept such requests, and harnesses send them: hermes-agent's Anthropic client sends
`User-Agent` twice, in different letter case. Refusing them records nothing of a session the
provider would have answered.

Which repeats are harmless is decided here (`refusal`, a pure function): a repeat that cannot
change how the request is framed or routed is accepted, and every copy is kept in the headers
(the first is what a `get` reads); one that could (two Content-Length or Transfer-Encoding
headers, two different Hosts or Content-Types) is still refused, since two readers of the same
bytes could then see different requests: request smuggling, or a body read wrong, stored as
training data.

aiohttp's C parser keeps its singleton check out of reach, so the gateway's connections use
aiohttp's pure-Python request parser with the header step below (`AppRunner`); everything else
of the parser (framing, limits, the other checks) is aiohttp's own.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from aiohttp import web, web_protocol
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.http_parser import SINGLETON_HEADERS, HeadersParser, HttpRequestParserPy
from multidict import CIMultiDict, CIMultiDictProxy

# The body's length: any repeat could be read two ways (RFC 9112 section 6.3), so none is taken.
FRAMING = frozenset({"content-length", "transfer-encoding"})
# Informative only: what the gateway reads does not depend on them, whatever their values.
INFORMATIVE = frozenset({"user-agent", "server"})


def refusal(name: str, values: list[str]) -> str | None:
    """Why a request whose header `name` came `len(values)` times (in order) is refused, or None
    when that repeat is harmless. Headers outside aiohttp's singleton set may repeat freely."""
    key = name.lower()
    if len(values) < 2 or key not in SINGLETON_HEADERS or key in INFORMATIVE:
        return None
    if key in FRAMING:
        return (
            f"the {name} header came {len(values)} times: the body's length would be ambiguous (send it once)"
        )
    if len(set(values)) > 1:
        shown = ", ".join(repr(v[:100]) for v in values[:4])
        return f"the {name} header came with different values ({shown}); send it once"
    return None


class RepeatTolerantHeaders(HeadersParser):
    """aiohttp's strict header parser, one line at a time (a strict parse has no continuation
    lines, so a line is a header), with `refusal` deciding on repeats instead of its own check."""

    def parse_headers(self, lines: list[bytes]) -> tuple[CIMultiDictProxy[str], Any]:
        # No name twice (nearly every request): aiohttp's own parse in one call is this one.
        names: set[bytes] = set()
        for line in lines:
            if not line:
                return super().parse_headers(lines)
            key = line.split(b":", 1)[0].lower()
            if key in names:
                break
            names.add(key)
        else:
            return super().parse_headers(lines)
        headers: CIMultiDict[str] = CIMultiDict()
        raw: list[tuple[bytes, bytes]] = []
        for line in lines:
            if not line:
                break
            one, one_raw = super().parse_headers([line, b""])
            name, value = next(iter(one.items()))
            if name in headers:
                why = refusal(name, [*headers.getall(name), value])
                if why is not None:
                    raise BadHttpMessage(why)
            headers.add(name, value)
            raw.extend(one_raw)
        return CIMultiDictProxy(headers), tuple(raw)


class RequestParser(HttpRequestParserPy):
    """aiohttp's request parser, reading headers with RepeatTolerantHeaders."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._headers_parser = RepeatTolerantHeaders(
            self.max_line_size, self.max_headers, self.max_field_size, self.lax
        )


class RequestHandler(web_protocol.RequestHandler):
    """aiohttp's connection handler, parsing requests with RequestParser."""

    def __init__(self, manager: web.Server, *, loop: asyncio.AbstractEventLoop, **kwargs: Any):
        super().__init__(manager, loop=loop, **kwargs)
        self._parser = RequestParser(
            self,
            loop,
            self._read_bufsize,
            max_line_size=self.max_line_size,
            max_field_size=self.max_field_size,
            max_headers=self.max_headers,
            payload_exception=web_protocol.RequestPayloadError,
            auto_decompress=kwargs.get("auto_decompress", True),
            max_msg_queue_size=web_protocol.MAX_MSG_QUEUE_SIZE,
        )


class AppRunner(web.AppRunner):
    """web.AppRunner whose sites' connections are RequestHandlers: a site asks its runner's
    `server` for each connection's protocol, and the Server stays the connections' manager."""

    @property
    def server(self) -> Any:
        server = super().server
        if server is None:
            return None
        return functools.partial(self._connection, server)

    @staticmethod
    def _connection(server: web.Server) -> RequestHandler:
        # As web.Server.__call__ makes its RequestHandler (the app's handler args included).
        return RequestHandler(server, loop=asyncio.get_running_loop(), **server._kwargs)
