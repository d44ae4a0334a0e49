"""Tell sessions apart by the credentials in HTTPS_PROXY (http://SESSION:TOKEN@host:port).

Every HTTP client sends those as Proxy-Authorization on CONNECT (or on each plain request);
flows inside a tunnel inherit the session of the CONNECT that opened it. When the proxy is given
a token, clients must present it (any session name, that token), or get a 407.
"""

from __future__ import annotations

import base64
import binascii
import hmac

from mitmproxy import connection, http


def credentials(value: str | None) -> tuple[str, str] | None:
    """(session, token) from a Basic Proxy-Authorization header."""
    if not value or not value.lower().startswith("basic "):
        return None
    try:
        user, _, token = base64.b64decode(value[6:].strip()).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return (user, token) if user else None


def session_from_auth(value: str | None) -> str | None:
    creds = credentials(value)
    return creds[0] if creds else None


def _refuse(flow: http.HTTPFlow) -> None:
    flow.response = http.Response.make(
        407,
        b"polar-mitm: proxy token required (HTTPS_PROXY=http://SESSION:TOKEN@host:port)\n",
        {"proxy-authenticate": 'Basic realm="polar-mitm"', "content-type": "text/plain"},
    )


class Sessions:
    def __init__(self, default_session: str, token: str | None = None):
        self.default_session = default_session
        self.token = token
        self.by_client: dict[str, str] = {}

    def _allowed(self, creds: tuple[str, str] | None) -> bool:
        return self.token is None or (creds is not None and hmac.compare_digest(creds[1], self.token))

    def http_connect(self, flow: http.HTTPFlow) -> None:
        creds = credentials(flow.request.headers.get("proxy-authorization"))
        if not self._allowed(creds):
            _refuse(flow)
            return
        if creds:
            self.by_client[flow.client_conn.id] = creds[0]
        flow.metadata["polar_session"] = (creds[0] if creds else None) or self.default_session

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        creds = credentials(flow.request.headers.pop("proxy-authorization", None))
        known = self.by_client.get(flow.client_conn.id)
        if known is None and not self._allowed(creds):  # a plain request, or a tunnel we refused
            _refuse(flow)
            return
        flow.metadata["polar_session"] = (creds[0] if creds else None) or known or self.default_session

    def client_disconnected(self, client: connection.Client) -> None:
        self.by_client.pop(client.id, None)
