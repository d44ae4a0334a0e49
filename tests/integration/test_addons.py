"""The proxy's mitmproxy addons one at a time, as mitmproxy tests its own: flows built with
`mitmproxy.test.tflow`, hooks called directly inside `taddons.context()`, no proxy booted and
no process started. What they do behind a running proxy is in test_proxy.py,
test_sandbox_attacks.py and test_harvest.py."""

from __future__ import annotations

import json
import sqlite3

from mitmproxy import http
from mitmproxy.proxy import server_hooks
from mitmproxy.test import taddons, tflow

from polar_mitm.proxy.addons.handoff import Handoff
from polar_mitm.proxy.addons.harvest import Harvest
from polar_mitm.proxy.addons.routing import Routing
from polar_mitm.proxy.addons.sessions import Sessions, basic_auth, credentials
from polar_mitm.proxy.addons.stubs import Stubs
from polar_mitm.proxy.addons.tlswatch import TlsWatch
from polar_mitm.proxy.gateway import HOST_HEADER, SECRET_HEADER, SESSION_HEADER
from polar_mitm.store.writer import Store


def request_flow(host: str, path: str, method: str = "POST", **headers: str) -> http.HTTPFlow:
    """A flow as mitmproxy hands it to `request`: no response yet."""
    f = tflow.tflow()
    f.request.host, f.request.port, f.request.scheme = host, 443, "https"
    f.request.method, f.request.path = method, path
    f.request.headers.clear()
    f.request.headers["host"] = host
    for k, v in headers.items():
        f.request.headers[k.replace("_", "-")] = v
    return f


def connect_flow(host: str, **headers: str) -> http.HTTPFlow:
    f = request_flow(host, "", method="CONNECT", **headers)
    f.request.authority = f"{host}:443"
    return f


# --- routing: model calls to the gateway, everything else left alone ------------------------------


def test_routing_sends_a_model_call_to_the_gateway_with_its_host_session_and_secret():
    routing = Routing(gateway_port=4321, secret="s3cret")
    with taddons.context(routing):
        f = request_flow("api.anthropic.com", "/v1/messages")
        f.metadata["polar_session"] = "s_1"
        routing.request(f)
        assert (f.request.scheme, f.request.host, f.request.port) == ("http", "127.0.0.1", 4321)
        assert f.request.headers[HOST_HEADER] == "api.anthropic.com"
        assert f.request.headers[SESSION_HEADER] == "s_1"
        assert f.request.headers[SECRET_HEADER] == "s3cret"
        assert f.metadata["polar_route"] == "generate" and routing.routed == 1
        f.response = tflow.tresp()
        routing.responseheaders(f)
        assert f.response.stream is True  # the gateway's answer streams back as it comes


def test_routing_leaves_side_endpoints_other_hosts_and_answered_flows():
    routing = Routing(gateway_port=4321)
    with taddons.context(routing):
        side = request_flow("api.anthropic.com", "/api/event_logging/batch")
        other = request_flow("example.com", "/v1/messages")
        answered = request_flow("api.anthropic.com", "/v1/messages")
        answered.response = tflow.tresp()
        for f in (side, other, answered):
            routing.request(f)
            assert f.request.host != "127.0.0.1" and "polar_route" not in f.metadata
            assert SECRET_HEADER not in f.request.headers
        assert routing.routed == 0
        side.response = tflow.tresp()
        routing.responseheaders(side)
        assert side.response.stream is False


# --- stubs: side endpoints answered here, in the provider's error shape ---------------------------


def test_stubs_answer_side_hosts_and_provider_side_endpoints_locally():
    stubs = Stubs({"api.anthropic.com", "*.sentry.io"})
    with taddons.context(stubs):
        telemetry = request_flow("o1.ingest.sentry.io", "/api/1/envelope/")
        unknown = request_flow("api.anthropic.com", "/v1/messages/batches")
        elsewhere = request_flow("example.com", "/x")
        routed = request_flow("api.anthropic.com", "/v1/messages")
        routed.metadata["polar_route"] = "generate"
        for f in (telemetry, unknown, elsewhere, routed):
            stubs.request(f)
    assert telemetry.response is not None and telemetry.response.status_code == 200
    assert telemetry.response.content == b"{}" and telemetry.metadata["polar_stub"] is True
    assert unknown.response is not None and unknown.response.status_code == 404
    err = json.loads(unknown.response.content)
    assert err["type"] == "error" and "POST /v1/messages/batches is not served" in err["error"]["message"]
    assert elsewhere.response is None and routed.response is None
    assert stubs.answered == 2
    assert stubs.handles("a.b.sentry.io") and not stubs.handles("sentry.io.evil.com")


