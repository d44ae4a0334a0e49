"""Request bodies in mitmproxy's memory: streamed, or counted against their session's budget.

mitmproxy reads a plain request's body whole before its `request` hook, and a response's before
its `response` hook, so a sandbox's 300 MB upload through the proxy would sit in this process.
Bodies to and from hosts the proxy does not answer (passed through to the internet) are streamed
instead: mitmproxy holds none of their bytes. A body to a host it answers (the model, the stubbed
side hosts: their hooks need it whole) is refused with a 413 naming the cap when it says it is
longer than `max_request_bytes`, and otherwise takes its length (the cap, when it does not say) from
its session's budget (`proxy/inflight.py`) until its flow ends. A sandboxed session's body to such
a host that does not say its length (chunked) gets a 411: mitmproxy would buffer it to its end,
and its own `body_size_limit` would bound every response and upload of every session as well.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

from mitmproxy import http

from polar_mitm.proxy.inflight import InFlight

log = logging.getLogger("polar_mitm.bodies")

HELD = "polar_inflight"  # flow.metadata: (session, bytes taken) until the flow ends
PASSED = "polar_passed"  # flow.metadata: to a host the proxy does not answer (streamed both ways)


def declared_size(request: http.Request) -> int | None:
    """The body's length as the request states it: 0 when it has none; None when it does not
    say (chunked)."""
    if "transfer-encoding" in request.headers:
        return None
    try:
        return max(0, int(request.headers.get("content-length", "0")))
    except ValueError:
        return None


class Bodies:
    def __init__(
        self,
        answered: re.Pattern[str],
        inflight: InFlight,
        max_request_bytes: int,
        sandboxed: Callable[[str], bool],
    ):
        self.answered = answered
        self.sandboxed = sandboxed
        self.inflight = inflight
        self.max_request_bytes = max_request_bytes
        self.streamed = 0

    def _refuse(self, flow: http.HTTPFlow, text: str, status: int = 413) -> None:
        flow.response = http.Response.make(status, text.encode(), {"content-type": "text/plain"})

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:
            return
        if not self.answered.match(flow.request.host.lower()):
            flow.metadata[PASSED] = True
            flow.request.stream = True  # passed on as it comes
            self.streamed += 1
            return
        size = declared_size(flow.request)
        if size == 0:
            return
        limit = self.max_request_bytes
        if size is not None and size > limit:
            log.info("refused a request body of %d bytes to %s (over %d)", size, flow.request.host, limit)
            self._refuse(
                flow,
                f"polar-mitm: request body is {size:,} bytes; polar-mitm accepts at most {limit:,} "
                "(--max-request-bytes)\n",
            )
            return
        session = str(flow.metadata.get("polar_session", ""))
        if size is None and self.sandboxed(session):
            self._refuse(
                flow,
                f"polar-mitm: a request body to {flow.request.host} without a length (chunked) is not "
                "accepted from a sandbox; send its content-length\n",
                411,
            )
            return
        take = limit if size is None else size
        if not self.inflight.take(session, take):
            log.info("refused a request body of session %s: its bytes in flight are at the budget", session)
            self._refuse(flow, self.inflight.refusal(session, size))
            return
        flow.metadata[HELD] = (session, take)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None and flow.metadata.get(PASSED):
            flow.response.stream = True

    def _done(self, flow: http.HTTPFlow) -> None:
        held = flow.metadata.pop(HELD, None)
        if held is not None:
            self.inflight.give(*held)

    def response(self, flow: http.HTTPFlow) -> None:
        self._done(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._done(flow)
