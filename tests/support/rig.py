"""The in-process rigs: the proxy stack (a fake SGLang backend and an embedded proxy) and the
gateway alone on aiohttp's test server. Their fixtures are in tests/conftest.py."""

from __future__ import annotations

from pathlib import Path


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
