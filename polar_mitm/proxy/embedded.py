"""The embedded proxy: mitmproxy (regular mode) + our addons + the gateway, in one event loop.

TLS is intercepted only for provider hosts and known side hosts; every other host passes
through untouched (its TLS is never opened). In harvest mode there is no policy and no stub:
provider hosts are intercepted only to record their model exchanges on the way to the real
upstream (`proxy/addons/harvest.py`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import ssl
from pathlib import Path
from typing import Literal

from mitmproxy import options
from mitmproxy.addons import block, core, disable_h2c, next_layer, proxyserver, tlsconfig
from mitmproxy.master import Master
from pydantic import BaseModel, Field, field_validator

from polar_mitm import providers, recipes
from polar_mitm.backends.engine_api import ModelInfo
from polar_mitm.policy import Policy, PolicyConfig
from polar_mitm.proxy.addons.bodies import Bodies
from polar_mitm.proxy.addons.egress import Egress
from polar_mitm.proxy.addons.handoff import Handoff, provider_tls
from polar_mitm.proxy.addons.harvest import Harvest
from polar_mitm.proxy.addons.routing import Routing
from polar_mitm.proxy.addons.sessions import Sessions
from polar_mitm.proxy.addons.stubs import Stubs, host_pattern
from polar_mitm.proxy.addons.tlswatch import TlsWatch
from polar_mitm.proxy.certs import CA, ensure_ca
from polar_mitm.proxy.exchange import parse_upstream
from polar_mitm.proxy.gateway import Gateway
from polar_mitm.proxy.heads import read_head
from polar_mitm.proxy.inflight import InFlight
from polar_mitm.store.writer import Store

log = logging.getLogger("polar_mitm.proxy")


class ProxyConfig(BaseModel):
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    db: str = "polar-mitm.sqlite"
    certs_dir: Path | None = None
    default_session: str = "default"
    token: str | None = None  # when set, clients must send it as the proxy password
    # Tags side calls with this recipe's rules (`run`'s choice); None: every recipe's. A session
    # issued with a recipe of its own (a rollout's sample) is tagged by that one's.
    recipe: str | None = None
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    # What the preflight read from the engines (`check_policy`): the policy keeps it instead of
    # asking again, so a turn never waits on an engine that hangs after start-up to learn it.
    model_info: ModelInfo | None = None
    mode: Literal["policy", "harvest"] = "policy"
    # Harvest mode: provider host -> URL its requests go to instead (--upstream HOST=URL), and
    # whether those upstreams' certificates go unchecked (--upstream-insecure).
    upstreams: dict[str, str] = Field(default_factory=dict)
    upstream_insecure: bool = False
    # More provider hosts to answer (--provider-host HOST=STYLE): host -> style name.
    provider_hosts: dict[str, str] = Field(default_factory=dict)
    # The proxy is what this process is for (the CLI's proxy, run, rollout and node, a worker):
    # once it listens, `long_lived_heap` (never in a process that embeds it among other things).
    own_process: bool = False
    # Hosts a sandbox may reach even where they resolve to a private or reserved address (an
    # operator's package mirror), by name or `*.suffix` (--egress-allow); never loopback.
    egress_allow: list[str] = Field(default_factory=list)

    @field_validator("egress_allow", mode="before")
    @classmethod
    def _split_hosts(cls, v: object) -> object:
        """`--egress-allow a,b --egress-allow c` as the hosts a, b, c (blanks dropped)."""
        if isinstance(v, (list, tuple)):
            return [h.strip() for item in v for h in str(item).split(",") if h.strip()]
        return v


# Allocations between two collections of the youngest generation (Python's default: 700).
YOUNG_OBJECTS = 10_000


def long_lived_heap() -> None:
    """For a process that is a proxy from now on, once it has started: everything made so far
    (modules, mitmproxy, the tokenizer, templates, certificates) lives as long as the process, so
    the cyclic collector stops walking it (`gc.freeze`), and the youngest generation is collected
    every YOUNG_OBJECTS allocations instead of 700 (a turn makes thousands of objects that die
    with it). `bench/bench_gc.py`, 300 turns at ~1k: the collector's time fell from 225 ms to 12,
    its longest pause from 60 ms to 6. Objects still die when their last reference goes; only
    cycles among the frozen ones would stay."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_OBJECTS, older, oldest)


class ProxyStartError(RuntimeError):
    """The proxy cannot start; the message is one line."""


