"""A provider tunnel is served by the gateway itself, not relayed through mitmproxy (`Handoff.take`).

The proxy's port is its own: it reads each connection's first head, and a CONNECT to a provider
host that the proxy admits is answered there and served by the gateway (TLS and HTTP) on the
same socket. Everything else reaches mitmproxy as before: a refused token gets mitmproxy's 407,
a head with bytes after it (a client that did not wait for the 200) is relayed, and a client
that refuses our certificate is noticed as one that mitmproxy relays is.
"""

from __future__ import annotations

import asyncio
import base64
import ssl

import httpx
from hypothesis import given
from hypothesis import strategies as st

from polar_mitm.proxy.heads import connect_target, header
from polar_mitm.store.reader import read_turns
from tests.support.helpers import MESSAGES_URL

BODY = {"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}


def client(stack, session: str, token: str = "tok", **kw) -> httpx.AsyncClient:
    host, port = stack.proxy.url.removeprefix("http://").split(":")
    verify = kw.pop("verify", str(stack.proxy.ca.cert))
    return httpx.AsyncClient(proxy=f"http://{session}:{token}@{host}:{port}", verify=verify, timeout=30, **kw)


async def test_a_provider_tunnel_is_the_gateways_and_keeps_its_session(make_stack):
    stack = await make_stack()
    async with client(stack, "alpha") as c:
        for _ in range(2):  # one tunnel, kept alive
            r = await c.post(MESSAGES_URL, json=BODY)
            assert r.status_code == 200, r.text
    handoff = stack.proxy.handoff
    assert handoff.taken == 1 and not handoff._peers  # mitmproxy never opened a relay to the gateway
    assert [t.session_id for t in read_turns(stack.db)] == ["alpha", "alpha"]
    assert stack.proxy.tls.trusted("api.anthropic.com") and stack.proxy.tls.connections == 1


async def test_a_wrong_token_gets_mitmproxys_407_and_nothing_is_taken(make_stack):
    """The attack: a client that names a session with a token the proxy does not know."""
    stack = await make_stack(token="right")
    async with client(stack, "mallory", token="wrong") as c:
        try:
            r = await c.post(MESSAGES_URL, json=BODY)
            status = r.status_code
        except httpx.ProxyError as e:
            status = 407 if "407" in str(e) else str(e)
    assert status == 407
    assert stack.proxy.handoff.taken == 0 and list(read_turns(stack.db)) == []
    async with client(stack, "alice", token="right") as c:  # the right token is served
        assert (await c.post(MESSAGES_URL, json=BODY)).status_code == 200
    assert stack.proxy.handoff.taken == 1


async def test_a_session_the_proxy_never_issued_is_refused(make_stack):
    stack = await make_stack()
    stack.proxy.serve_issued_only()
    token = stack.proxy.issue_session("sample-1")
    async with client(stack, "sample-2", token=token) as c:  # another sample's token, its own name
        try:
            status = (await c.post(MESSAGES_URL, json=BODY)).status_code
        except httpx.ProxyError as e:
            status = 407 if "407" in str(e) else str(e)
    assert status == 407 and stack.proxy.handoff.taken == 0
    async with client(stack, "sample-1", token=token) as c:
        assert (await c.post(MESSAGES_URL, json=BODY)).status_code == 200
    assert [t.session_id for t in read_turns(stack.db)] == ["sample-1"]


async def test_a_client_that_does_not_wait_for_the_200_is_relayed_by_mitmproxy(make_stack):
    """Its TLS hello arrives with the CONNECT: mitmproxy serves the connection (as before), and
    the turn is the same."""
    stack = await make_stack()
    host, port = stack.proxy.url.removeprefix("http://").split(":")
    ctx = ssl.create_default_context(cafile=str(stack.proxy.ca.cert))
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname="api.anthropic.com")
    auth = base64.b64encode(b"eager:tok").decode()
    head = f"CONNECT api.anthropic.com:443 HTTP/1.1\r\nHost: api.anthropic.com:443\r\nProxy-Authorization: Basic {auth}\r\n\r\n"
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        try:
            tls.do_handshake()
        except ssl.SSLWantReadError:
            pass
        writer.write(head.encode() + outgoing.read())  # the hello in the same write as the CONNECT
        status = await reader.readuntil(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 200")
        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                writer.write(outgoing.read())
                incoming.write(await reader.read(65536))
        writer.write(outgoing.read())
        payload = b'{"model":"m","max_tokens":20,"messages":[{"role":"user","content":"hi"}]}'
        tls.write(
            b"POST /v1/messages HTTP/1.1\r\nHost: api.anthropic.com\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload
        )
        writer.write(outgoing.read())
        reply = b""
        while b"message_stop" not in reply and b"end_turn" not in reply:
            data = await asyncio.wait_for(reader.read(65536), 30)
            if not data:
                break
            incoming.write(data)
            try:
                while chunk := tls.read(65536):
                    reply += chunk
            except (ssl.SSLWantReadError, ssl.SSLZeroReturnError):
                pass
        assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    finally:
        writer.close()
    assert stack.proxy.handoff.taken == 0
    assert [t.session_id for t in read_turns(stack.db)] == ["eager"]


async def test_a_client_that_refuses_our_certificate_is_noticed(make_stack, tmp_path):
    from polar_mitm.proxy.certs import ensure_ca

    stack = await make_stack()
    other = ensure_ca(tmp_path / "other-ca")  # the client trusts another CA only
    async with client(stack, "wary", verify=str(other.cert)) as c:
        try:
            await c.post(MESSAGES_URL, json=BODY)
            refused = False
        except httpx.ConnectError:
            refused = True
    assert refused and stack.proxy.handoff.taken == 1
    for _ in range(50):  # the gateway's side of the handshake ends a moment later
        if stack.proxy.tls.failures:
            break
        await asyncio.sleep(0.05)
    assert [host for _, host, _ in stack.proxy.tls.failures] == ["api.anthropic.com"]
    assert not stack.proxy.tls.trusted("api.anthropic.com") and list(read_turns(stack.db)) == []


async def test_stopping_the_proxy_ends_a_taken_tunnel(make_stack):
    stack = await make_stack()
    host, port = stack.proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    auth = base64.b64encode(b"idle:tok").decode()
    writer.write(f"CONNECT api.openai.com:443 HTTP/1.1\r\nProxy-Authorization: Basic {auth}\r\n\r\n".encode())
    assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
    await asyncio.sleep(0.1)
    assert stack.proxy.handoff.taken == 1 and stack.proxy._serving  # held, waiting for a hello
    await asyncio.wait_for(stack.proxy.stop(), 15)
    assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the proxy
    writer.close()


# -- the head, read as the proxy reads it --------------------------------------------------------

HOSTS = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?(\.[a-z0-9]{1,10}){0,3}", fullmatch=True)
HEADERS = st.lists(
    st.tuples(
        st.from_regex(r"[A-Za-z-]{1,20}", fullmatch=True), st.from_regex(r"[ -~]{0,40}", fullmatch=True)
    ),
    max_size=5,
)


@given(HOSTS, st.integers(1, 65535), HEADERS, st.binary(max_size=20))
def test_a_connect_head_is_read_whole_and_only_when_nothing_follows(host, port, headers, after):
    lines = [f"CONNECT {host}:{port} HTTP/1.1"] + [f"{k}: {v}" for k, v in headers]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode()
    assert connect_target(head) == (host, port)
    assert connect_target(head.replace(b"CONNECT", b"GET", 1)) is None
    if after:
        assert connect_target(head + after) is None  # bytes the client sent before the 200
    assert connect_target(head[:-2]) is None  # not the whole head


@given(HEADERS, st.from_regex(r"[ -~]{0,40}", fullmatch=True))
def test_a_header_is_found_by_name_whatever_its_case_and_not_past_the_head(headers, value):
    head_lines = ["CONNECT h:443 HTTP/1.1"] + [
        f"{k}: {v}" for k, v in headers if k.lower() != "proxy-authorization"
    ]
    head = "\r\n".join([*head_lines, f"PROXY-Authorization: {value}"]) + "\r\n\r\n"
    assert header(head.encode(), b"proxy-authorization") == value.strip()
    beyond = "\r\n".join(head_lines) + "\r\n\r\nProxy-Authorization: x\r\n"
    assert header(beyond.encode(), b"proxy-authorization") is None


def test_odd_connect_lines_are_not_taken():
    for head in (
        b"CONNECT api.anthropic.com HTTP/1.1\r\n\r\n",  # no port
        b"CONNECT [::1]:443 HTTP/1.1\r\n\r\n",  # a literal IPv6 address: mitmproxy's
        b"CONNECT api.anthropic.com:0 HTTP/1.1\r\n\r\n",
        b"CONNECT api.anthropic.com:443 HTTP/2\r\n\r\n",
        b"CONNECT api.anthropic.com:443 HTTP/1.1\r\nHost: x\r\n\r\n\r\n",
        b"connect api.anthropic.com:443 HTTP/1.1\r\n\r\n",
    ):
        assert connect_target(head) is None, head
