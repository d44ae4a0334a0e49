"""The egress policy: what a sandboxed session may reach through the proxy besides its model.

Two lists of sessions, both set by the rollout pipeline for its samples:
- `contained` (every sample in a container sandbox): never a host service. A CONNECT or a plain
  request to a loopback, private, link-local or otherwise non-public address, or to one of this
  machine's own addresses (a server bound to 0.0.0.0 answers there), is refused with a 403 that
  says why, also when the task allows the internet. A name is resolved here and the connection
  pinned to the address that was checked, so a name that resolves elsewhere the second time
  (DNS rebinding) gains nothing; a name that does not resolve (or resolves to nothing) is refused,
  never passed on for mitmproxy to resolve again later.
- `offline` (a task with `allow_internet = false`): every host the proxy does not answer itself
  is refused with a 403; provider hosts and the side hosts we stub keep working, so the harness
  still talks to its model. A base-URL proxy cannot enforce this: it never sees the other traffic.

- `modelless` (a verifier): the hosts the proxy answers itself (the model, the stubs) are
  refused; `contained` applies as well. This addon refuses them at mitmproxy's door, and the
  gateway asks the same rule (`reaches_model`) of every call it answers, whichever way its bytes
  came (a tunnel the proxy's port handed over whole, one mitmproxy relays, a plain request
  routed): the one check that no path to the model goes around.

Widened on purpose, by name only: the operator's `--egress-allow` hosts (`widen`: a private
package mirror) are reachable from every sandboxed session, offline ones too, also where they
resolve to a private or reserved address (never loopback, link-local or unspecified ones); a
task's own allowed hosts (`allow_hosts`: Harbor's `allowlist` network mode) are reachable from its
sessions at public addresses only. Every refusal is counted per session and host
(`take_refused`), so a verdict the network decided is visible in its sample's reward_detail.

All apply to the session the proxy settled for the connection (`proxy/addons/sessions.py`): for a
rollout, the sample's own channel, not a name the client chose.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import re
import socket

from mitmproxy import http

from polar_mitm.proxy.addons.stubs import host_pattern

log = logging.getLogger("polar_mitm.egress")


@functools.lru_cache(maxsize=4096)
def host_local(ip: str) -> bool:
    """True for an address a sandbox must not reach: not a public one, or one of this machine's."""
    try:
        a = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return True
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
        a = a.ipv4_mapped
    if (
        a.is_loopback
        or a.is_private
        or a.is_link_local
        or a.is_unspecified
        or a.is_multicast
        or a.is_reserved
        or not a.is_global
    ):
        return True
    # One of this machine's own addresses: binding to it works only here.
    family = socket.AF_INET6 if a.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((str(a), 0))
        return True
    except OSError:
        return False


REFUSED_HOSTS = 50  # hosts counted per session


def _never(ip: str) -> bool:
    """An address no sandbox reaches even by an operator's name: this machine's loopback, a
    link-local, unspecified or multicast one."""
    try:
        a = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return True
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
        a = a.ipv4_mapped
    return a.is_loopback or a.is_link_local or a.is_unspecified or a.is_multicast


def _hosts_pattern(hosts: list[str]) -> re.Pattern[str] | None:
    """One pattern for host names and `*.suffix` wildcards (case-insensitive), None for none."""
    names = [h.strip().lower() for h in hosts if h.strip()]
    if not names:
        return None
    return re.compile("^(?:" + "|".join(host_pattern(h) for h in sorted(set(names))) + ")$")


def _refuse(flow: http.HTTPFlow, text: str) -> None:
    flow.response = http.Response.make(403, text.encode(), {"content-type": "text/plain"})


