"""Repeated request headers through the real proxy and gateway, as a harness sends them.

A raw TLS client (a CONNECT to api.anthropic.com through the proxy, then HTTP bytes written by
hand, so nothing merges the headers on the way) sends `User-Agent` twice, as hermes-agent's
Anthropic client does: the provider answers such a request, so the gateway must too, and read
it once. Repeats that could make two readers see two different requests stay refused.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl

import pytest
from aiohttp.http_exceptions import BadHttpMessage
from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy

from polar_mitm.proxy.repeats import RepeatTolerantHeaders, refusal
from polar_mitm.store.reader import read_turns

BODY = json.dumps(
    {
        "model": "claude-sonnet-4-5",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi"}],
    }
).encode()


def raw_request(proxy_port: int, cafile: str, head: list[str], body: bytes) -> tuple[int, bytes]:
    """(status, body) of one HTTP/1.1 request with exactly the header lines `head`, sent over
    TLS to api.anthropic.com through the proxy at `proxy_port`."""
    with socket.create_connection(("127.0.0.1", proxy_port), timeout=30) as sock:
        sock.sendall(b"CONNECT api.anthropic.com:443 HTTP/1.1\r\nHost: api.anthropic.com:443\r\n\r\n")
        reply = b""
        while b"\r\n\r\n" not in reply:
            reply += sock.recv(4096)
        assert reply.startswith(b"HTTP/1.1 200"), reply
        ctx = ssl.create_default_context(cafile=cafile)
        with ctx.wrap_socket(sock, server_hostname="api.anthropic.com") as tls:
            lines = ["POST /v1/messages HTTP/1.1", *head, "Connection: close", "", ""]
            tls.sendall("\r\n".join(lines).encode() + body)
            data = b""
            while chunk := tls.recv(65536):
                data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def head(*extra: str, length: int = len(BODY)) -> list[str]:
    return ["Host: api.anthropic.com", "x-api-key: k", f"Content-Length: {length}", *extra]


async def send(stack, lines: list[str], body: bytes = BODY) -> tuple[int, bytes]:
    return await asyncio.to_thread(raw_request, stack.proxy.port, str(stack.proxy.ca.cert), lines, body)


async def turns(stack) -> list:
    return list(read_turns(stack.db, session="s-test", with_raw=True))


async def test_a_user_agent_sent_twice_is_answered_and_read_once(make_stack):
    stack = await make_stack()
    status, body = await send(
        stack,
        head(
            "Content-Type: application/json",
            "User-Agent: Anthropic/Python 0.69.0",
            "user-agent: hermes-agent/0.4",
        ),
    )
    assert status == 200, body
    assert json.loads(body)["content"][0]["text"]
    (turn,) = await turns(stack)  # read once: one turn, both values kept
    assert turn.request_headers["user-agent"] == "Anthropic/Python 0.69.0, hermes-agent/0.4"


async def test_an_identical_content_type_twice_is_answered(make_stack):
    stack = await make_stack()
    ctype = "Content-Type: application/json"
    status, body = await send(stack, head(ctype, ctype, "User-Agent: a", "USER-AGENT: a"))
    assert status == 200, body
    assert len(await turns(stack)) == 1


@pytest.mark.parametrize(
    "lines, said",
    [
        # Two lengths: which one frames the body decides where the next request begins.
        (head("Content-Length: 5"), b"Content-Length header came 2 times"),
        # Even equal ones are refused: no provider SDK sends them twice.
        (head(f"content-length: {len(BODY)}"), b"came 2 times"),
        (
            ["Host: api.anthropic.com", "Transfer-Encoding: chunked", "transfer-encoding: chunked"],
            b"Transfer-Encoding header came 2 times",
        ),
        # Two hosts: which provider the request is for is ambiguous.
        (head("Host: api.openai.com"), b"different values"),
        (head("Content-Type: application/json", "Content-Type: text/plain"), b"different values"),
    ],
    ids=["content-length-differs", "content-length-same", "transfer-encoding", "host", "content-type"],
)
async def test_repeats_that_change_the_request_stay_refused(make_stack, lines, said):
    stack = await make_stack()
    status, body = await send(stack, lines)
    assert status == 400 and said.lower() in body.lower(), body
    assert await turns(stack) == []


def test_refusal_names_the_header_and_its_values():
    assert refusal("User-Agent", ["a", "b"]) is None
    assert refusal("X-Stainless-Os", ["a", "b"]) is None  # not a singleton: repeats freely
    assert refusal("Content-Type", ["application/json"] * 2) is None
    why = refusal("Host", ["api.anthropic.com", "evil.example"])
    assert why and "'api.anthropic.com'" in why and "'evil.example'" in why
    assert "ambiguous" in (refusal("content-length", ["3", "3"]) or "")


def _parse(parser, lines: list[bytes]):
    try:
        headers, raw = parser(lines)
    except Exception as e:  # noqa: BLE001 - the same refusal either way is what is compared
        return type(e).__name__, str(e)
    return list(headers.items()), raw


_NAMES = st.sampled_from(
    [
        "Host",
        "host",
        "User-Agent",
        "user-agent",
        "Content-Type",
        "Content-Length",
        "X-A",
        "x-a",
        "Bad Name",
        "",
    ]
)
_VALUES = st.sampled_from(["a", "b", " spaced ", "12", "", "x\x01y", "é"])


@given(st.lists(st.tuples(_NAMES, _VALUES), max_size=8))
def test_headers_read_in_one_pass_are_read_as_line_by_line(pairs):
    """The one-call parse (no name twice) gives what reading each line alone gives, refusals
    included; a request with a name twice takes the line-by-line path."""
    lines = [f"{n}: {v}".encode() if n else f":{v}".encode() for n, v in pairs] + [b""]
    parser = RepeatTolerantHeaders(8190, 128, 8190, False)
    line_by_line = [*lines]  # one header a call: the slow path's own reading

    def one_at_a_time(ls: list[bytes]):
        headers = CIMultiDict()
        raw: list = []
        for line in ls:
            if not line:
                break
            got, got_raw = parser.parse_headers([line, b""])
            for k, v in got.items():
                if k in headers and refusal(k, [*headers.getall(k), v]) is not None:
                    raise BadHttpMessage(refusal(k, [*headers.getall(k), v]))
                headers.add(k, v)
            raw.extend(got_raw)
        return CIMultiDictProxy(headers), tuple(raw)

    assert _parse(parser.parse_headers, lines) == _parse(one_at_a_time, line_by_line)
