"""Tell sessions apart by the credentials in HTTPS_PROXY (http://SESSION:TOKEN@host:port).

Every HTTP client sends those as Proxy-Authorization on CONNECT (or on each plain request);
flows inside a tunnel inherit the session of the CONNECT that opened it.
"""

from __future__ import annotations

import base64
import binascii

from mitmproxy import connection, http


def session_from_auth(value: str | None) -> str | None:
    if not value or not value.lower().startswith("basic "):
        return None
    try:
        user = base64.b64decode(value[6:].strip()).decode().split(":", 1)[0]
    except (binascii.Error, UnicodeDecodeError):
        return None
    return user or None


class Sessions:
    def __init__(self, default_session: str):
        self.default_session = default_session
        self.by_client: dict[str, str] = {}

    def http_connect(self, flow: http.HTTPFlow) -> None:
        sid = session_from_auth(flow.request.headers.get("proxy-authorization"))
        if sid:
            self.by_client[flow.client_conn.id] = sid

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        sid = session_from_auth(flow.request.headers.pop("proxy-authorization", None))
        flow.metadata["polar_session"] = (
            sid or self.by_client.get(flow.client_conn.id) or self.default_session
        )

    def client_disconnected(self, client: connection.Client) -> None:
        self.by_client.pop(client.id, None)