class Egress:
    def __init__(self, answered_hosts: set[str]):
        self.pattern = re.compile("^(?:" + "|".join(host_pattern(h) for h in sorted(answered_hosts)) + ")$")
        self.offline: set[str] = set()  # sessions that may reach only the hosts we answer
        self.contained: set[str] = set()  # sessions that may reach no host service
        self.modelless: set[str] = set()  # sessions that may not reach the model (verifiers)
        self.refused = 0
        self.widened: re.Pattern[str] | None = None  # the operator's hosts (widen)
        self.allowed: dict[str, re.Pattern[str]] = {}  # a session's task's own hosts
        self._refusals: dict[str, dict[str, int]] = {}  # session -> host -> refusals

    def widen(self, hosts: list[str]) -> None:
        """The operator's hosts (`--egress-allow`): reachable from every sandboxed session, also
        at private or reserved addresses."""
        self.widened = _hosts_pattern(hosts)

    def allow_hosts(self, session: str, hosts: list[str]) -> None:
        """A task's own hosts: reachable from its session (offline or not), public addresses only."""
        pattern = _hosts_pattern(hosts)
        if pattern is not None:
            self.allowed[session] = pattern

    def take_refused(self, session: str) -> dict[str, int]:
        """The hosts refused to `session` and how often, forgotten once taken."""
        return self._refusals.pop(session, {})

    def _count(self, session: str | None, host: str) -> None:
        self.refused += 1
        per = self._refusals.setdefault(str(session), {})
        if host in per or len(per) < REFUSED_HOSTS:
            per[host] = per.get(host, 0) + 1

    def deny_internet(self, session: str) -> None:
        self.offline.add(session)

    def allow_internet(self, session: str) -> None:
        self.offline.discard(session)

    def contain(self, session: str) -> None:
        self.contained.add(session)

    def deny_model(self, session: str) -> None:
        """The session may not reach the hosts the proxy answers itself (a verifier's: the tests
        run the agent's code, which must not sample from the policy while it is scored)."""
        self.modelless.add(session)

    def sandboxed(self, session: str) -> bool:
        """Whether `session` is a sample's in a container sandbox (`contain`)."""
        return session in self.contained

    def reaches_model(self, session: str) -> bool:
        """Whether `session` may be answered by the model (not a verifier's)."""
        return session not in self.modelless

    def release(self, session: str) -> None:
        """Forget a session that ended (every list)."""
        self.offline.discard(session)
        self.contained.discard(session)
        self.modelless.discard(session)
        self.allowed.pop(session, None)

    async def _check(self, flow: http.HTTPFlow, connect: bool) -> None:
        if flow.response is not None:
            return
        session = flow.metadata.get("polar_session")
        # Where the connection goes (the CONNECT's or the URL's authority), not the Host header:
        # a client may name a provider there and connect anywhere.
        host = flow.request.host.lower()
        if session is not None and not self.reaches_model(session) and self.pattern.match(host):
            self._count(session, host)
            log.info("refused %s for session %s, which may not reach the model", host, session)
            _refuse(flow, f"polar-mitm: {host} is not reachable from a verifier: the model is not.\n")
            return
        if self.pattern.match(host) or (session not in self.offline and session not in self.contained):
            return
        port = flow.request.port
        widened = self.widened is not None and self.widened.match(host) is not None
        own = session in self.allowed and self.allowed[session].match(host) is not None
        if session in self.offline and not (widened or own):
            self._count(session, host)
            log.info("refused %s:%s for offline session %s", host, port, session)
            _refuse(
                flow,
                f"polar-mitm: {host} is not reachable from this sandbox: its task does not allow internet "
                "access (allow_internet = false); only the model's API is.\n",
            )
            return
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as e:
            # Fail closed: letting it through would have mitmproxy resolve the name again when the
            # client sends data, and the client's DNS chooses what it says then.
            self._count(session, host)
            log.info("refused %s:%s (does not resolve: %s) for sandboxed session %s", host, port, e, session)
            _refuse(
                flow,
                f"polar-mitm: {host} is not reachable from this sandbox: the name does not resolve "
                f"here ({e.strerror or e}), and a name that cannot be checked is refused.\n",
            )
            return
        addresses = [str(info[4][0]) for info in infos]
        if widened:
            refused = not addresses or any(_never(a) for a in addresses)
        else:
            refused = not addresses or any(host_local(a) for a in addresses)
        if refused:
            self._count(session, host)
            log.info("refused %s:%s (a host address) for sandboxed session %s", host, port, session)
            _refuse(
                flow,
                f"polar-mitm: {host}:{port} is not reachable from this sandbox: it is an address of this "
                "machine or its private network, and a sandbox reaches only its model and the internet.\n",
            )
            return
        if addresses[0] != host:  # pin the connection to the address checked
            shown = flow.request.host_header
            flow.request.host = addresses[0]
            if not connect and shown is not None:
                flow.request.host_header = shown

    async def http_connect(self, flow: http.HTTPFlow) -> None:
        await self._check(flow, True)

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        await self._check(flow, False)
