"""Harvest: let provider traffic through to the real upstream, and record each model exchange.

Requests leave unchanged (the harness's own credentials included); replies stream back to the
harness chunk by chunk while a copy is kept, and once a model reply has ended it is stored as a
text turn (see `polar_mitm.proxy.exchange`) before the harness receives its last byte. Side endpoints
pass through and are not stored; a WebSocket upgrade on a model endpoint is answered 426, so the
harness uses HTTP, which can be recorded. `--upstream HOST=URL` sends one provider host somewhere
else (an internal gateway, a regional endpoint, a local test server); `--upstream-insecure` skips
certificate checks for those upstreams only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import cast

from mitmproxy import connection, http, tls
from mitmproxy.net import encoding
from OpenSSL import SSL

from polar_mitm import providers
from polar_mitm.proxy.exchange import Exchange, Tagger, Upstream
from polar_mitm.store.turn import Turn
from polar_mitm.store.writer import Store

log = logging.getLogger("polar_mitm.proxy.exchange")

KEY = "polar_harvest"


class Harvest:
    def __init__(
        self,
        store: Store,
        *,
        upstreams: dict[str, Upstream] | None = None,
        upstream_insecure: bool = False,
        tagger: Tagger | None = None,
        default_session: str = "default",
        routes: providers.Routes = providers.BUILTIN,
    ):
        self.store = store
        self.routes = routes
        self.upstreams = {h.lower(): u for h, u in (upstreams or {}).items()}
        self.upstream_insecure = upstream_insecure
        self.tagger = tagger
        self.default_session = default_session
        self.recorded = 0
        self._sessions: set[str] = set()
        self._storing = 0  # exchanges being written: a stopping proxy waits for them (`drain`)
        self._idle = asyncio.Event()
        self._idle.set()
        self._insecure_addrs = {(u.host, u.port) for u in self.upstreams.values() if u.scheme == "https"}

    async def drain(self, timeout: float) -> bool:
        """Wait until no exchange is being written (at most `timeout` s); False if one still is."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    def request(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:
            return
        host = flow.request.pretty_host.lower()
        if flow.request.headers.get("upgrade", "").lower() == "websocket":
            ws = self.routes.route(host, "POST", flow.request.path)
            if ws is not None and ws[1] == "generate":
                # A model call over a WebSocket could not be recorded; a 426 makes clients that
                # try one first (Codex) fall back to HTTP at once.
                flow.response = http.Response.make(426, b"Upgrade Required", {"content-type": "text/plain"})
                return
        found = self.routes.route(host, flow.request.method, flow.request.path)
        if found is not None and found[1] == "generate":
            flow.metadata[KEY] = Exchange(
                session_id=flow.metadata.get("polar_session") or self.default_session,
                style=found[0],
                host=host,
                method=flow.request.method,
                path=flow.request.path,
                request_headers=list(flow.request.headers.items()),
                request_body=flow.request.get_content(strict=False) or b"",
                started=flow.request.timestamp_start or time.time(),
            )
        up = self.upstreams.get(host)
        if up is not None:
            flow.request.scheme = up.scheme
            flow.request.port = up.port
            flow.request.host = up.host
            if up.path_prefix:
                flow.request.path = up.path_prefix + flow.request.path

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        assert flow.response is not None
        ex: Exchange | None = flow.metadata.get(KEY)
        # Everything streams: the harness sees each chunk as the upstream sends it.
        flow.response.stream = ex.tee if ex is not None else True

    async def response(self, flow: http.HTTPFlow) -> None:
        ex: Exchange | None = flow.metadata.pop(KEY, None)
        if ex is None or flow.response is None:
            return
        resp = flow.response
        body = bytes(ex.reply)
        enc = resp.headers.get("content-encoding", "").strip().lower()
        if enc and enc != "identity":
            try:
                body = cast(bytes, encoding.decode(body, enc))  # bytes in, bytes out
            except ValueError as e:
                log.warning("cannot decode a %s reply from %s: %s", enc, ex.host, e)
        rec = ex.record(
            status_code=resp.status_code,
            content_type=resp.headers.get("content-type"),
            reply_body=body,
            ended=resp.timestamp_end,
            tagger=self.tagger,
        )
        await self._store(rec)

    async def error(self, flow: http.HTTPFlow) -> None:
        ex: Exchange | None = flow.metadata.pop(KEY, None)
        if ex is None:
            return
        resp = flow.response
        why = flow.error.msg if flow.error else "the exchange did not complete"
        rec = ex.record(
            status_code=resp.status_code if resp is not None else None,
            content_type=resp.headers.get("content-type") if resp is not None else None,
            reply_body=bytes(ex.reply) if resp is not None else None,
            failure=why,
            tagger=self.tagger,
        )
        await self._store(rec)

    def tls_start_server(self, data: tls.TlsData) -> None:
        # Runs after mitmproxy's TlsConfig built the connection: relax verification for the
        # --upstream targets alone, so every other upstream is still checked.
        server = data.conn
        if (
            self.upstream_insecure
            and data.ssl_conn is not None
            and isinstance(server, connection.Server)
            and server.address in self._insecure_addrs
        ):
            data.ssl_conn.set_verify(SSL.VERIFY_NONE)

    async def _store(self, rec: Turn) -> None:
        # A streamed reply has reached the harness before its exchange is written here, so a proxy
        # stopping right after its harness ended waits for this (`drain`) before closing the store.
        self._storing += 1
        self._idle.clear()
        try:
            if rec.session_id not in self._sessions:
                # Sessions named by proxy credentials appear with their first turn: mark them harvested.
                await self.store.ensure_session(rec.session_id, mode="harvest")
                self._sessions.add(rec.session_id)
            await self.store.insert_turn(rec)
        finally:
            self._storing -= 1
            if not self._storing:
                self._idle.set()
        self.recorded += 1
        log.info("harvested %s %s%s: %s", rec.style, rec.host, rec.path, rec.status)
