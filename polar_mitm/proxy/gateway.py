"""The local translator server that answers provider model calls.

mitmproxy streams only responses that come from a server, so the routing addon sends provider
model calls here (on loopback, inside the same process) and streams our answer back. This
server speaks each provider's API: it reads the body, routes it to its style, parses it with the
style module, asks the policy (which alone decides whether the prompt fits: `policy/admission.py`),
and renders the reply as JSON or as SSE while the policy generates.

Its port is reachable by every local process, so the proxy's gateway answers only requests that
carry its per-process secret, which the routing addon adds to the flows it sends (a 403 in the
provider's shape otherwise). A gateway made without a secret stands in for a provider's API and
answers anyone.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import secrets
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from polar_mitm import providers, recipes, redact
from polar_mitm.backends import large_inputs
from polar_mitm.neutral import ChatRequest, Done, Event, ProviderError, Started
from polar_mitm.policy import Policy, TurnContext
from polar_mitm.providers import Style, fields, side_endpoints
from polar_mitm.providers.base import ItemMemo
from polar_mitm.proxy import repeats
from polar_mitm.proxy.continuations import Continuations
from polar_mitm.proxy.inflight import InFlight

log = logging.getLogger("polar_mitm.proxy.gateway")

# Headers the routing addon adds to every flow it sends here.
HOST_HEADER = "x-polar-host"
SESSION_HEADER = "x-polar-session"
# Proves a request came through the proxy (and its --token check), not from any local process
# that found the loopback port. Never stored (redact drops x-polar-* headers).
SECRET_HEADER = "x-polar-secret"
# What the sessions' request memos may hold in all (JSON text; the messages read are about as
# much again): a few hundred 32k-token conversations.
MEMO_BYTES = 256 * 2**20
UNKNOWN_SAID_MAX = 100_000  # (session, style, field) entries remembered before starting over
# Seconds `stop` lets calls under way finish before it cancels them (a cancelled turn stores what
# it sampled); aiohttp's own 60 s would hold a stopping proxy for a minute on a hung engine.
STOP_GRACE = 1.0


class _Call:
    """One request being answered: where it came from, and the turn it started, once known (for
    the log line an unexpected failure leaves)."""

    def __init__(self, host: str, request: web.Request, session: str | None = None):
        self.host = host
        self.request = request
        self.session = session  # its connection's, or the routing addon's header (`Gateway._session`)
        self.id = "req_" + secrets.token_hex(6)
        self.turn_id: str | None = None

    def internal_error(self, e: Exception) -> ProviderError:
        """An exception nothing expected, as the style's api_error, logged on one line (the
        traceback at debug level) with the ids that find it in the log and the store."""
        which = f"request {self.id}" + (f", turn {self.turn_id}" if self.turn_id else "")
        what = f"{e.__class__.__name__}: {e}"
        log.error("%s %s: internal error (%s): %s", self.host, self.request.path, which, what)
        log.debug("traceback of %s", which, exc_info=e)
        return ProviderError(
            "api_error",
            f"internal error in polar-mitm ({which}): {what}; the proxy's log has the details",
            500,
        )


class Gateway:
    def __init__(
        self,
        policy: Policy,
        *,
        default_session: str,
        tagger: recipes.Tagger | None = None,
        default_host: str | None = None,
        secret: str | None = None,
        peers: Callable[[Any, int | None], tuple[str, str] | None] | None = None,
        routes: providers.Routes = providers.BUILTIN,
        reaches_model: Callable[[str], bool] | None = None,
        inflight: InFlight | None = None,
    ):
        self.policy = policy
        # Whether a session may be answered at all (`Egress.reaches_model`: a verifier's may not);
        # asked of every request, the one door every way to the model goes through.
        self.reaches_model = reaches_model
        # Each session's budget of request body bytes held at once (`proxy/inflight.py`), taken
        # here for the connections this gateway serves itself (a routed flow's was taken in
        # mitmproxy, `proxy/addons/bodies.py`); None: bodies are bounded one by one only.
        self.inflight = inflight
        self.routes = routes  # the hosts this gateway answers, and in which styles
        # (session, provider host) of a connection that the proxy handed over still encrypted or
        # took whole, by the connection's protocol or its remote port (`proxy/addons/handoff.py`):
        # such a connection is authorized.
        self.peers = peers
        self.default_host = default_host  # the provider this gateway stands in for, if any
        # Required of every request when set (the proxy always sets one); None: a stand-in that
        # answers anyone who can reach it.
        self.secret = secret
        self.default_session = default_session
        self.tagger = tagger
        # The conversations that stateful Responses clients continue (previous_response_id).
        self.continuations = Continuations(policy.store) if policy is not None else None
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.turns_served = 0
        self.first_request = asyncio.Event()
        self._calls: set[asyncio.Task] = set()  # the handlers under way, for `stop`
        # Per (session, style): how the messages and tools of its last requests read (see ItemMemo).
        self._memos: OrderedDict[tuple[str, str], ItemMemo] = OrderedDict()
        self._memo_bytes = 0
        # (session, style, field) of the unknown request fields already said (see _say_unknown).
        self._unknown_said: set[tuple[str, str, str]] = set()
        # Untagged calls shaped like side calls (see _side_signs), and the sessions told of one.
        self.side_call_suspects = 0
        self._suspects_said: set[str] = set()

    @property
    def max_request_bytes(self) -> int:
        return self.policy.config.max_request_bytes

    def app(self) -> web.Application:
        # A chunked body is cut off one byte past the limit (Content-Length is checked first).
        app = web.Application(client_max_size=self.max_request_bytes + 1)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    @staticmethod
    def new_secret() -> str:
        return secrets.token_urlsafe(32)

    async def start(self, host: str = "127.0.0.1", port: int = 0, ssl_context=None) -> int:
        """Listen on loopback; with an ssl_context it can also stand in for a provider's HTTPS API."""
        # Repeated headers are read as the providers read them (see repeats).
        self.runner = repeats.AppRunner(
            self.app(), access_log=None, handle_signals=False, shutdown_timeout=STOP_GRACE
        )
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, ssl_context=ssl_context)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self.port

    async def start_tls(self, ssl_context) -> int:
        """A second, TLS, listener on loopback for the connections the proxy hands over."""
        assert self.runner is not None
        site = web.TCPSite(self.runner, "127.0.0.1", 0, ssl_context=ssl_context)
        await site.start()
        return site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def _peer(self, request: web.Request) -> tuple[str, str] | None:
        if self.peers is None or request.transport is None:
            return None
        addr = request.transport.get_extra_info("peername")
        return self.peers(request.protocol, addr[1] if addr and isinstance(addr, tuple) else None)

    def _session(self, request: web.Request, peer: tuple[str, str] | None) -> str:
        """The session a request is answered for: its connection's, when the proxy handed it over
        or the gateway took it; else the one the routing addon names (a routed flow)."""
        if peer is not None:
            return peer[0]
        return request.headers.get(SESSION_HEADER) or self.default_session

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        # aiohttp cancels only the handlers whose connection is still open; one whose harness is
        # gone (the proxy closes its connections first) may wait on a hung engine: cancelled here,
        # and waited for, so that its turn is stored before the policy and the store close.
        calls = [t for t in self._calls if not t.done()]
        for t in calls:
            t.cancel()
        if calls:
            await asyncio.wait(calls, timeout=STOP_GRACE)

    # -- dispatch -------------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        # Routed flows name their provider host; a direct request (stand-in use) has it in Host.
        peer = self._peer(request)
        if peer is not None:
            host = peer[1]
        else:
            host = request.headers.get(HOST_HEADER) or request.host.rsplit(":", 1)[0]
        if host not in self.routes and self.default_host:
            host = self.default_host
        found = self.routes.route(host, request.method, request.path_qs)
        if peer is None and not self._authorized(request):
            log.warning("refused a %s %s that did not come through the proxy", request.method, request.path)
            style = found[0] if found else self.routes.error_style(host)
            return self._error(
                style,
                ProviderError(
                    "permission", "this port only answers requests routed by the polar-mitm proxy", 403
                ),
            )
        session = self._session(request, peer)
        if self.reaches_model is not None and not self.reaches_model(session):
            log.info(
                "refused %s %s of session %s, which may not reach the model", host, request.path, session
            )
            style = found[0] if found else self.routes.error_style(host)
            return self._error(
                style,
                ProviderError(
                    "permission", f"{host} is not reachable from a verifier: the model is not", 403
                ),
            )
        self.first_request.set()
        if found is None and peer is not None:  # a side endpoint of the provider's host
            status, body, ctype = side_endpoints.answer(
                request.method,
                request.path_qs,
                request.headers.get("upgrade", ""),
                self.routes.error_style(host),
            )
            return web.Response(status=status, body=body, content_type=ctype)
        if found is None:
            style = self.routes.error_style(host)
            return self._error(
                style, ProviderError("not_found", f"{request.method} {request.path} is not served", 404)
            )
        style, ep = found
        call = _Call(host, request, session)
        held = 0
        if peer is not None and self.inflight is not None:
            size = request.content_length
            held = self.max_request_bytes if size is None else min(size, self.max_request_bytes + 1)
            if not self.inflight.take(session, held):
                log.warning("%s %s: %s", host, request.path, self.inflight.refusal(session, size).strip())
                return self._error(
                    style,
                    ProviderError("request_too_large", self.inflight.refusal(session, size).strip(), 413),
                )
        task = asyncio.current_task()
        if task is not None:
            self._calls.add(task)
        try:
            return await self._answer(style, ep, call)
        except ProviderError as e:
            log.warning("%s %s: %s", host, request.path, e.message)
            return self._error(style, e)
        except ConnectionError:  # the harness went away before its stream began: nobody to answer
            raise
        except Exception as e:  # a bug of ours: still an answer the harness's SDK understands
            return self._error(style, call.internal_error(e))
        finally:
            if held:
                self.inflight.give(session, held)  # type: ignore[union-attr]
            self._calls.discard(task)  # type: ignore[arg-type]
            if (request.content_length or 0) >= large_inputs.RELEASE_AFTER_BYTES:
                large_inputs.release_memory_soon()

    async def _answer(self, style: Style, ep: str, call: _Call) -> web.StreamResponse:
        request = call.request
        raw = await self._read(request)
        if ep not in ("models", "count_tokens"):
            await self.policy.admit(raw)  # a prompt that cannot fit, refused before it is parsed
        large = len(raw) >= large_inputs.RELEASE_AFTER_BYTES
        body: Any
        if not raw:
            body, by_orjson = ({} if ep == "models" else None, False)
        elif large:  # seconds of work for a long conversation: other sessions' turns go on meanwhile
            body, by_orjson = await asyncio.to_thread(fields.read_body, raw)
        else:
            body, by_orjson = fields.read_body(raw)
        if ep == "models":
            return web.json_response(style.render_models(await self._model_names()))
        session = call.session or self.default_session
        continued = await self.continuations.parse_kwargs(style, session, body) if self.continuations else {}
        if ep == "count_tokens":  # counting needs no max_tokens, even where generating does
            req = style.parse_request(body, path=request.path_qs, require_max_tokens=False, **continued)
            return web.json_response(style.render_count(await self.policy.count_tokens(req)))
        if large:  # in a thread, so without the session's memo (the loop's requests share it)
            req = await asyncio.to_thread(
                functools.partial(style.parse_request, body, path=request.path_qs, **continued)
            )
        else:
            memo = self._memo(session, style, len(raw)) if by_orjson else None
            try:
                req = style.parse_request(body, path=request.path_qs, memo=memo, **continued)
                if memo is not None:
                    memo.settle()
            finally:
                self._memo_bytes += memo.size if memo is not None else 0
        self._say_unknown(session, style, body)
        ctx = TurnContext(
            session_id=session,
            host=call.host,
            path=redact.url(request.path_qs),
            headers=redact.headers(request.headers.items()),  # x-polar-* never stored
            raw_request=raw.decode("utf-8", "replace"),
            tag=self._tag(session, req, request),
            id_prefix=style.ID_PREFIX,
        )
        if req.stream:
            return await self._stream(style, req, ctx, call)
        async with contextlib.aclosing(self.policy.stream(req, ctx)) as events:
            async for ev in events:
                if isinstance(ev, Started):
                    call.turn_id = ev.turn_id
                elif isinstance(ev, Done):
                    self._count()
                    return web.json_response(style.render_response(ev.completion, req))
        raise ProviderError("api_error", "generation ended without a result", 500)

    async def _read(self, request: web.Request) -> bytes:
        """The body, unless it is longer than max_request_bytes (then a 413, and it is not read)."""
        limit = self.max_request_bytes
        size = request.content_length
        if size is None or size <= limit:
            try:
                return await request.read()
            except web.HTTPRequestEntityTooLarge:
                size = None  # chunked: cut off at the limit
        what = f"{size:,} bytes" if size is not None else f"more than {limit:,} bytes"
        raise ProviderError(
            "request_too_large",
            f"request body is {what}; polar-mitm accepts at most {limit:,} (--max-request-bytes)",
            413,
        )

    def _tag(self, session: str, req: ChatRequest, request: web.Request) -> str | None:
        """The request's side-call tag; an untagged one shaped like a side call is counted, and
        logged once per session: stored as a main turn, it would train the policy on a title."""
        if self.tagger is None:
            return None
        tag = self.tagger(req, request.path, request.headers, session)
        if tag is None:
            signs = self.tagger.signs(req, session)
            if recipes.looks_like_side_call(signs):
                self.side_call_suspects += 1
                if session not in self._suspects_said and len(self._suspects_said) < UNKNOWN_SAID_MAX:
                    self._suspects_said.add(session)
                    log.warning(
                        "session %s: an untagged call looks like a side call (%s) and is stored as "
                        "a main turn; a side_calls rule in the harness's recipe would tag it; said "
                        "once per session",
                        session,
                        ", ".join(signs),
                    )
        return tag

    def _authorized(self, request: web.Request) -> bool:
        if self.secret is None:
            return True
        given = request.headers.get(SECRET_HEADER, "").encode("utf-8", "replace")
        return hmac.compare_digest(given, self.secret.encode())

    def _say_unknown(self, session: str, style: Style, body: Any) -> None:
        """Log, once per session, each top-level request field the style does not know: a field
        the provider reads and we do not is a prompt the harness did not send."""
        for name in style.unknown_fields(body):
            key = (session, style.NAME, name)
            if key in self._unknown_said:
                continue
            if len(self._unknown_said) >= UNKNOWN_SAID_MAX:
                self._unknown_said.clear()
            self._unknown_said.add(key)
            log.warning(
                "session %s: %s request field %r is not read by polar-mitm (the policy's prompt may "
                "differ from what the provider would see); said once per session",
                session,
                style.NAME,
                name[:100],
            )

    def _memo(self, session: str, style: Style, size: int) -> ItemMemo:
        """The session's memo in this style, begun for a request; its bytes are taken off the
        total until the request has read (others are dropped, oldest first, to keep the total in
        bounds)."""
        key = (session, style.NAME)
        memo = self._memos.pop(key, None) or ItemMemo()
        memo.begin()
        self._memo_bytes -= memo.size
        self._memos[key] = memo
        while self._memo_bytes + size > MEMO_BYTES and len(self._memos) > 1:
            _, old = self._memos.popitem(last=False)
            self._memo_bytes -= old.size
        return memo

    async def _model_names(self) -> list[str]:
        try:
            return [(await self.policy.model_info()).model_path or "polar-policy"]
        except ProviderError:
            return ["polar-policy"]

    def _count(self) -> None:
        self.turns_served += 1

    def _error(self, style: Style, e: ProviderError) -> web.Response:
        status, body = style.render_error(e)
        headers = {"x-should-retry": "true"} if status >= 500 else None
        return web.json_response(body, status=status, headers=headers)

    async def _stream(
        self, style: Style, req: ChatRequest, ctx: TurnContext, call: _Call
    ) -> web.StreamResponse:
        events = self.policy.stream(req, ctx)
        try:
            first = await events.__anext__()  # the backend has accepted the prompt, or failed
        except StopAsyncIteration:
            raise ProviderError("api_error", "generation produced nothing", 500) from None

        async def chained() -> AsyncIterator[Event]:
            yield first
            async for ev in events:
                if isinstance(ev, Done):
                    self._count()
                yield ev

        if isinstance(first, Started):
            call.turn_id = first.turn_id
        resp = web.StreamResponse(
            headers={"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache"}
        )
        await resp.prepare(call.request)
        rendered = style.render_stream(chained(), req)
        try:
            try:
                async for chunk in rendered:
                    await resp.write(chunk)
            except (ConnectionError, asyncio.CancelledError):
                raise
            except ProviderError as e:
                await resp.write(style.render_stream_error(e))
            except Exception as e:  # a bug of ours, after the stream began: end it as the API would
                await resp.write(style.render_stream_error(call.internal_error(e)))
            await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError) as e:
            log.info("harness went away mid-stream (%s); turn recorded as aborted", e.__class__.__name__)
            if isinstance(e, asyncio.CancelledError):
                raise
            # The response, not the error: aiohttp ends a response to a client that is gone
            # quietly, where an error raised from the handler is logged with its traceback.
        finally:
            # Shielded: closing the policy's stream records an unfinished turn, even when cancelled.
            await asyncio.shield(self._close(rendered, events))
        return resp

    @staticmethod
    async def _close(*gens: Any) -> None:
        for g in gens:
            try:
                await g.aclose()
            except (RuntimeError, StopAsyncIteration):
                pass
