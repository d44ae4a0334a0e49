"""Provider connections reach the gateway still encrypted: mitmproxy relays their bytes only.

A harness's CONNECT to a provider host is not intercepted by mitmproxy. Its server connection is
pointed at the gateway's TLS port instead, and the gateway terminates TLS with a certificate for
that host from our CA and reads HTTP itself. mitmproxy thus parses no HTTP and runs no TLS for
model calls; it relays bytes. Which session a gateway connection belongs to is known here, when
mitmproxy opens it: the gateway asks by the connection's local port (`peer`).
"""

from __future__ import annotations

import ssl
import tempfile
import threading
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from mitmproxy import connection
from mitmproxy.proxy import server_hooks

from polar_mitm.proxy.addons.sessions import Sessions
from polar_mitm.proxy.addons.tlswatch import TlsWatch


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

    def peer(self, port: int) -> tuple[str, str] | None:
        """(session, host) of the gateway connection whose other end is our local `port`; the
        gateway asks on every request, which also proves the harness trusts our certificate."""
        found = self._peers.get(port)
        if found is not None and port in self._silent:
            self._silent.discard(port)
            self.tls.seen(found[1])
        return found

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
