"""Answer side endpoints locally: telemetry, policy checks, connectivity probes, model lists.

Anything on a provider host that is not a model endpoint, and anything on a known telemetry
host, is answered here and never leaves the machine. Codex's WebSocket attempt gets a 426 so it
falls back to HTTP at once.
"""

from __future__ import annotations

import json
import logging
import re

from mitmproxy import http

log = logging.getLogger("polar_mitm.stubs")


def host_pattern(host: str) -> str:
    """A recipe host ("api.x.com", "*.sentry.io") as a regex over a bare host name."""
    if host.startswith("*."):
        return r"(?:[^.]+\.)*" + re.escape(host[2:])
    return re.escape(host)


class Stubs:
    def __init__(self, hosts: set[str]):
        self.hosts = {h.lower() for h in hosts}
        self.pattern = re.compile("^(?:" + "|".join(host_pattern(h) for h in sorted(self.hosts)) + ")$")
        self.answered = 0

    def handles(self, host: str) -> bool:
        return bool(self.pattern.match(host.lower()))

    def http_connect(self, flow: http.HTTPFlow) -> None:
        host = flow.request.pretty_host.lower()
        if not self.handles(host):
            # Not intercepted: the harness talks to this host directly, through the tunnel.
            log.info("passing through %s:%s untouched", host, flow.request.port)

    def request(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or "polar_route" in flow.metadata:
            return
        host = flow.request.pretty_host.lower()
        if not self.handles(host):
            return
        self.answered += 1
        flow.metadata["polar_stub"] = True
        flow.response = stub_response(flow.request)
        log.info(
            "answered %s %s%s locally: %d",
            flow.request.method,
            host,
            flow.request.path,
            flow.response.status_code,
        )


def stub_answer(method: str, path: str, upgrade: str = "") -> tuple[int, bytes, str]:
    """(status, body, content type) of a side endpoint's local answer; the proxy's stubs and the
    gateway (for the provider connections handed to it) both answer with this."""
    path = path.split("?", 1)[0]
    if upgrade.lower() == "websocket":
        return 426, b"Upgrade Required", "text/plain"
    if method in ("HEAD", "OPTIONS") or path in ("", "/"):
        return 200, b"", "application/json"
    if path.endswith("/hello"):  # connectivity probes (Claude Code's interactive start-up)
        return 200, b'{"message": "hello"}', "application/json"
    if "event_logging" in path or "telemetry" in path or "/log" in path or method == "POST":
        return 200, b"{}", "application/json"
    body = {
        "type": "error",
        "error": {"type": "not_found_error", "message": f"{path} is not served by polar-mitm"},
    }
    return 404, json.dumps(body).encode(), "application/json"


def stub_response(req: http.Request) -> http.Response:
    status, body, ctype = stub_answer(req.method, req.path, req.headers.get("upgrade", ""))
    return http.Response.make(status, body, {"content-type": ctype})
