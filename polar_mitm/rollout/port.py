"""The pipeline's port to the proxy that serves its samples (`SessionPort`): a session issued
with its own token and the recipe that tags its side calls, its URL and token, a sample's channel
connection adopted, its egress contained or denied, then released and revoked. `ProxyPort` is
the embedded proxy's; the pipeline reaches nothing else of it."""

from __future__ import annotations

import secrets
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from polar_mitm.proxy.certs import CA
    from polar_mitm.proxy.embedded import PolarProxy
    from polar_mitm.store.writer import Store


def new_token() -> str:
    """A fresh secret for a proxy or a session."""
    return secrets.token_urlsafe(18)


class SessionPort(Protocol):
    """What the pipeline asks of its proxy, one session (a sample's, or its verifier's) at a time."""

    store: Store
    ca: CA
    backend_url: str  # recorded with each sample

    def issue(self, session: str, recipe: str | None = None) -> str:
        """The session's own token (the same when asked again); its side calls tagged by `recipe`."""

    def revoke(self, session: str) -> None: ...

    def url(self, session: str) -> str:
        """The proxy URL a harness of `session` uses on this host (its credentials in it)."""

    def token(self, session: str) -> str | None: ...

    async def adopt(self, sock: socket.socket, head: bytes) -> None:
        """Serve a channel connection whose first `head` was read already."""

    def contain(self, session: str, hosts: Sequence[str], *, isolated: bool) -> None:
        """A sandbox's session: never this machine (`isolated`), the task's own `hosts` reachable."""

    def deny(self, session: str, *, internet: bool = False, model: bool = False) -> None: ...

    def refused(self, session: str) -> dict[str, int]:
        """The hosts refused to `session` and how often, forgotten once taken."""

    def release(self, session: str) -> None:
        """Forget the session's egress rules (it ended)."""


class ProxyPort:
    """`SessionPort` over the embedded proxy, which from now on lets in only the sessions it
    issued, each with its own token (no sample can name another's)."""

    def __init__(self, proxy: PolarProxy):
        assert proxy.store is not None and proxy.ca is not None, "start the proxy first"
        self._proxy = proxy
        self.store, self.ca = proxy.store, proxy.ca
        self.backend_url = proxy.config.policy.backend_url
        proxy.serve_issued_only()

    def issue(self, session: str, recipe: str | None = None) -> str:
        return self._proxy.issue_session(session, recipe)

    def revoke(self, session: str) -> None:
        self._proxy.revoke_session(session)

    def url(self, session: str) -> str:
        return self._proxy.session_url(session)

    def token(self, session: str) -> str | None:
        return self._proxy.session_token(session)

    async def adopt(self, sock: socket.socket, head: bytes) -> None:
        await self._proxy.adopt(sock, head, address=("127.0.0.1", 0))

    def contain(self, session: str, hosts: Sequence[str], *, isolated: bool) -> None:
        egress = self._proxy.egress
        if egress is not None:
            if isolated:
                egress.contain(session)
            egress.allow_hosts(session, list(hosts))

    def deny(self, session: str, *, internet: bool = False, model: bool = False) -> None:
        egress = self._proxy.egress
        if egress is not None:
            if internet:
                egress.deny_internet(session)
            if model:
                egress.deny_model(session)

    def refused(self, session: str) -> dict[str, int]:
        egress = self._proxy.egress
        return egress.take_refused(session) if egress is not None else {}

    def release(self, session: str) -> None:
        if self._proxy.egress is not None:
            self._proxy.egress.release(session)
