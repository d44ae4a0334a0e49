"""Notice when a harness refuses our CA, so `run` can say so instead of hanging silently."""

from __future__ import annotations

import time

from mitmproxy import tls


class TlsWatch:
    def __init__(self) -> None:
        self.failures: list[tuple[float, str, str]] = []
        self.established = 0

    def tls_failed_client(self, data: tls.TlsData) -> None:
        sni = data.context.client.sni or "?"
        self.failures.append((time.time(), sni, str(data.conn.error or "handshake failed")))

    def tls_established_client(self, data: tls.TlsData) -> None:
        self.established += 1
