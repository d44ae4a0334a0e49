"""A fake provider upstream over HTTPS, for harvest mode. Its fixture is in tests/conftest.py."""

from __future__ import annotations

from pathlib import Path


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
        self.cert, self.key = self_signed(cert_dir)
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


def self_signed(directory: Path) -> tuple[str, str]:
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