class ListenError(ProxyStartError):
    """The proxy cannot listen where it was told to (a busy port, an address not on this host)."""


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket on host:port; ListenError (one line) when it cannot be."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        s = socket.socket(family, kind, proto)
    except OSError as e:
        raise ListenError(
            f"cannot listen on {host or '*'}:{port}: {(e.strerror or str(e)).lower()}"
        ) from None
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as mitmproxy's server does
        s.bind(addr)
        s.listen(1024)
    except OSError as e:
        s.close()
        raise ListenError(
            f"cannot listen on {host or '*'}:{port}: {(e.strerror or str(e)).lower()}"
        ) from None
    s.setblocking(False)
    return s


def proxy_url(host: str, port: int, session: str, token: str | None) -> str:
    """The proxy URL a harness of `session` uses (credentials in it; the token when required)."""
    return f"http://{session}:{token or 'x'}@{host}:{port}"


def make_tagger(recipe: str | None) -> recipes.Tagger:
    """The side-call tagger: this recipe's rules, or every recipe's (None)."""
    return recipes.Tagger(recipe)


def mitmproxy_addons() -> list[object]:
    """The mitmproxy addons the proxy needs: listening, TLS and layer decisions, and two guards.
    mitmproxy calls every loaded addon for each event of each flow, so the rest of its defaults
    (playback, map/modify, save, onboarding, scripts, DNS, ...) would cost every turn for nothing."""
    return [
        core.Core(),
        proxyserver.Proxyserver(),
        next_layer.NextLayer(),  # allow_hosts: TLS is opened for our hosts only
        tlsconfig.TlsConfig(),
        block.Block(),  # refuses clients from public addresses (block_global), as mitmproxy does
        disable_h2c.DisableH2C(),
    ]


class PolicySide:
    """Policy mode's addons and what answers behind them: the policy and the gateway. One
    definition for the embedded proxy (`PolarProxy`) and the mitmdump script (`polar_mitm.mitmdump`).

    A harness's tunnel to a provider host is served by the gateway on the harness's own socket
    when the proxy read its CONNECT first (`take`); one that reaches mitmproxy (the mitmdump
    script, a client that did not wait for the 200) is handed to the gateway's TLS port as it is
    (`proxy/addons/handoff.py`: mitmproxy only relays its bytes). Plain-HTTP requests to a provider host
    still pass mitmproxy's HTTP layer: `routing` sends their model calls to the gateway's plain
    port and `stubs` answers the rest, as it does for the side hosts the recipes stub (the only
    hosts whose TLS mitmproxy itself needs to intercept: `intercepted`)."""

    def __init__(
        self,
        sessions: Sessions,
        tls: TlsWatch,
        default_session: str,
        routes: providers.Routes = providers.BUILTIN,
    ):
        self.routes = routes
        hosts = routes.names()
        answered = hosts | recipes.stub_hosts()
        self.intercepted = recipes.stub_hosts()
        self.handoff = Handoff(hosts, sessions, default_session, tls)
        self.egress = Egress(answered)
        self.routing = Routing(0, routes=routes)
        self.inflight = InFlight(PolicyConfig().max_session_bytes_in_flight)
        self.bodies = Bodies(
            self.egress.pattern, self.inflight, PolicyConfig().max_request_bytes, self.egress.sandboxed
        )
        self.addons: list[object] = [
            self.handoff,
            self.egress,
            self.bodies,
            self.routing,
            Stubs(answered, routes),
        ]
        self.policy: Policy | None = None
        self.gateway: Gateway | None = None
        self.tagger: recipes.Tagger | None = None  # per session: `PolarProxy.issue_session`
        self.provider_tls: ssl.SSLContext | None = None

    async def start(self, config: ProxyConfig, store: Store, confdir: Path | str) -> None:
        """Start the policy and the gateway (its plain and TLS ports) and point the addons at it."""
        self.policy = Policy(config.policy, store, model_info=config.model_info)
        self.inflight.per_session = config.policy.max_session_bytes_in_flight
        self.bodies.max_request_bytes = config.policy.max_request_bytes
        self.tagger = make_tagger(config.recipe)
        self.gateway = Gateway(
            self.policy,
            default_session=config.default_session,
            tagger=self.tagger,
            secret=Gateway.new_secret(),
            peers=self.handoff.peer,
            routes=self.routes,
            reaches_model=self.egress.reaches_model,
            inflight=self.inflight,
        )
        self.routing.gateway_port = await self.gateway.start()
        self.routing.secret = self.gateway.secret
        self.provider_tls = provider_tls(confdir, self.routes.names())
        self.handoff.gateway_port = await self.gateway.start_tls(self.provider_tls)

    async def take(self, sock: socket.socket, head: bytes) -> bool:
        """Serve `sock` in the gateway when its first `head` opens a provider tunnel the proxy
        admits (`Handoff.take`), until it ends; False when it is mitmproxy's to serve."""
        serve = self.gateway.runner.server if self.gateway is not None and self.gateway.runner else None
        if serve is None or self.provider_tls is None:
            return False
        return await self.handoff.take(sock, head, serve, self.provider_tls)

    async def stop(self) -> None:
        if self.gateway is not None:
            await self.gateway.stop()
        if self.policy is not None:
            await self.policy.close()


