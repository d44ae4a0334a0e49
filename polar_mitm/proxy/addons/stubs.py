"""Answer side endpoints locally: telemetry, policy checks, connectivity probes, model lists.

Anything on a provider host that is not a model endpoint, and anything on a known telemetry
host, is answered here and never leaves the machine, as `providers.side_endpoints` says.
"""

from __future__ import annotations

import logging
import re

from mitmproxy import http

from polar_mitm import providers
from polar_mitm.providers import side_endpoints

log = logging.getLogger("polar_mitm.stubs")


def host_pattern(host: str) -> str:
    """A recipe host ("api.x.com", "*.sentry.io") as a regex over a bare host name."""
    if host.startswith("*."):
        return r"(?:[^.]+\.)*" + re.escape(host[2:])
    return re.escape(host)


class Stubs:
    def __init__(self, hosts: set[str], routes: providers.Routes = providers.BUILTIN):
        self.hosts = {h.lower() for h in hosts}
        self.routes = routes
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
        flow.response = stub_response(flow.request, self.routes)
        log.info(
            "answered %s %s%s locally: %d",
            flow.request.method,
            host,
            flow.request.path,
            flow.response.status_code,
        )


def stub_response(req: http.Request, routes: providers.Routes = providers.BUILTIN) -> http.Response:
    styles = routes.styles(req.pretty_host)
    status, body, ctype = side_endpoints.answer(
        req.method, req.path, req.headers.get("upgrade", ""), styles[0] if styles else None
    )
    return http.Response.make(status, body, {"content-type": ctype})