# --- sessions: who a connection is, settled once, checked against the token ----------------------


def test_sessions_name_a_tunnel_by_its_credentials_and_keep_it_for_the_connection():
    sessions = Sessions("s-default", token="tok")
    with taddons.context(sessions):
        c = connect_flow("api.anthropic.com", proxy_authorization=basic_auth("worker-1", "tok"))
        sessions.http_connect(c)
        assert c.response is None and c.metadata["polar_session"] == "worker-1"
        # A request inside the tunnel inherits it; credentials it sends later are not looked at.
        inner = request_flow(
            "api.anthropic.com", "/v1/messages", proxy_authorization=basic_auth("other", "x")
        )
        inner.client_conn = c.client_conn
        sessions.requestheaders(inner)
        assert inner.response is None and inner.metadata["polar_session"] == "worker-1"
        assert "proxy-authorization" not in inner.request.headers  # never forwarded
        sessions.client_disconnected(c.client_conn)
        assert c.client_conn.id not in sessions.by_client


def test_sessions_refuse_a_wrong_or_missing_token_with_a_407():
    sessions = Sessions("s-default", token="tok")
    with taddons.context(sessions):
        for headers in ({}, {"proxy_authorization": basic_auth("worker-1", "wrong")}):
            f = connect_flow("api.anthropic.com", **headers)
            sessions.http_connect(f)
            assert f.response is not None and f.response.status_code == 407
            assert "proxy-authenticate" in f.response.headers
        assert sessions.by_client == {}


def test_sessions_issued_only_let_in_a_session_with_its_own_token():
    sessions = Sessions("s-default")
    a, b = sessions.issue("s_a"), sessions.issue("s_b")
    assert a != b and sessions.issue("s_a") == a
    sessions.require_issued()
    with taddons.context(sessions):
        own = request_flow("api.anthropic.com", "/v1/messages", proxy_authorization=basic_auth("s_a", a))
        swapped = request_flow("api.anthropic.com", "/v1/messages", proxy_authorization=basic_auth("s_a", b))
        made_up = request_flow("api.anthropic.com", "/v1/messages", proxy_authorization=basic_auth("s_z", a))
        for f in (own, swapped, made_up):
            sessions.requestheaders(f)
    assert own.response is None and own.metadata["polar_session"] == "s_a"
    assert swapped.response.status_code == 407 and made_up.response.status_code == 407
    sessions.revoke("s_a")
    again = request_flow("api.anthropic.com", "/v1/messages", proxy_authorization=basic_auth("s_a", a))
    sessions.requestheaders(again)
    assert again.response.status_code == 407


def test_credentials_read_only_basic_auth_with_a_user():
    assert credentials(basic_auth("s", "t")) == ("s", "t")
    assert credentials(basic_auth("", "t")) is None
    assert (
        credentials("Bearer abc") is None
        and credentials("Basic !!notb64") is None
        and credentials(None) is None
    )


# --- tlswatch: a harness that refuses our CA is noticed ------------------------------------------


def test_tlswatch_counts_a_connection_closed_after_the_handshake_as_a_refusal():
    watch = TlsWatch()
    with taddons.context(watch):
        client = tflow.tclient_conn()
        client.sni = "api.openai.com"
        watch.client_connected(client)
        data = type("TlsData", (), {"context": type("Ctx", (), {"client": client})()})()
        watch.tls_established_client(data)
        watch.client_disconnected(client)  # no request came
        trusting = tflow.tclient_conn()
        trusting.sni = "api.anthropic.com"
        watch.tls_established_client(
            type("TlsData", (), {"context": type("Ctx", (), {"client": trusting})()})()
        )
        f = request_flow("api.anthropic.com", "/v1/messages")
        f.client_conn = trusting
        watch.requestheaders(f)
        watch.client_disconnected(trusting)
    assert watch.connections == 1
    assert [(h, why) for _, h, why in watch.failures] == [
        ("api.openai.com", "the client closed the connection right after the TLS handshake")
    ]
    assert watch.trusted("api.anthropic.com") and not watch.trusted("api.openai.com")


# --- handoff: provider connections pointed at the gateway's TLS port ------------------------------


