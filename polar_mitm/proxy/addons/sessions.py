"""Tell sessions apart by the credentials in HTTPS_PROXY (http://SESSION:TOKEN@host:port).

Every HTTP client sends those as Proxy-Authorization on CONNECT (or on each plain request);
flows inside a tunnel inherit the session of the CONNECT that opened it, and a client connection
keeps the session its first request named (later credentials on it are not looked at), so a
connection's identity is settled once, where it is checked.

Two ways to check: with a shared token (`proxy --token`), clients must present it, under any
session name, or get a 407. A proxy that serves rollouts issues each session its own token
(`issue`) and refuses every other name or token (`require_issued`): a sample that learns or
guesses another's session name cannot use it, and a name the proxy never issued gets a 407.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import secrets

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


def basic_auth(session: str, token: str) -> str:
    """The Proxy-Authorization value naming `session` with `token`."""
    return "Basic " + base64.b64encode(f"{session}:{token}".encode()).decode()


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
        self.issued: dict[str, str] = {}  # session -> its own token
        self.issued_only = False  # True: only issued (session, token) pairs are let in

    def require_issued(self) -> None:
        """From now on let in only sessions issued here, each with its own token."""
        self.issued_only = True

    def issue(self, session: str) -> str:
        """A token of `session`'s own (the same one when asked again)."""
        token = self.issued.get(session)
        if token is None:
            token = self.issued[session] = secrets.token_urlsafe(18)
        return token

    def revoke(self, session: str) -> None:
        self.issued.pop(session, None)

    def _allowed(self, creds: tuple[str, str] | None) -> bool:
        if self.issued_only:
            own = self.issued.get(creds[0]) if creds else None
            return own is not None and creds is not None and hmac.compare_digest(creds[1], own)
        return self.token is None or (creds is not None and hmac.compare_digest(creds[1], self.token))

    def admit(self, authorization: str | None) -> str | None:
        """The session a connection whose first request carries this Proxy-Authorization value
        belongs to, or None when it is refused (as `http_connect` decides, for a connection the
        gateway takes before mitmproxy sees it)."""
        creds = credentials(authorization)
        return self._session(creds) if self._allowed(creds) else None

    def _session(self, creds: tuple[str, str] | None) -> str:
        return (creds[0] if creds else None) or self.default_session

    def _place(self, flow: http.HTTPFlow, authorization: str | None) -> None:
        """The flow's session: its connection's once known (inside a tunnel, a later request of
        the same connection), else the one its credentials admit, kept for the connection; the
        407 when they are refused (a plain request, a tunnel, or a request in a refused one)."""
        known = self.by_client.get(flow.client_conn.id)
        if known is not None:
            flow.metadata["polar_session"] = known
            return
        creds = credentials(authorization)
        if not self._allowed(creds):
            _refuse(flow)
            return
        if creds:
            self.by_client[flow.client_conn.id] = creds[0]
        flow.metadata["polar_session"] = self._session(creds)

    def http_connect(self, flow: http.HTTPFlow) -> None:
        self._place(flow, flow.request.headers.get("proxy-authorization"))

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        # The credentials never go further than the proxy.
        self._place(flow, flow.request.headers.pop("proxy-authorization", None))

    def client_disconnected(self, client: connection.Client) -> None:
        self.by_client.pop(client.id, None)
