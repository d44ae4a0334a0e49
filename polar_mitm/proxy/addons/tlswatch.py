"""Notice when a harness refuses our CA, so `run` can say so instead of hanging silently.

With TLS 1.3 the client checks our certificate after the proxy considers the handshake done, so
a refusal often looks like a connection that closes before sending any request. Trust is only
proven by an HTTP request arriving over the intercepted connection.
"""

from __future__ import annotations

import logging
import time

from mitmproxy import connection, http, tls

log = logging.getLogger("polar_mitm.tlswatch")


class TlsWatch:
    def __init__(self) -> None:
        self.failures: list[tuple[float, str, str]] = []
        self.requests: dict[str, int] = {}  # host -> requests received over intercepted TLS
        self._silent: dict[str, str] = {}  # client connection id -> host, until a request arrives
        self.connections = 0  # client connections the proxy accepted (0: the harness ignored it)

    def client_connected(self, client: connection.Client) -> None:
        self.connections += 1

    def accepted(self) -> None:
        """A client connection mitmproxy never sees (one the gateway took) was accepted."""
        self.connections += 1

    def trusted(self, host: str) -> bool:
        return self.requests.get(host, 0) > 0

    def tls_failed_client(self, data: tls.TlsData) -> None:
        self.refused(data.context.client.sni or "?", str(data.conn.error or "handshake failed"))

    def tls_established_client(self, data: tls.TlsData) -> None:
        self._silent[data.context.client.id] = data.context.client.sni or "?"

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        host = self._silent.pop(flow.client_conn.id, None) or flow.client_conn.sni
        if host:
            self.seen(host)

    def seen(self, host: str) -> None:
        """A request arrived over TLS for `host`: the harness trusts our certificate there."""
        self.requests[host] = self.requests.get(host, 0) + 1

    def client_disconnected(self, client: connection.Client) -> None:
        host = self._silent.pop(client.id, None)
        if host is not None:
            self.refused(host, "the client closed the connection right after the TLS handshake")

    def refused(self, host: str, why: str) -> None:
        self.failures.append((time.time(), host, why))
        log.info("client refused our certificate for %s: %s", host, why)