def test_handoff_points_provider_connections_at_the_gateway_and_knows_their_session():
    sessions, watch = Sessions("s-default"), TlsWatch()
    handoff = Handoff({"api.anthropic.com"}, sessions, "s-default", watch)
    with taddons.context(handoff):
        client = tflow.tclient_conn()
        sessions.by_client[client.id] = "worker-7"

        def hook(host: str, local_port: int) -> server_hooks.ServerConnectionHookData:
            server = tflow.tserver_conn()
            server.address = (host, 443)
            server.sockname = ("127.0.0.1", local_port)
            return server_hooks.ServerConnectionHookData(server=server, client=client)

        early = hook("api.anthropic.com", 50000)
        handoff.server_connect(early)  # before the gateway's port is known: left alone
        assert early.server.address == ("api.anthropic.com", 443)
        handoff.gateway_port = 8443
        model, other = hook("api.anthropic.com", 50001), hook("example.com", 50002)
        for d in (model, other):
            handoff.server_connect(d)
            handoff.server_connected(d)
        assert model.server.address == ("127.0.0.1", 8443) and other.server.address == ("example.com", 443)
        assert handoff.provider_host(model.server) == "api.anthropic.com"
        assert (
            handoff.peer(None, 50001) == ("worker-7", "api.anthropic.com")
            and handoff.peer(None, 50002) is None
        )
        assert watch.trusted("api.anthropic.com")  # the gateway asked: a request came through
        silent = hook("api.anthropic.com", 50003)
        handoff.server_connect(silent)
        handoff.server_connected(silent)
        handoff.server_disconnected(silent)  # closed without a request
        handoff.server_disconnected(model)
        assert handoff.peer(None, 50001) is None
    assert [(h, why) for _, h, why in watch.failures] == [
        ("api.anthropic.com", "the client closed the connection without sending a request")
    ]


# --- harvest: model exchanges recorded, side endpoints and upstream rewrites ----------------------


async def test_harvest_records_a_model_exchange_and_passes_side_calls_unrecorded(tmp_path):
    store = await Store.open(tmp_path / "h.sqlite")
    harvest = Harvest(store, default_session="s-h")
    try:
        with taddons.context(harvest):
            body = {"model": "claude", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
            f = request_flow("api.anthropic.com", "/v1/messages", content_type="application/json")
            f.request.content = json.dumps(body).encode()
            side = request_flow("api.anthropic.com", "/api/event_logging/batch")
            ws = request_flow("api.openai.com", "/v1/responses", method="GET", upgrade="websocket")
            for x in (f, side, ws):
                harvest.request(x)
            assert "polar_harvest" in f.metadata and "polar_harvest" not in side.metadata
            assert ws.response is not None and ws.response.status_code == 426
            reply = {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "model": "claude",
                "content": [{"type": "text", "text": "hello"}],
                "stop_reason": "end_turn",
                "usage": {"input_tokens": 3, "output_tokens": 1},
            }
            f.response = http.Response.make(200, b"", {"content-type": "application/json"})
            harvest.responseheaders(f)
            f.response.stream(json.dumps(reply).encode())  # the tee keeps a copy as bytes pass
            await harvest.response(f)
            side.response = tflow.tresp()
            harvest.responseheaders(side)
            await harvest.response(side)
            assert await harvest.drain(5)
    finally:
        await store.close()
    [(session, path, status, response)] = (
        sqlite3.connect(tmp_path / "h.sqlite")
        .execute("SELECT session_id, path, status, response FROM turns")
        .fetchall()
    )
    assert (session, path, status) == ("s-h", "/v1/messages", "ok")
    assert json.loads(response)["content"] == reply["content"]  # what the upstream sent, kept
    assert harvest.recorded == 1


def test_harvest_sends_an_upstream_host_elsewhere_and_only_there():
    from polar_mitm.proxy.exchange import Upstream

    harvest = Harvest(None, upstreams={"API.openai.com": Upstream("http", "127.0.0.1", 9999, "/gw")})  # type: ignore[arg-type]
    with taddons.context(harvest):
        moved = request_flow("api.openai.com", "/v1/responses")
        kept = request_flow("api.anthropic.com", "/v1/messages")
        harvest.request(moved)
        harvest.request(kept)
    assert (moved.request.scheme, moved.request.host, moved.request.port) == ("http", "127.0.0.1", 9999)
    assert moved.request.path == "/gw/v1/responses"
    assert (kept.request.host, kept.request.port) == ("api.anthropic.com", 443)
