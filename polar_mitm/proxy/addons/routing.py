"""Route provider model calls to the local gateway, and stream its answers back.

Only flows to provider hosts reach this addon intercepted (TLS is intercepted for those hosts
alone); of those, model endpoints go to the gateway and everything else is left to `stubs`.
"""

from __future__ import annotations

from mitmproxy import http

from polar_mitm import providers
from polar_mitm.proxy.gateway import HOST_HEADER, SECRET_HEADER, SESSION_HEADER


class Routing:
    def __init__(
        self, gateway_port: int, secret: str | None = None, routes: providers.Routes = providers.BUILTIN
    ):
        self.gateway_port = gateway_port
        self.routes = routes
        self.secret = secret  # the gateway's, so it can tell our flows from other local clients
        self.routed = 0

    def request(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:
            return
        host = flow.request.pretty_host.lower()
        found = self.routes.route(host, flow.request.method, flow.request.path)
        if found is None:
            return
        flow.metadata["polar_route"] = found[1]
        flow.request.headers[HOST_HEADER] = host
        flow.request.headers[SESSION_HEADER] = flow.metadata.get("polar_session", "")
        if self.secret is not None:
            flow.request.headers[SECRET_HEADER] = self.secret
        flow.request.scheme = "http"
        flow.request.host = "127.0.0.1"
        flow.request.port = self.gateway_port
        self.routed += 1

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if "polar_route" in flow.metadata and flow.response is not None:
            flow.response.stream = True
