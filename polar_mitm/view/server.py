"""The viewer's web server: routes, reading the store (in threads), and the guards every page has.

Reads go through the public readers (`export.iter_trajectories` via `show.find_rows`,
`reader.read_turns`, `queries`, `rollouts.read_samples`); nothing here writes the store. Rows are
cached per store version, so paging through a long trajectory merges its session once.

Guards: a page is served only to a Host header naming this server (a web page elsewhere cannot
read the store through DNS rebinding); every response forbids scripts other than our own file
(Content-Security-Policy), because everything shown was written by an untrusted harness; every
error is a page that says what to do, never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web

from polar_mitm import sse
from polar_mitm.netaddr import is_loopback
from polar_mitm.reconstruct.breaks import TokenText
from polar_mitm.reconstruct.export import iter_trajectories
from polar_mitm.reconstruct.groups import group_advantages
from polar_mitm.reconstruct.report import task_reports
from polar_mitm.reconstruct.show import find_rows
from polar_mitm.reconstruct.source import Selection, parse_since
from polar_mitm.reconstruct.stats import ReconstructStats
from polar_mitm.reconstruct.trajectory import LOGPROB_DTYPE, Trajectory
from polar_mitm.store import queries
from polar_mitm.store.reader import read_turns
from polar_mitm.store.rollouts import read_samples
from polar_mitm.strategies import Normalize, Strategy, choices
from polar_mitm.view import pages, token_pages
from polar_mitm.view.html import Html, tag
from polar_mitm.view.live import LiveRelay
from polar_mitm.view.reply import native_reply
from polar_mitm.view.tokens import PAGE_TOKENS, TokenPieces, TurnSpan, page_of, turn_spans

log = logging.getLogger("polar_mitm.view")

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self';"
    " base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
STATIC = {"view.css": "text/css", "view.js": "text/javascript"}
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


@dataclass
class ViewConfig:
    db: Path
    server: str | None = None  # a rollout service to watch (the live page)
    service_token: str | None = None
    tokenizer: Path | None = None
    page_tokens: int = PAGE_TOKENS
    # Host names a request may name (DNS-rebinding guard); empty: any (a non-loopback --listen).
    allowed_hosts: set[str] = field(default_factory=lambda: set(LOOPBACK_NAMES))


class PageError(Exception):
    """A page that explains a problem (missing store, unknown id) with its HTTP status."""

    def __init__(self, status: int, title: str, message: str, hint: Any = ""):
        self.status, self.title, self.message, self.hint = status, title, message, hint


class Viewer:
    def __init__(self, config: ViewConfig):
        self.config = config
        self.relay = LiveRelay(config.server, config.service_token) if config.server else None
        self._rows: OrderedDict[tuple, list[Trajectory]] = OrderedDict()
        self._rows_lock = threading.Lock()  # pages read in threads (asyncio.to_thread)
        self._pieces: TokenPieces | None = None
        self._text: TokenText | None = None
        self._tokenizer_note: str | None = None
        self._tokenizer_loaded = False
        self._tokenizer_lock = threading.Lock()
        self._preload: asyncio.Task | None = None
        self.runner: web.AppRunner | None = None
        self.url = ""

    # --- life ---------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard, self._errors])
        r = app.router
        r.add_get("/", lambda _: web.HTTPFound("/sessions"))  # type: ignore[arg-type,return-value]
        for route, handler in [
            ("/sessions", self.sessions),
            ("/session/{id}", self.session),
            ("/trajectory/{id}", self.trajectory),
            ("/turn/{id}", self.turn),
            ("/rollouts", self.rollouts),
            ("/group/{id}", self.group),
            ("/plots", self.plots),
            ("/live", self.live),
            ("/live/events", self.live_events),
            ("/static/{name}", self.static),
            ("/health", self.health),
        ]:
            r.add_get(route, handler)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _cleanup(self, app: web.Application) -> None:
        if self.relay is not None:
            await self.relay.close()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self.runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        # Load the tokenizer now, off the event loop, so the first trajectory does not wait for it.
        self._preload = asyncio.create_task(asyncio.to_thread(self._tokenizer))
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{bound}"
        return self.url

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    # --- guards -------------------------------------------------------------------------------

    @web.middleware
    async def _guard(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ):
        allowed = self.config.allowed_hosts
        host = (request.url.host or "").strip("[]")
        if allowed and host.lower() not in allowed:
            resp: web.StreamResponse = web.Response(
                status=403,
                text=f"this viewer answers requests for {', '.join(sorted(allowed))} only, not for {host!r}",
            )
        else:
            resp = await handler(request)
        resp.headers["Content-Security-Policy"] = CSP
        resp.headers["X-Content-Type-Options"] = "nosniff"
        resp.headers["Referrer-Policy"] = "no-referrer"
        resp.headers.setdefault("Cache-Control", "no-store")
        return resp

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ):
        try:
            return await handler(request)
        except PageError as e:
            return _html(pages.layout(e.title, pages.problem(e.title, e.message, e.hint)), e.status)
        except web.HTTPNotFound:
            return _html(
                pages.layout(
                    "Not found",
                    pages.problem("Not found", f"no page at {request.path}", "start at /sessions"),
                ),
                404,
            )
        except web.HTTPException:
            raise
        except Exception as e:  # any other failure: a page that says what failed, logged with its trace
            log.exception("viewer: %s failed", request.path)
            message = f"{type(e).__name__}: {e}"
            return _html(
                pages.layout(
                    "Something failed",
                    pages.problem("Something failed", f"reading {request.path} failed: {message}"),
                ),
                500,
            )

    def _db(self) -> Path:
        db = self.config.db
        if not db.is_file():
            raise PageError(
                503,
                "No store",
                f"no database at {db}",
                Html(
                    "pass "
                    + str(tag("code", "--db PATH"))
                    + " (or set POLAR_MITM_DB) to a store `polar-mitm run`, `proxy` or `rollout` wrote; this page works once it exists."
                ),
            )
        return db

    def _version(self) -> tuple:
        """Changes whenever the store does (its file or its write-ahead log)."""
        out: list[tuple[int, int] | None] = []
        for p in (self.config.db, Path(str(self.config.db) + "-wal")):
            try:
                st = p.stat()
                out.append((st.st_mtime_ns, st.st_size))
            except OSError:
                out.append(None)
        return tuple(out)

    # --- tokenizer ------------------------------------------------------------------------------

    def _tokenizer(self) -> tuple[TokenPieces | None, str | None]:
        with self._tokenizer_lock:
            return self._load_tokenizer()

    def _load_tokenizer(self) -> tuple[TokenPieces | None, str | None]:
        if not self._tokenizer_loaded:
            self._tokenizer_loaded = True
            path = self.config.tokenizer
            if path is None:
                self._tokenizer_note = (
                    "no tokenizer: token ids are shown instead of text. Start the viewer with --tokenizer DIR "
                    "(or POLAR_MITM_TOKENIZER), the tokenizer the policy was served with."
                )
            else:
                try:
                    self._pieces = TokenPieces(path)
                    # What `TokenText.load` builds, from the tokenizer already parsed (a second
                    # parse of a 150k vocabulary costs a second).
                    self._text = TokenText(
                        template_ids=set(self._pieces.added), decode=self._pieces.tokenizer.decode
                    )
                except (ValueError, OSError) as e:
                    self._tokenizer_note = (
                        f"cannot load the tokenizer {path} ({e}): token ids are shown instead of text."
                    )
        return self._pieces, self._tokenizer_note

    # --- reading --------------------------------------------------------------------------------

    def _session_rows(self, db: Path, session: str, strategy: str, selection: Selection) -> list[Trajectory]:
        key = (session, strategy, selection, self._version())
        with self._rows_lock:
            rows = self._rows.get(key)
        if rows is None:  # two pages asking at once may both merge; the cache stays consistent
            self._tokenizer()
            rows = find_rows(db, session, strategy=strategy, selection=selection, text=self._text)
        with self._rows_lock:
            self._rows[key] = rows
            self._rows.move_to_end(key)
            while len(self._rows) > 8:
                self._rows.popitem(last=False)
        return rows

    async def _thread[T](self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        return await asyncio.to_thread(fn, *args, **kw)

    # --- pages ----------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "db": str(self.config.db), "server": self.config.server})

    async def sessions(self, request: web.Request) -> web.Response:
        db = self._db()
        q = request.query
        filters = {k: q.get(k, "").strip() for k in ("q", "task", "harness", "status", "since")}
        since = None
        if filters["since"]:
            try:
                since = parse_since(filters["since"])
            except ValueError as e:
                raise PageError(400, "Bad filter", str(e)) from None
        offset = _int(q.get("offset"), 0)
        limit = 200
        status = filters["status"]

        def read() -> tuple[list[queries.SessionListing], dict[str, list[str]], bool]:
            # The status is derived, so it filters what the query returns; read on until a page is full.
            found: list[queries.SessionListing] = []
            at = offset
            while len(found) <= limit:
                batch = queries.list_sessions(
                    db, task=filters["task"] or None, since=since, harness=filters["harness"] or None,
                    search=filters["q"] or None, limit=1000, offset=at,
                )  # fmt: skip
                found += [s for s in batch if not status or s.status == status]
                at += len(batch)
                if len(batch) < 1000:
                    break
            return found[:limit], queries.session_facets(db), len(found) > limit

        def rates() -> list[queries.ToolParseRate]:
            # Over the sessions the task and date filters select; the harness filter picks rows.
            found = queries.tool_parse_rates(db, task=filters["task"] or None, since=since)
            return [r for r in found if not filters["harness"] or r.harness == filters["harness"]]

        listings, facets, more = await self._thread(read)
        tool_parse = await self._thread(rates)
        return _html(
            pages.sessions(
                listings,
                facets=facets,
                filters=filters,
                offset=offset,
                more=more,
                db=str(db),
                tool_parse=tool_parse,
            )
        )

    def _strategy(self, request: web.Request) -> str:
        strategy = request.query.get("strategy", Strategy.PREFIX_MERGE)
        if strategy not in choices(Strategy):
            raise PageError(
                400,
                "Bad strategy",
                f"unknown strategy {strategy!r}; choose one of {', '.join(choices(Strategy))}",
            )
        return strategy

    def _selection(self, request: web.Request) -> tuple[Selection, dict[str, Any]]:
        side = request.query.get("side") == "1"
        aborted = request.query.get("aborted") == "1"
        return Selection(include_side_calls=side, include_aborted=aborted), {
            "side": side and "1",
            "aborted": aborted and "1",
        }

    async def session(self, request: web.Request) -> web.Response:
        db = self._db()
        sid = request.match_info["id"]
        strategy = self._strategy(request)
        selection, query = self._selection(request)

        def read():
            record = queries.session_record(db, sid)
            if record is None:
                raise PageError(
                    404,
                    "Unknown session",
                    str(queries.no_session(db, sid).args[0]),
                    Html('see <a href="/sessions">the sessions</a>'),
                )
            rows = self._session_rows(db, sid, strategy, selection)
            return record, rows, queries.turn_facts(db, session=sid)

        record, rows, turns = await self._thread(read)
        return _html(pages.session(record, rows, turns, strategy=strategy, query=query))

    async def trajectory(self, request: web.Request) -> web.Response:
        db = self._db()
        ident = request.match_info["id"]
        strategy = self._strategy(request)
        selection, query = self._selection(request)
        if strategy != Strategy.PREFIX_MERGE:
            query["strategy"] = strategy
        asked = request.query.get("page")

        def read():
            session = queries.session_of_turn(db, ident)
            if session is None:
                raise PageError(
                    404,
                    "Unknown trajectory",
                    f"no trajectory, turn or session {ident!r} in {db}",
                    Html('see <a href="/sessions">the sessions</a>'),
                )
            if session == ident:
                raise web.HTTPFound(pages.path("session", session))
            rows = self._session_rows(db, session, strategy, replace(selection, session=None))
            exact = [r for r in rows if r.trajectory_id == ident] or [r for r in rows if ident in r.turn_ids][
                :1
            ]
            if not exact:
                raise PageError(
                    404,
                    "Not in any row",
                    f"{ident!r} is in the store but in no {strategy} row: a side call or a turn that did not finish ok?",
                    Html(
                        f'show it with side calls and aborted turns: <a href="{pages.path("trajectory", ident, strategy=query.get("strategy"), side=1, aborted=1)}">here</a>'
                    ),
                )
            row = exact[0]
            facts = {
                f.id: (f.prompt_len, f.output_len, f.weight_version, f.tag)
                for f in queries.turn_facts(db, ids=row.turn_ids)
            }
            pieces, note = self._tokenizer()
            # Without ?page, the page where training starts (a long prompt fills the first ones).
            number = _int(asked, len(row.prompt_ids) // self.config.page_tokens)
            page = page_of(
                row,
                turn_spans(row, facts),
                number,
                decode=pieces.pieces if pieces else None,
                size=self.config.page_tokens,
            )
            return row, rows, page, note, _break_tokens(row, rows, pieces)

        row, rows, page, note, break_tokens = await self._thread(read)
        return _html(
            token_pages.trajectory(
                row,
                page,
                strategy=strategy,
                related=rows,
                tokenizer_note=note,
                query=query,
                break_tokens=break_tokens,
            )
        )

    async def turn(self, request: web.Request) -> web.Response:
        db = self._db()
        ident = request.match_info["id"]

        def read():
            found = queries.turn_facts(db, ids=[ident])
            if not found:
                if queries.has_session(db, ident):
                    raise web.HTTPFound(pages.path("session", ident))
                raise PageError(
                    404,
                    "Unknown turn",
                    f"no turn {ident!r} in {db}",
                    Html('see <a href="/sessions">the sessions</a>'),
                )
            facts = found[0]
            turn = next(
                (
                    t
                    for t in read_turns(db, session=facts.session_id, with_raw=True, include_text_only=True)
                    if t.id == ident
                ),
                None,
            )
            if turn is None:
                raise PageError(404, "Unknown turn", f"turn {ident!r} could not be read back from {db}")
            pieces, note = self._tokenizer()
            prompt = list(turn.prompt_ids)
            if pieces is not None:
                prompt_text = pieces.tokenizer.decode(prompt)
            else:
                prompt_text = " ".join(map(str, prompt))
            output = None
            if turn.output_ids:
                out = Trajectory(
                    trajectory_id=turn.id, session_id=turn.session_id, task_id=turn.task_id,
                    prompt_ids=np.zeros(0, dtype=np.int32), response_ids=np.asarray(turn.output_ids, dtype=np.int32),
                    loss_mask=np.ones(len(turn.output_ids), dtype=np.int8),
                    response_logprobs=_fit(turn.output_logprobs, len(turn.output_ids)),
                    turn_ids=[turn.id], finish_reason=turn.finish_reason or "",
                )  # fmt: skip
                span = TurnSpan(turn.id, 0, 0, len(turn.output_ids), turn.weight_version, turn.tag)
                output = page_of(
                    out,
                    [span],
                    0,
                    decode=pieces.pieces if pieces else None,
                    size=max(1, len(turn.output_ids)),
                )
            return facts, turn, prompt_text, output, note

        facts, turn, prompt_text, output, note = await self._thread(read)
        try:
            reply = await native_reply(
                facts.style, facts.path, turn.request, turn.response, prompt_tokens=facts.prompt_len
            )
        except Exception as e:  # a reply the style cannot render again: say so, show the record
            reply = (
                f"not re-rendered ({type(e).__name__}: {e}); the completion as recorded",
                turn.response or "",
            )
        return _html(
            token_pages.turn(
                facts,
                request=turn.request,
                response=turn.response,
                reply=reply,
                prompt_text=prompt_text,
                output=output,
                tokenizer_note=note,
            )
        )

    async def rollouts(self, request: web.Request) -> web.Response:
        db = self._db()

        def read():
            by_rollout: dict[str, tuple[list, dict[str, list]]] = {}
            for s in read_samples(db).values():
                _, groups = by_rollout.setdefault(s.rollout_id, ([], {}))
                groups.setdefault(s.group_id, []).append(s)
            for reports, groups in by_rollout.values():
                reports += task_reports(s for members in groups.values() for s in members)
            return by_rollout

        return _html(pages.rollouts(await self._thread(read)))

    async def group(self, request: web.Request) -> web.Response:
        db = self._db()
        gid = request.match_info["id"]

        def read():
            samples = {k: s for k, s in read_samples(db).items() if s.group_id == gid}
            if not samples:
                raise PageError(
                    404,
                    "Unknown group",
                    f"no rollout group {gid!r} in {db}",
                    Html('see <a href="/rollouts">the rollouts</a>'),
                )
            members = list(samples.values())
            reports = task_reports(members)
            return members, group_advantages(samples, Normalize.STD), reports[0] if reports else None

        members, advantage, report = await self._thread(read)
        return _html(pages.group(gid, members, advantage, report))

    async def plots(self, request: web.Request) -> web.Response:
        db = self._db()
        last = _int(request.query.get("sessions"), 50)

        def read():
            import json

            samples = read_samples(db).values()
            rewards: dict[str, list[float]] = {}
            stages: dict[str, list[float]] = {}
            for s in samples:
                if s.status == "retried":
                    continue
                if s.trainable:
                    rewards.setdefault(s.task_id, []).append(s.reward or 0.0)
                for stage, secs in json.loads(s.timings or "{}").items():
                    stages.setdefault(stage, []).append(float(secs))
            listings = queries.list_sessions(db, limit=5000)
            turns = [s.turns for s in listings if s.turns]
            ratios = []
            for s in [x for x in listings if x.turns][:last]:
                stats = ReconstructStats()
                for _ in iter_trajectories(db, selection=Selection(session=s.id), stats=stats):
                    pass
                if stats.trainer_token_ratio is not None:
                    ratios.append(stats.trainer_token_ratio)
            return rewards, turns, ratios, stages

        rewards, turns, ratios, stages = await self._thread(read)
        return _html(pages.plots_page(rewards, turns, ratios, stages, ratio_sessions=last))

    async def live(self, request: web.Request) -> web.Response:
        if self.relay is None:
            return _html(pages.live(None, None, None))
        try:
            snapshot = await self.relay.snapshot()
            error = None
        except Exception as e:
            snapshot, error = None, str(e) or type(e).__name__
        return _html(pages.live(self.relay.server, snapshot, error), 200 if error is None else 502)

    async def live_events(self, request: web.Request) -> web.StreamResponse:
        if self.relay is None:
            raise PageError(404, "Live", "no rollout service to watch: start the viewer with --server URL")
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache"})
        await resp.prepare(request)
        async with self.relay.subscribe() as q:
            with contextlib.suppress(ConnectionResetError, asyncio.CancelledError):
                idle = 0
                # A tab that closed is noticed within a second (aiohttp does not cancel the
                # handler), so its subscription, and with the last one the upstream, end.
                while request.transport is not None and not request.transport.is_closing():
                    try:
                        message = await asyncio.wait_for(q.get(), 1)
                        idle = 0
                    except TimeoutError:
                        idle += 1
                        if idle < 15:
                            continue
                        message, idle = sse.comment("keep-alive"), 0
                    await resp.write(message)
        return resp

    async def static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC:
            raise web.HTTPNotFound()
        body = resources.files("polar_mitm.view").joinpath("static", name).read_bytes()
        return web.Response(body=body, content_type=STATIC[name], headers={"Cache-Control": "max-age=60"})


def _break_tokens(
    row: Trajectory, rows: list[Trajectory], pieces: TokenPieces | None
) -> list[tuple[str, str]]:
    """For each break of the row, the first differing token on each side: this row's, and that of
    the sequence it diverged from (read off the row holding that turn)."""

    def at(r: Trajectory | None, k: int) -> str:
        if r is None:
            return "?"
        seq = np.concatenate([r.prompt_ids, r.response_ids])
        if k >= len(seq):
            return "(ends here)"
        token = int(seq[k])
        return f"{token} {pieces.pieces([token])[0]!r}" if pieces is not None else str(token)

    out = []
    for b in row.meta.get("breaks") or []:
        k = int(b.get("common_prefix") or 0)
        other = next((r for r in rows if b.get("vs_turn") in r.turn_ids), None)
        out.append((at(row, k), at(other, k)))
    return out


def _html(page: Html | str, status: int = 200) -> web.Response:
    return web.Response(text=str(page), status=status, content_type="text/html", charset="utf-8")


def _int(value: str | None, default: int) -> int:
    try:
        return max(0, int(value)) if value is not None else default
    except ValueError:
        return default


def _fit(logprobs: Any, n: int) -> np.ndarray:
    lp = np.asarray(logprobs, dtype=LOGPROB_DTYPE)[:n]
    return np.concatenate([lp, np.zeros(n - len(lp), dtype=LOGPROB_DTYPE)]) if len(lp) < n else lp


def allowed_hosts(host: str) -> set[str]:
    """The Host names to answer: the loopback names (and the listen address) for a loopback
    listen; any for a non-loopback one (its names cannot be known)."""
    if not is_loopback(host):
        return set()
    return {*LOOPBACK_NAMES, host.strip("[]").lower()}