class _AddressedWriter(asyncio.StreamWriter):
    """A stream writer that reports a given address as both ends' (mitmproxy reads the client's
    address from its writer; a Unix socket's is empty)."""

    def __init__(self, *args, address: tuple[str, int], **kwargs):
        super().__init__(*args, **kwargs)
        self._address = address

    def get_extra_info(self, name, default=None):
        if name in ("peername", "sockname"):
            return self._address
        return super().get_extra_info(name, default)


class PolarProxy:
    def __init__(self, config: ProxyConfig):
        self.config = config
        # The hosts this proxy answers: its own, never another proxy's of the same process.
        self.routes = providers.Routes.build(config.provider_hosts)
        self.ca: CA | None = None
        self.store: Store | None = None
        self.policy: Policy | None = None
        self.gateway: Gateway | None = None
        self.harvest: Harvest | None = None
        self.master: Master | None = None
        self.tls = TlsWatch()
        self.egress: Egress | None = None  # policy mode: per-session internet access
        self.handoff: Handoff | None = None  # policy mode: provider connections to the gateway
        self.side: PolicySide | None = None  # policy mode: its addons, policy and gateway
        self.sessions: Sessions | None = None
        self.port = 0
        self._task: asyncio.Task | None = None
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._serving: set[asyncio.Task] = set()  # connections read from the listener
        self._stopped = False

    def tagger(self):
        return make_tagger(self.config.recipe)

    async def start(self) -> int:
        """Start listening and return the port; ProxyStartError (one line) when it cannot.

        The port is the proxy's own: it reads each connection's first request head (`adopt`),
        so that the gateway can take a provider tunnel whole; mitmproxy serves the rest, handed to
        it as `--workers`' front and the channels hand theirs (it listens on a loopback port of its
        own that nothing is told of)."""
        # A busy port fails here, in one line and before anything else starts, rather than in
        # mitmproxy's log with a hint that names mitmproxy's flags.
        self._listener = listen_socket(self.config.listen_host, self.config.listen_port)
        self.ca = ensure_ca(self.config.certs_dir)
        self.store = await Store.open(self.config.db)
        sessions = self.sessions = Sessions(self.config.default_session, token=self.config.token)
        if self.config.mode == "harvest":
            intercepted, mode_addons = self._harvest_addons()
        else:
            intercepted, mode_addons = await self._policy_addons(sessions)
        opts = options.Options(listen_host="127.0.0.1", listen_port=0, confdir=str(self.ca.dir))
        self.master = Master(opts)
        self.master.addons.add(*mitmproxy_addons())
        self.master.addons.add(sessions, *mode_addons, self.tls)
        self.master.options.update(
            allow_hosts=["^(?:" + "|".join(host_pattern(h) for h in sorted(intercepted)) + r")(?::\d+)?$"],
            connection_strategy="lazy",
            upstream_cert=False,
        )
        self._task = asyncio.create_task(self.master.run())
        await self._wait_listening()
        self.port = self._listener.getsockname()[1]
        self._accepting = asyncio.create_task(self._accept(self._listener))
        if self.config.own_process:
            long_lived_heap()
        return self.port

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as e:  # out of descriptors (EMFILE): the others go on, try again
                log.warning("accepting a connection failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(self._first_head(conn))
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)

    async def _first_head(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        head = await read_head(conn)
        if not head:  # closed before a whole head, or too long or too late: nothing to serve
            conn.close()
            return
        try:
            await self.adopt(conn, head)
        except BaseException:
            conn.close()
            raise

    async def _policy_addons(self, sessions: Sessions) -> tuple[set[str], list[object]]:
        """Policy mode: the gateway answers model calls (`PolicySide`)."""
        assert self.ca is not None and self.store is not None
        side = PolicySide(sessions, self.tls, self.config.default_session, self.routes)
        side.egress.widen(self.config.egress_allow)
        self.side, self.handoff, self.egress = side, side.handoff, side.egress
        await side.start(self.config, self.store, self.ca.dir)
        self.policy, self.gateway = side.policy, side.gateway
        return side.intercepted, side.addons

    def _harvest_addons(self) -> tuple[set[str], list[object]]:
        """Harvest mode: no policy and no stubs. Provider hosts (and --upstream hosts) are
        intercepted so their model exchanges can be recorded; everything reaches a real upstream."""
        assert self.store is not None
        upstreams = dict(parse_upstream(f"{h}={u}") for h, u in self.config.upstreams.items())
        self.harvest = Harvest(
            self.store,
            upstreams=upstreams,
            upstream_insecure=self.config.upstream_insecure,
            tagger=self.tagger(),
            default_session=self.config.default_session,
            routes=self.routes,
        )
        return self.routes.names() | set(upstreams), [self.harvest]

    async def _wait_listening(self, timeout: float = 15.0) -> int:
        assert self.master is not None and self._task is not None  # start() made them
        ps = self.master.addons.get("proxyserver")
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            if self._task.done():
                self._task.result()
                raise RuntimeError("proxy stopped during start-up")
            for server in ps.servers:
                if server.listen_addrs:
                    return server.listen_addrs[0][1]
                if server.last_exception is not None:  # e.g. the port was taken since start()
                    raise ListenError(str(server.last_exception).splitlines()[0])
            await asyncio.sleep(0.02)
        raise RuntimeError(f"proxy did not start listening within {timeout}s")

    async def stop(self) -> None:
        if self._stopped:  # (a second stop, from a caller's cleanup, is nothing to do)
            return
        self._stopped = True
        if self._accepting is not None:
            self._accepting.cancel()
        if self._listener is not None:
            self._listener.close()
        for t in list(self._serving):  # what they hold ends with them
            t.cancel()
        if self.master is not None:
            self.master.shutdown()
            if self._task is not None:
                try:
                    await asyncio.wait_for(self._task, 10)
                except (TimeoutError, asyncio.CancelledError):
                    pass
        if self.harvest is not None and not await self.harvest.drain(10):
            log.warning("stopped while a harvested exchange was still being written; it is not stored")
        if self.side is not None:
            await self.side.stop()
        if self.store is not None:
            await self.store.close()

    def session_url(self, session: str) -> str:
        """The proxy URL a harness of `session` uses (credentials in it: the session's own token
        when it was issued one, else the shared token when one is required)."""
        return proxy_url(self.config.listen_host, self.port, session, self.session_token(session))

    def session_token(self, session: str) -> str | None:
        issued = self.sessions.issued.get(session) if self.sessions is not None else None
        return issued or self.config.token

    def serve_issued_only(self) -> None:
        """Let in only sessions issued by `issue_session`, each with its own token (a rollout's
        proxy: no sample can name another's session, nor one the proxy never issued)."""
        assert self.sessions is not None, "start the proxy first"
        self.sessions.require_issued()

    def issue_session(self, session: str, recipe: str | None = None) -> str:
        """`session`'s own token (made on first use); its side calls are tagged by `recipe`'s
        rules where one is given (the session carries what runs), else by the proxy's."""
        assert self.sessions is not None, "start the proxy first"
        if recipe is not None and self.side is not None and self.side.tagger is not None:
            self.side.tagger.assign(session, recipe)
        return self.sessions.issue(session)

    def revoke_session(self, session: str) -> None:
        if self.sessions is not None:
            self.sessions.revoke(session)
        if self.side is not None and self.side.tagger is not None:
            self.side.tagger.forget(session)

    async def adopt(
        self, sock: socket.socket, head: bytes, *, address: tuple[str, int] | None = None
    ) -> None:
        """Serve a client connection whose first `head` was read already (by the proxy's own
        listener; `--workers`' front, in another process; a sample's channel, a Unix socket),
        until it ends: the gateway takes a provider tunnel whole (`PolicySide.take`); otherwise
        mitmproxy reads those bytes first, then the socket. `address` is the client address
        mitmproxy is told (a Unix socket has none)."""
        assert self.master is not None
        if self.side is not None and await self.side.take(sock, head):
            return
        loop = asyncio.get_running_loop()
        sock.setblocking(False)
        reader = asyncio.StreamReader(limit=2**16, loop=loop)
        reader.feed_data(head)
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        transport, _ = await loop.connect_accepted_socket(lambda: protocol, sock=sock)
        if address is None:
            writer = asyncio.StreamWriter(transport, protocol, reader, loop)
        else:
            writer = _AddressedWriter(transport, protocol, reader, loop, address=address)
        instance = next(iter(self.master.addons.get("proxyserver").servers))
        await instance.handle_stream(reader, writer)

    @property
    def url(self) -> str:
        return f"http://{self.config.listen_host}:{self.port}"
