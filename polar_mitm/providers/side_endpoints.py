"""Local answers for side endpoints: what a request gets that is not a model call.

Telemetry and event logging are swallowed (200 `{}`), connectivity probes answered, and a
WebSocket attempt gets a 426 so Codex falls back to HTTP at once. Anything else on a provider
host is a 404 in that provider's own error shape naming the endpoint, so an SDK call we do not
serve (`embeddings.create`, `messages.batches.create`, `embed_content`) fails with an error that
says so instead of handing back an empty object. Pure: no mitmproxy, no aiohttp; the proxy's
stubs addon and the gateway both answer with `answer`.
"""

from __future__ import annotations

import json

from polar_mitm.neutral import ProviderError
from polar_mitm.providers.base import Style

# Path fragments of fire-and-forget calls (analytics, logs, metrics): accepted and dropped.
TELEMETRY = ("event_logging", "telemetry", "/log", "/metrics", "/traces")


def is_telemetry(path: str) -> bool:
    return any(fragment in path for fragment in TELEMETRY)


def answer(method: str, path: str, upgrade: str = "", style: Style | None = None) -> tuple[int, bytes, str]:
    """(status, body, content type) for a side request. `style`: the API style of the provider
    host it went to (its errors' shape), or None for a side host a recipe stubs (telemetry,
    update checks), where every POST is swallowed."""
    path = path.split("?", 1)[0]
    if upgrade.lower() == "websocket":
        return 426, b"Upgrade Required", "text/plain"
    if method in ("HEAD", "OPTIONS") or path in ("", "/"):
        return 200, b"", "application/json"
    if path.endswith("/hello"):  # connectivity probes (Claude Code's interactive start-up)
        return 200, b'{"message": "hello"}', "application/json"
    if is_telemetry(path) or (method == "POST" and style is None):
        return 200, b"{}", "application/json"
    message = f"{method} {path} is not served by polar-mitm (it answers model calls only)"
    if style is None:
        body = {"type": "error", "error": {"type": "not_found_error", "message": message}}
        return 404, json.dumps(body).encode(), "application/json"
    status, err = style.render_error(ProviderError("not_found", message, 404))
    return status, json.dumps(err).encode(), "application/json"
