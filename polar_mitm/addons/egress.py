"""The egress policy: sessions without internet reach their model and nothing else.

A task with `allow_internet = false` gets its sessions listed here. For those sessions every
CONNECT (and every plain HTTP request) to a host the proxy does not answer itself is refused with
a 403 that says why; provider hosts and the side hosts we stub keep working, so the harness still
talks to its model. A base-URL proxy cannot enforce this: it never sees the other traffic.
"""

from __future__ import annotations

import logging
import re

from mitmproxy import http

from polar_mitm.addons.stubs import host_pattern

log = logging.getLogger("polar_mitm.egress")


class Egress:
    def __init__(self, answered_hosts: set[str]):
        self.pattern = re.compile("^(?:" + "|".join(host_pattern(h) for h in sorted(answered_hosts)) + ")$")
        self.offline: set[str] = set()  # sessions that may reach only the hosts we answer
        self.refused = 0

    def deny_internet(self, session: str) -> None:
        self.offline.add(session)

    def allow_internet(self, session: str) -> None:
        self.offline.discard(session)

    def _check(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:
            return
        session = flow.metadata.get("polar_session")
        host = flow.request.pretty_host.lower()
        if session not in self.offline or self.pattern.match(host):
            return
        self.refused += 1
        log.info("refused %s:%s for offline session %s", host, flow.request.port, session)
        flow.response = http.Response.make(
            403,
            f"polar-mitm: {host} is not reachable from this sandbox: its task does not allow internet "
            "access (allow_internet = false); only the model's API is.\n".encode(),
            {"content-type": "text/plain"},
        )

    def http_connect(self, flow: http.HTTPFlow) -> None:
        self._check(flow)

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        self._check(flow)
