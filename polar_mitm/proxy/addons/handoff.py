"""Provider connections reach the gateway still encrypted: mitmproxy relays their bytes only.

A harness's CONNECT to a provider host is not intercepted by mitmproxy. Its server connection is
pointed at the gateway's TLS port instead, and the gateway terminates TLS with a certificate for
that host from our CA and reads HTTP itself. mitmproxy thus parses no HTTP and runs no TLS for
model calls; it relays bytes. Which session a gateway connection belongs to is known here, when
mitmproxy opens it: the gateway asks by the connection's local port (`peer`).

A connection whose first head was read before mitmproxy saw it (the proxy's own listener, a
sample's channel, `--workers`' front) goes further (`take`): when that head is a CONNECT to a
provider host whose credentials the proxy admits, and nothing came after it, the 200 is
answered here and the gateway serves the socket itself, TLS and HTTP, with no relay through
mitmproxy and loopback. Anything else (another host, a refused token, bytes after the head, a
client from a public address, which mitmproxy's `block` refuses) goes to mitmproxy as before.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
import tempfile
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from mitmproxy import connection
from mitmproxy.proxy import server_hooks

from polar_mitm.proxy.addons.sessions import Sessions
from polar_mitm.proxy.addons.tlswatch import TlsWatch
from polar_mitm.proxy.heads import connect_target, header

ESTABLISHED = b"HTTP/1.1 200 Connection established\r\n\r\n"  # mitmproxy's words for it
HANDSHAKE_TIMEOUT = 30.0  # seconds a taken connection's client has for its TLS handshake


class _Taken:
    """A connection the gateway serves itself: its session, its provider host, and whether a
    request came over it (which proves the client trusts our certificate)."""

    __slots__ = ("session", "host", "asked")

    def __init__(self, session: str, host: str):
        self.session = session
        self.host = host
        self.asked = False


class Handoff:
    def __init__(self, hosts: set[str], sessions: Sessions, default_session: str, tls: TlsWatch):
        self.hosts = {h.lower() for h in hosts}
        self.sessions = sessions
        self.default_session = default_session
        self.tls = tls
        self.gateway_port = 0  # set once the gateway's TLS port is known
        self._peers: dict[int, tuple[str, str]] = {}  # our local port -> (session, provider host)
        self._hosts: dict[str, str] = {}  # server connection id -> provider host
        self._silent: set[int] = set()  # local ports whose connection has carried no request yet
        # The gateway's protocol of each connection it took (`take`) -> what it is.
        self._taken: weakref.WeakKeyDictionary[Any, _Taken] = weakref.WeakKeyDictionary()
        self.taken = 0  # connections taken so far

    def peer(self, protocol: Any, port: int | None) -> tuple[str, str] | None:
        """(session, host) of a gateway connection: one it took (by its `protocol`), or one
        mitmproxy handed over (by `port`, its other end's: our local port). The gateway asks on
        every request, which also proves the harness trusts our certificate."""
        try:
            taken = self._taken.get(protocol)
        except TypeError:  # not one we could have taken (it cannot be weakly referenced)
            taken = None
        if taken is not None:
            if not taken.asked:
                taken.asked = True
                self.tls.seen(taken.host)
            return taken.session, taken.host
        if port is None:
            return None
        found = self._peers.get(port)
        if found is not None and port in self._silent:
            self._silent.discard(port)
            self.tls.seen(found[1])
        return found

    async def take(
        self, sock: socket.socket, head: bytes, serve: Callable[[], Any], context: ssl.SSLContext
    ) -> bool:
        """Serve the connection `sock`, whose first `head` was read already, in the gateway (its
        protocol factory `serve`, TLS by `context`) when that head opens a tunnel to a provider
        host that the proxy admits; returns once the connection has ended. False, and nothing
        done, for any other connection (mitmproxy's to serve)."""
        target = connect_target(head)
        if target is None or target[1] != 443 or target[0] not in self.hosts or not self.gateway_port:
            return False
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                if ipaddress.ip_address(sock.getpeername()[0]).is_global:
                    return False  # mitmproxy refuses it (block_global)
            except (OSError, ValueError):
                return False
        session = self.sessions.admit(header(head, b"proxy-authorization"))
        if session is None:
            return False  # mitmproxy answers the 407
        host = target[0]
        loop = asyncio.get_running_loop()
        self.tls.accepted()
        self.taken += 1
        sock.setblocking(False)
        taken = _Taken(session, host)
        ended = loop.create_future()

        def protocol() -> Any:
            made = serve()
            self._taken[made] = taken
            lost = made.connection_lost

            def connection_lost(exc: BaseException | None) -> None:
                try:
                    lost(exc)
                finally:
                    if not ended.done():
                        ended.set_result(None)

            made.connection_lost = connection_lost
            return made

        try:
            await loop.sock_sendall(sock, ESTABLISHED)
            transport, _ = await loop.connect_accepted_socket(
                protocol, sock, ssl=context, ssl_handshake_timeout=HANDSHAKE_TIMEOUT
            )
        except OSError as e:  # SSL errors and the handshake's timeout among them
            sock.close()
            self.tls.refused(host, f"the TLS handshake failed: {e or type(e).__name__}")
            return True
        try:
            await ended
        except asyncio.CancelledError:
            transport.abort()  # the channel closing, the proxy stopping: the connection ends
            raise
        finally:
            if not taken.asked:
                self.tls.refused(host, "the client closed the connection without sending a request")
        return True

    def provider_host(self, server: connection.Server) -> str | None:
        """The provider host a server connection is (or will be, once opened) handed over for."""
        host = self._hosts.get(server.id)
        if host is None and server.address is not None and str(server.address[0]).lower() in self.hosts:
            host = str(server.address[0]).lower()
        return host

    def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        address = data.server.address
        if address is None or not self.gateway_port:
            return
        host = str(address[0]).lower()
        if host in self.hosts:
            self._hosts[data.server.id] = host
            data.server.address = ("127.0.0.1", self.gateway_port)

    def server_connected(self, data: server_hooks.ServerConnectionHookData) -> None:
        host = self._hosts.get(data.server.id)
        if host is None or data.server.sockname is None:
            return
        session = self.sessions.by_client.get(data.client.id) or self.default_session
        self._peers[data.server.sockname[1]] = (session, host)
        self._silent.add(data.server.sockname[1])

    def server_disconnected(self, data: server_hooks.ServerConnectionHookData) -> None:
        host = self._hosts.pop(data.server.id, None)
        if host is None or data.server.sockname is None:
            return
        port = data.server.sockname[1]
        self._peers.pop(port, None)
        if port in self._silent:
            # No request ever came through: with TLS 1.3 a client that refuses our certificate
            # does so after the handshake, and closes. (`run` reports a host that keeps doing this
            # and never succeeds.)
            self._silent.discard(port)
            self.tls.refused(host, "the client closed the connection without sending a request")


def provider_tls(confdir: Path | str, hosts: set[str]) -> ssl.SSLContext:
    """A server context that answers each provider host (by SNI) with a certificate from our CA."""
    from mitmproxy.certs import CertStore

    store = CertStore.from_store(Path(confdir).expanduser(), "mitmproxy", 2048)
    lock = threading.Lock()
    contexts: dict[str, ssl.SSLContext] = {}

    def context(host: str) -> ssl.SSLContext:
        with lock:
            ctx = contexts.get(host)
            if ctx is None:
                entry = store.get_cert(host, [x509.DNSName(host)])
                ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                ctx.set_alpn_protocols(["http/1.1"])
                # ssl loads a key only from a file: a private one, gone once it is read.
                with tempfile.TemporaryDirectory(prefix="polar-mitm-tls-") as tmp:
                    pem = Path(tmp) / "leaf.pem"
                    pem.touch(mode=0o600)
                    pem.write_bytes(
                        entry.cert.to_pem()
                        + entry.privatekey.private_bytes(
                            serialization.Encoding.PEM,
                            serialization.PrivateFormat.TraditionalOpenSSL,
                            serialization.NoEncryption(),
                        )
                    )
                    ctx.load_cert_chain(pem)
                contexts[host] = ctx
            return ctx

    default = context(sorted(hosts)[0])

    def pick(sslobj: ssl.SSLObject, name: str | None, _ctx: ssl.SSLContext) -> None:
        if name and name.lower() in hosts:
            sslobj.context = context(name.lower())

    default.sni_callback = pick
    return default
