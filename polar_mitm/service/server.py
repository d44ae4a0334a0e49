"""The rollout server: tasks in over HTTP, samples out to gateway nodes, scored groups back.

State lives in SQLite (`store/service.py`); this module is the HTTP layer and the few loops
around it (node health, callbacks). Scheduling is pull-based: a node asks for work when it has
room (`POST /v1/nodes/{id}/lease` with its free capacity), so the nodes with the least stage
pressure are the ones that take samples, and the server never needs to reach a node. Every
dispatch carries a lease; a result under a stale lease is refused, so a sample is never recorded
twice. A node that misses heartbeats is lost: its unfinished samples are dispatched once more.

Only the operator drives it (`auth.py`): every route but `/health` takes the control token;
a node's credential registers, and the key a registration returns serves that node id alone.
What reaches the host (the `local` runtime, task paths, callbacks) is off unless the operator
turns it on, and a body is bounded before it is read whole (size) and parsed (depth).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from pydantic import BaseModel, ValidationError

from polar_mitm import api as m
from polar_mitm import auth
from polar_mitm.outcomes import TRAINABLE
from polar_mitm.providers import fields
from polar_mitm.reconstruct.groups import advantages
from polar_mitm.retry import Backoff
from polar_mitm.service.metrics import Metrics
from polar_mitm.service.openapi import openapi
from polar_mitm.store.service import NodeRow, SampleRow, ServiceStore, TaskRow, TaskSummary
from polar_mitm.strategies import Normalize, choices
from polar_mitm.tasks import TaskFileError, load_tasks
from polar_mitm.tasks.model import Task

log = logging.getLogger("polar_mitm.service")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Who may call a route: anyone, the operator, a node joining, or the node the path names.
Who = Literal["public", "operator", "register", "node"]
OPERATOR, ENROLL = "operator", "enroll"
PRINCIPAL = web.RequestKey("principal", str)  # who the request's bearer is (set by _auth)
MB = 1024 * 1024
# Bodies larger than this are parsed in a worker thread, so the loop goes on with other requests.
PARSE_INLINE = 256 * 1024
TOKEN_HINT = (
    "a control token is required: Authorization: Bearer TOKEN (serve writes it to"
    f" {auth.default_token_file()} unless given one; clients read it there, or from {auth.TOKEN_ENV})"
)


class CallbackFailed(Exception):
    """One callback POST that did not land (the text is what the task's callback_error shows)."""


class ApiError(Exception):
    def __init__(self, status: int, kind: str, message: str, **extra: Any):
        self.status, self.kind, self.message, self.extra = status, kind, message, extra


def error_body(kind: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"error": {"type": kind, "message": message, **extra}}


def validation_error(e: ValidationError) -> ApiError:
    fields = [
        {"field": ".".join(str(p) for p in err["loc"]) or "(body)", "message": err["msg"]}
        for err in e.errors()
    ]
    summary = "; ".join(f"{f['field']}: {f['message']}" for f in fields)
    return ApiError(422, "invalid_request", summary, fields=fields)


def _too_large(cap: int) -> ApiError:
    return ApiError(
        413, "too_large", f"the body is larger than {cap / MB:g} MB; serve --max-body-mb sets the limit"
    )


async def read_capped(request: web.Request, cap: int) -> bytes:
    """The body, refused as soon as it is known to be larger than `cap`: by its Content-Length
    before a byte is read, or as the streamed bytes pass it."""
    if request.content_length is not None and request.content_length > cap:
        raise _too_large(cap)
    buf = bytearray()
    async for chunk in request.content.iter_any():
        buf += chunk
        if len(buf) > cap:
            raise _too_large(cap)
    return bytes(buf)


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """JSON no deeper than the providers' bound (`providers/fields.py`), then the model."""
    depth = fields.nesting_depth(raw)
    if depth > fields.MAX_DEPTH:
        message = f"request body: JSON nested {depth} levels deep; at most {fields.MAX_DEPTH} are accepted"
        raise ApiError(422, "invalid_request", message, fields=[{"field": "(body)", "message": message}])
    try:
        data = fields.loads(raw)
    except fields.InvalidRequest as e:
        raise ApiError(400, "invalid_json", f"the body is not JSON: {e.message}") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


async def body_of(request: web.Request, model: type[BaseModel], cap: int) -> Any:
    raw = await read_capped(request, cap)
    if len(raw) > PARSE_INLINE:
        return await asyncio.to_thread(parse_body, raw, model)
    return parse_body(raw, model)


def _without_content(e: TaskFileError) -> str:
    """A task file's problems without the values it holds (an error must not quote a file)."""
    problems = [p.splitlines()[0].split(", got ", 1)[0][:200] for p in e.problem.split("; ") if p.strip()]
    return "; ".join(problems)


class Events:
    """Server-sent events to every subscriber; slow subscribers lose the oldest events."""

    def __init__(self) -> None:
        self.queues: set[asyncio.Queue[m.Event]] = set()

    def publish(self, ev: m.Event) -> None:
        ev.at = ev.at or time.time()
        for q in self.queues:
            if q.full():
                q.get_nowait()
            q.put_nowait(ev)

    @contextlib.contextmanager
    def subscribe(self):
        q: asyncio.Queue[m.Event] = asyncio.Queue(maxsize=10_000)
        self.queues.add(q)
        try:
            yield q
        finally:
            self.queues.discard(q)


class RolloutServer:
    def __init__(
        self,
        db: str | Path,
        *,
        token: str | None = None,
        node_timeout: float = 15.0,
        max_dispatches: int = 2,
        callback_attempts: int = 8,
        callback_backoff: float = 1.0,
        allow_local_runtime: bool = False,
        task_root: str | Path | None = None,
        callback_allow: list[str] | tuple[str, ...] = (),
        max_body_mb: float = 4.0,
        max_result_mb: float = 256.0,
    ):
        """`token`: the operator's control token (a random one when None: the server is never
        open; `serve` gives it one from its token file). `allow_local_runtime`, `task_root` and
        `callback_allow` turn on what reaches the host: tasks run unsandboxed, task paths read
        under that directory, callbacks to those hosts."""
        self.store = ServiceStore(db)
        self.token = token or auth.new_token()
        self.node_token = auth.node_token(self.token)
        self.sealer = auth.Sealer(self.token)
        self.allow_local_runtime = allow_local_runtime
        self.task_root = Path(task_root).resolve() if task_root else None
        self.callback_allow = {h.lower() for h in callback_allow}
        self.max_body = int(max_body_mb * MB)
        self.max_result = int(max(max_result_mb, max_body_mb) * MB)
        self.node_timeout = node_timeout
        self.max_dispatches = max_dispatches
        self.callback_attempts = callback_attempts
        self.callback_backoff = callback_backoff
        self.events = Events()
        self.metrics = Metrics(self)
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.host = "127.0.0.1"
        self._loops: list[asyncio.Task] = []
        self._callbacks: dict[str, asyncio.Task] = {}
        self._http: aiohttp.ClientSession | None = None
        self.heartbeats: dict[str, m.Heartbeat] = {}  # the last load each node reported
        self.heartbeat_at: dict[str, float] = {}

    # -- life -----------------------------------------------------------------------------------

    def routes(self) -> list[tuple[str, str, Handler, type[BaseModel] | None, Any, str, Who]]:
        """(method, path, handler, request model, response model, summary, who may call it): the
        API, once."""
        return [
            ("POST", "/v1/tasks", self.submit, m.TaskRequest, m.Submitted, "Submit a task to roll out", "operator"),
            ("GET", "/v1/tasks", self.list_tasks, None, list[m.TaskView], "Every task", "operator"),
            ("GET", "/v1/tasks/{task_id}", self.get_task, None, m.TaskView, "A task: state, samples, rewards", "operator"),
            ("GET", "/v1/tasks/{task_id}/results", self.results, None, None, "The group's rows (json | parquet)", "operator"),
            ("DELETE", "/v1/tasks/{task_id}", self.cancel_task, None, m.TaskView, "Cancel a task", "operator"),
            ("GET", "/v1/events", self.event_stream, None, m.Event, "Server-sent events of state changes", "operator"),
            ("POST", "/v1/nodes/register", self.register, m.NodeRegistration, m.Registered, "A node joins", "register"),
            ("POST", "/v1/nodes/{node_id}/heartbeat", self.heartbeat, m.Heartbeat, m.Control, "A node's load", "node"),
            ("POST", "/v1/nodes/{node_id}/lease", self.lease, m.LeaseRequest, m.LeaseReply, "Samples for a node", "node"),
            ("POST", "/v1/nodes/{node_id}/results", self.result, m.SampleResult, None, "A finished sample", "node"),
            ("GET", "/v1/nodes", self.list_nodes, None, list[m.NodeView], "The nodes and their load", "operator"),
            ("DELETE", "/v1/nodes/{node_id}", self.drain_node, None, m.NodeView, "Drain a node", "operator"),
            ("POST", "/v1/admin/pause", self.pause, m.PauseRequest, m.PauseReply, "Pause generation", "operator"),
            ("POST", "/v1/admin/resume", self.resume, m.ResumeRequest, m.Control, "Resume generation", "operator"),
            ("GET", "/health", self.health, None, None, "Liveness", "public"),
            ("GET", "/metrics", self.metrics_text, None, None, "Prometheus metrics", "operator"),
            ("GET", "/openapi.json", self.openapi_json, None, None, "This API's OpenAPI schema", "operator"),
        ]  # fmt: skip

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors, self._auth], client_max_size=self.max_result)
        self._who: dict[tuple[str, str], Who] = {}
        for method, path, handler, *_, who in self.routes():
            app.router.add_route(method, path, handler)
            self._who[(method, path)] = who
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self.host = host
        self.runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        self._loops = [
            asyncio.create_task(self._watch_nodes()),
            asyncio.create_task(self._resume_callbacks()),
        ]
        return self.port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        for t in [*self._loops, *self._callbacks.values()]:
            t.cancel()
        await asyncio.gather(*self._loops, *self._callbacks.values(), return_exceptions=True)
        if self._http is not None:
            await self._http.close()
        if self.runner is not None:
            await self.runner.cleanup()
        self.store.close()

    # -- middlewares ----------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as e:
            resp = web.json_response(error_body(e.kind, e.message, **e.extra), status=e.status)
            if e.status == 413:  # the rest of the body is not read: this connection is done
                resp.force_close()
            return resp
        except web.HTTPException:
            raise
        except Exception as e:  # last resort: a JSON error, one log line
            log.exception("%s %s failed", request.method, request.path)
            return web.json_response(error_body("internal_error", f"{e.__class__.__name__}: {e}"), status=500)

    def _principal(self, request: web.Request) -> str | None:
        """Who the bearer is: the operator, a node joining (the node credential), `node:ID`
        (a registered node's key), or None."""
        given = request.headers.get("authorization", "")
        if not given.startswith("Bearer "):
            return None
        token = given[7:].strip()
        if auth.same(token, self.token):
            return OPERATOR
        if auth.same(token, self.node_token):
            return ENROLL
        node = self.store.node_for_key(auth.digest(token)) if token else None
        return f"node:{node}" if node else None

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        who = self._who.get((request.method, resource.canonical if resource else ""), "operator")
        if who == "public":
            return await handler(request)
        principal = self._principal(request)
        if principal is None:
            raise ApiError(401, "unauthorized", TOKEN_HINT)
        node_id = request.match_info.get("node_id")
        if node_id is not None and not m.TASK_ID.fullmatch(node_id):
            raise ApiError(422, "invalid_request", f"node_id: {node_id[:80]!r} is not a node id",
                           fields=[{"field": "node_id", "message": "not a node id"}])  # fmt: skip
        allowed = (
            principal == OPERATOR
            or (who == "register" and (principal == ENROLL or principal.startswith("node:")))
            or (who == "node" and principal == f"node:{node_id}")
        )
        if not allowed:
            if principal == ENROLL:
                said = "the node credential only registers a node; its heartbeats, leases and results take the key registration returned"
            else:
                mine = principal.removeprefix("node:")
                said = f"node {mine}'s key only heartbeats, leases and reports for node {mine}"
            raise ApiError(
                403, "forbidden", f"{said}: {request.method} {request.path} needs the control token"
            )
        request[PRINCIPAL] = principal
        return await handler(request)

    # -- tasks ----------------------------------------------------------------------------------

    def _forbid(self, field: str, message: str) -> ApiError:
        return ApiError(
            403, "forbidden", f"{field}: {message}", fields=[{"field": field, "message": message}]
        )

    def _under_root(self, path: str | Path) -> bool:
        assert self.task_root is not None
        return Path(path).resolve().is_relative_to(self.task_root)

    def _check_host_paths(self, task: Task, field: str) -> None:
        """A task's host paths (its Dockerfile, its tests) lie under --task-root, when there is one."""
        if self.task_root is None:
            return
        for name, path in (
            ("dockerfile", task.dockerfile),
            ("evaluator.tests_dir", task.evaluator.tests_dir),
        ):
            if path is not None and not self._under_root(path):
                raise self._forbid(f"{field}.{name}", f"{path} is outside --task-root {self.task_root}")

    def _allowed(self, req: m.TaskRequest) -> None:
        """What reaches the host is off unless the operator turned it on: a 403 naming the flag."""
        if req.runtime == "local" and not self.allow_local_runtime:
            raise self._forbid(
                "runtime",
                "'local' runs the harness (and any harness_cmd) on a node's host, outside a sandbox; "
                "the server allows it only with --allow-local-runtime",
            )
        if req.task_path is not None:
            if self.task_root is None:
                raise self._forbid(
                    "task_path",
                    "the server reads no host path unless started with --task-root DIR; "
                    "send the task inline (polar-mitm submit does)",
                )
            if not self._under_root(req.task_path):
                raise self._forbid("task_path", f"{req.task_path} is outside --task-root {self.task_root}")
        if req.callback_url is not None:
            host = (urlsplit(req.callback_url).hostname or "").lower()
            if not self.callback_allow:
                raise self._forbid(
                    "callback_url", "the server posts to no address unless started with --callback-allow HOST"
                )
            if host not in self.callback_allow:
                raise self._forbid(
                    "callback_url",
                    f"host {host!r} is not among --callback-allow ({', '.join(sorted(self.callback_allow))})",
                )
        if req.task is not None:
            self._check_host_paths(req.task, "task")

    def _resolve(self, req: m.TaskRequest) -> Task:
        self._allowed(req)
        if req.task is not None:
            task = req.task
        else:
            path = Path(req.task_path).resolve()  # type: ignore[arg-type]
            try:
                found = load_tasks([path])
            except TaskFileError as e:
                where = Path(e.path).resolve()
                shown = (
                    where.relative_to(self.task_root)
                    if self.task_root and where.is_relative_to(self.task_root)
                    else where.name
                )
                message = f"{shown}{f' line {e.line}' if e.line else ''}: {_without_content(e)}"
                raise ApiError(
                    422,
                    "invalid_request",
                    f"task_path: {message}",
                    fields=[{"field": "task_path", "message": message}],
                ) from None
            except Exception as e:  # what a loader did not expect: named, never quoted
                raise ApiError(
                    422,
                    "invalid_request",
                    f"task_path: {req.task_path} cannot be loaded as a task ({e.__class__.__name__})",
                ) from None
            for t in found:
                self._check_host_paths(t, "task_path")
            if len(found) > 1 and not req.task_id:
                raise ApiError(
                    422,
                    "invalid_request",
                    f"task_path: {req.task_path} holds {len(found)} tasks; name one with task_id",
                )
            task = found[0] if len(found) == 1 else next((t for t in found if t.id == req.task_id), None)  # type: ignore[assignment]
            if task is None:
                raise ApiError(422, "invalid_request", f"task_id: no task {req.task_id!r} in {req.task_path}")
        if req.evaluator is not None:
            task = task.model_copy(update={"evaluator": req.evaluator})
            self._check_host_paths(task, "evaluator")
        if req.runtime == "local" and task.evaluator.kind in ("harbor", "swebench"):
            raise ApiError(
                422,
                "invalid_request",
                f"runtime: the {task.evaluator.kind} evaluator needs a container runtime",
            )
        return task

    def _sealed(self, task: Task) -> Task:
        """The task as the store keeps it: its env values (and its evaluator's) sealed."""
        ev = task.evaluator.model_copy(update={"env": self.sealer.seal(task.evaluator.env)})
        return task.model_copy(update={"env": self.sealer.seal(task.env), "evaluator": ev})

    def _unsealed(self, task: Task) -> Task:
        ev = task.evaluator.model_copy(update={"env": self.sealer.unseal(task.evaluator.env)})
        return task.model_copy(update={"env": self.sealer.unseal(task.env), "evaluator": ev})

    async def submit(self, request: web.Request) -> web.Response:
        req: m.TaskRequest = await body_of(request, m.TaskRequest, self.max_body)
        task = self._resolve(req)
        task_id = req.task_id or task.id
        if not m.TASK_ID.fullmatch(task_id):
            raise ApiError(
                422, "invalid_request", f"task_id: {task_id[:80]!r} cannot name a task in a URL; pass task_id"
            )
        stored = req.model_copy(
            update={
                "task": self._sealed(req.task) if req.task is not None else None,
                "evaluator": req.evaluator.model_copy(update={"env": self.sealer.seal(req.evaluator.env)})
                if req.evaluator is not None
                else None,
            }
        )
        ok = self.store.add_task(
            task_id,
            stored.model_dump_json(),
            self._sealed(task).model_dump_json(),
            req.priority,
            req.num_samples,
            bool(req.callback_url),
        )
        if not ok:
            raise ApiError(409, "conflict", f"a task with id {task_id!r} exists; submit with another task_id")
        self.events.publish(m.Event(kind="task", task_id=task_id, state="queued"))
        self.metrics.submitted.inc()
        return web.json_response(
            m.Submitted(task_id=task_id, num_samples=req.num_samples).model_dump(mode="json"), status=202
        )

    def _task(self, task_id: str) -> TaskRow:
        row = self.store.task(task_id)
        if row is None:
            raise ApiError(404, "not_found", f"no task {task_id[:80]!r}")
        return row

    def view(self, row: TaskSummary, samples: list[SampleRow] | None = None) -> m.TaskView:
        """A task's view from its summary columns and its samples without their rows: nothing
        stored is parsed but the samples' small JSON columns."""
        if samples is None:
            samples = self.store.samples(row.id, rows=False)
        views = [
            m.SampleView(
                index=s.idx,
                state=s.state,  # type: ignore[arg-type]
                stage=s.stage,
                status=s.status,
                cause=s.cause,
                node_id=s.node_id,
                dispatches=s.dispatches,
                reward=s.reward,
                timings=json.loads(s.timings or "{}"),
                weight_versions=json.loads(s.weight_versions or "[]"),
                session_id=s.session_id,
            )
            for s in samples
        ]
        return m.TaskView(
            task_id=row.id,
            state=row.state,  # type: ignore[arg-type]
            num_samples=row.num_samples,
            priority=row.priority,
            harness=row.harness,
            runtime=row.runtime,
            created_at=row.created_at,
            updated_at=row.updated_at,
            samples=views,
            callback=row.callback_state,
        )

    def _summary(self, task_id: str) -> TaskSummary:
        found = self.store.summaries(task_id)
        if not found:
            raise ApiError(404, "not_found", f"no task {task_id[:80]!r}")
        return found[0]

    async def get_task(self, request: web.Request) -> web.Response:
        return web.json_response(
            self.view(self._summary(request.match_info["task_id"])).model_dump(mode="json")
        )

    async def list_tasks(self, request: web.Request) -> web.Response:
        samples = self.store.all_samples()
        return web.json_response(
            [self.view(r, samples.get(r.id, [])).model_dump(mode="json") for r in self.store.summaries()]
        )

    def rows(self, task_id: str, normalize: str | None = Normalize.STD) -> list[dict[str, Any]]:
        """The group's rows, with the GRPO advantage over its usable samples."""
        samples = [s for s in self.store.samples(task_id) if s.state == "finished"]
        rewards = {s.idx: s.reward or 0.0 for s in samples if s.status in TRAINABLE}
        adv = advantages(rewards, normalize) if normalize else {}  # type: ignore[arg-type]
        out = []
        for s in samples:
            for row in json.loads(s.rows or "[]"):
                row["group_id"] = task_id
                row["sample_index"] = s.idx
                row["advantage"] = adv.get(s.idx, 0.0) if normalize else None
                out.append(row)
        return out

    async def results(self, request: web.Request) -> web.StreamResponse:
        row = self._task(request.match_info["task_id"])
        fmt = request.query.get("format", "json")
        normalize = request.query.get("normalize", Normalize.STD)
        if normalize not in (*choices(Normalize), "none"):
            raise ApiError(
                422,
                "invalid_request",
                f"normalize: {normalize!r} is not one of {', '.join(choices(Normalize))}, none",
            )
        rows = self.rows(row.id, None if normalize == "none" else normalize)
        if fmt == "json":
            return web.json_response({"task_id": row.id, "state": row.state, "rows": rows})
        if fmt == "parquet":
            return web.Response(body=parquet_bytes(rows), content_type="application/vnd.apache.parquet")
        raise ApiError(422, "invalid_request", f"format: {fmt!r} is not one of json, parquet")

    async def cancel_task(self, request: web.Request) -> web.Response:
        row = self._task(request.match_info["task_id"])
        if row.state not in ("done", "cancelled"):
            self.store.cancel_samples(row.id, "cancelled by request")
            self.store.set_task_state(row.id, "cancelled")
            self.events.publish(m.Event(kind="task", task_id=row.id, state="cancelled"))
            self._maybe_complete(row.id)
        return web.json_response(self.view(self._summary(row.id)).model_dump(mode="json"))

    async def event_stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache"})
        await resp.prepare(request)
        with self.events.subscribe() as q:
            try:
                while True:
                    try:
                        ev = await asyncio.wait_for(q.get(), 15)
                    except TimeoutError:
                        await resp.write(b": keep-alive\n\n")
                        continue
                    await resp.write(f"event: {ev.kind}\ndata: {ev.model_dump_json()}\n\n".encode())
            except (ConnectionResetError, asyncio.CancelledError):
                pass
        return resp

    # -- nodes ----------------------------------------------------------------------------------

    def control(self, node_id: str) -> m.Control:
        node = self.store.node(node_id)
        return m.Control(
            paused=self.store.get("paused") == "1",
            weight_version=self.store.get("weight_version"),
            cancel=self.store.cancelling_for(node_id),
            draining=node is not None and node.state == "draining",
        )

    def _node(self, node_id: str):
        node = self.store.node(node_id)
        if node is None:
            raise ApiError(404, "not_found", f"no node {node_id!r}; register first")
        return node

    def _live(self, node: NodeRow) -> bool:
        return node.state != "lost" and time.time() - node.last_seen < self.node_timeout

    async def register(self, request: web.Request) -> web.Response:
        reg: m.NodeRegistration = await body_of(request, m.NodeRegistration, self.max_body)
        principal = request[PRINCIPAL]
        if principal.startswith("node:") and principal != f"node:{reg.node_id}":
            raise ApiError(
                403, "forbidden", f"node {principal[5:]}'s key registers node {principal[5:]} only"
            )
        held = self.store.node(reg.node_id)
        if held is not None and self._live(held) and principal != f"node:{reg.node_id}":
            wait = self.node_timeout - (time.time() - held.last_seen)
            raise ApiError(
                409,
                "conflict",
                f"node id {reg.node_id!r} is held by a live node; choose another --node-id, or wait"
                f" {max(wait, 0):.0f} s until it is lost",
            )
        key = auth.new_token()
        self.store.register_node(reg.node_id, reg.url, reg.workers)
        self.store.set_node_key(reg.node_id, auth.digest(key))
        self.events.publish(m.Event(kind="node", state="active", data={"node_id": reg.node_id}))
        log.info("node %s registered (%s)", reg.node_id, reg.url or "no url")
        reply = m.Registered(**self.control(reg.node_id).model_dump(), node_key=key)
        return web.json_response(reply.model_dump(mode="json"))

    async def heartbeat(self, request: web.Request) -> web.Response:
        node_id = request.match_info["node_id"]
        hb: m.Heartbeat = await body_of(request, m.Heartbeat, self.max_body)
        node = self._node(node_id)
        if node.state == "lost":  # it came back: accept it again; its old leases are gone
            self.store.set_node_state(node_id, "active")
        self.store.heartbeat(node_id, hb.model_dump_json())
        self.heartbeats[node_id] = hb
        self.heartbeat_at[node_id] = time.time()
        self.store.set_stages(node_id, hb.samples)
        lost = self.store.requeue_unheld(
            node_id,
            {(t, i) for t, i, _ in hb.samples},
            grace=self.node_timeout,
            max_dispatches=self.max_dispatches,
        )
        if lost:
            log.warning("%d samples leased to %s never reached it: queued again", lost, node_id)
        return web.json_response(self.control(node_id).model_dump(mode="json"))

    async def lease(self, request: web.Request) -> web.Response:
        node_id = request.match_info["node_id"]
        body: m.LeaseRequest = await body_of(request, m.LeaseRequest, self.max_body)
        node = self._node(node_id)
        self.store.heartbeat(node_id, node.stats)
        if node.state != "active":
            return web.json_response(m.LeaseReply(control=self.control(node_id)).model_dump(mode="json"))
        out = []
        parsed: dict[str, tuple[TaskRow, m.TaskRequest, Task] | str] = {}  # each task read once per lease
        for s, lease in self.store.lease(node_id, body.capacity):
            if s.task_id not in parsed:
                row = self._task(s.task_id)
                try:
                    parsed[s.task_id] = (
                        row,
                        m.TaskRequest.model_validate_json(row.request),
                        self._unsealed(Task.model_validate_json(row.task)),
                    )
                except auth.UnsealError as e:
                    parsed[s.task_id] = str(e)
            got = parsed[s.task_id]
            if isinstance(got, str):  # its secrets cannot be read back: failed, said why
                self.store.finish_sample(
                    s.task_id, s.idx, lease, status="failed", cause=got, reward=0.0, node_id=node_id
                )
                self._maybe_complete(s.task_id)
                continue
            row, req, task = got
            out.append(
                m.Assignment(
                    task_id=s.task_id,
                    index=s.idx,
                    lease=lease,
                    task=task,
                    harness=req.harness,
                    harness_cmd=req.harness_cmd,
                    runtime=req.runtime,
                    builder=req.builder,
                    num_samples=row.num_samples,
                    agent_timeout_seconds=req.agent_timeout_seconds,
                    timeout_seconds=req.timeout_seconds,
                )
            )
            self.events.publish(
                m.Event(
                    kind="sample",
                    task_id=s.task_id,
                    index=s.idx,
                    state="dispatched",
                    data={"node_id": node_id},
                )
            )
            self.events.publish(m.Event(kind="task", task_id=s.task_id, state="running"))
        return web.json_response(
            m.LeaseReply(assignments=out, control=self.control(node_id)).model_dump(mode="json")
        )

    async def result(self, request: web.Request) -> web.Response:
        node_id = request.match_info["node_id"]
        res: m.SampleResult = await body_of(request, m.SampleResult, self.max_result)
        row = self._task(res.task_id)
        req = m.TaskRequest.model_validate_json(row.request)
        rows, versions, detail = stale_check(res, req)
        status = res.status  # a sample that finished before a cancel reached it keeps its work
        if status == "cancelled" and self.store.requeue_sample(
            res.task_id, res.index, res.lease, self.max_dispatches, node_id
        ):
            # Cancelled by its node (shutting down), not by us: it runs again elsewhere.
            self.events.publish(m.Event(kind="sample", task_id=res.task_id, index=res.index, state="queued"))
            return web.json_response({"accepted": True, "requeued": True})
        ok = self.store.finish_sample(
            res.task_id,
            res.index,
            res.lease,
            status=status,
            cause=res.cause,
            reward=res.reward if status in TRAINABLE else (0.0 if status == "failed" else None),
            detail=detail,
            timings=res.timings,
            weight_versions=versions,
            session_id=res.session_id,
            rows=rows,
            node_id=node_id,
        )
        if not ok:
            raise ApiError(
                409,
                "stale_lease",
                f"sample {res.task_id}#{res.index} is not leased to {node_id} under this lease",
            )
        self.metrics.finished(status, res.timings)
        self.events.publish(
            m.Event(
                kind="sample",
                task_id=res.task_id,
                index=res.index,
                state="finished",
                data={"status": status, "reward": res.reward},
            )
        )
        self._maybe_complete(res.task_id)
        return web.json_response({"accepted": True})

    def _maybe_complete(self, task_id: str) -> None:
        row = self.store.task(task_id)
        if row is None:
            return
        req = m.TaskRequest.model_validate_json(row.request)
        samples = self.store.samples(task_id)
        usable = sum(1 for s in samples if s.state == "finished" and s.status in TRAINABLE)
        if (
            req.early_stop_min_usable
            and usable >= req.early_stop_min_usable
            and any(s.state in ("queued", "dispatched") for s in samples)
        ):
            self.store.cancel_samples(task_id, f"early stop: {usable} usable samples in")
            samples = self.store.samples(task_id)
        if all(s.state == "finished" for s in samples) and row.state not in ("done",):
            if row.state != "cancelled":
                self.store.set_task_state(task_id, "done")
            self.events.publish(
                m.Event(
                    kind="task",
                    task_id=task_id,
                    state="done" if row.state != "cancelled" else "cancelled",
                    data={"usable": usable},
                )
            )
            if req.callback_url:
                self._start_callback(task_id)

    async def list_nodes(self, request: web.Request) -> web.Response:
        return web.json_response([self.node_view(n).model_dump(mode="json") for n in self.store.nodes()])

    def node_view(self, n) -> m.NodeView:
        return m.NodeView(
            node_id=n.id,
            url=n.url,
            state=n.state,
            workers=json.loads(n.workers),
            last_seen=n.last_seen,
            healthy=n.state != "lost" and time.time() - n.last_seen < self.node_timeout,
            load=self.heartbeats.get(n.id),
            dispatched=self.store.dispatched_count(n.id),
        )

    async def drain_node(self, request: web.Request) -> web.Response:
        node = self._node(request.match_info["node_id"])
        self.store.set_node_state(node.id, "draining")
        self.events.publish(m.Event(kind="node", state="draining", data={"node_id": node.id}))
        return web.json_response(self.node_view(self._node(node.id)).model_dump(mode="json"))

    def lose_node(self, node_id: str) -> None:
        """The node is gone: its samples go back to the queue once, its id is free again."""
        self.store.set_node_state(node_id, "lost")
        requeued, failed = self.store.requeue_node(node_id, self.max_dispatches)
        log.warning("node %s lost: %d samples queued again, %d failed", node_id, requeued, failed)
        self.events.publish(
            m.Event(
                kind="node", state="lost", data={"node_id": node_id, "requeued": requeued, "failed": failed}
            )
        )
        for t in {r.id for r in self.store.tasks(("running",))}:
            self._maybe_complete(t)

    async def _watch_nodes(self) -> None:
        """Nodes that stopped sending heartbeats are lost; their samples go back to the queue once."""
        while True:
            await asyncio.sleep(min(1.0, self.node_timeout / 3))
            now = time.time()
            for n in self.store.nodes():
                if n.state != "lost" and now - n.last_seen > self.node_timeout:
                    self.lose_node(n.id)

    # -- weight sync ----------------------------------------------------------------------------

    def healthy_nodes(self) -> list[str]:
        now = time.time()
        return [
            n.id for n in self.store.nodes() if n.state != "lost" and now - n.last_seen < self.node_timeout
        ]

    async def pause(self, request: web.Request) -> web.Response:
        body: m.PauseRequest = await body_of(request, m.PauseRequest, self.max_body)
        self.store.put("paused", "1")
        self.events.publish(m.Event(kind="weights", state="paused"))
        since = time.time()
        deadline = since + body.timeout_seconds
        nodes = self.healthy_nodes()
        while True:
            # Drained when every node has reported, since the pause, a closed gate and nothing under way.
            fresh = [self.heartbeats[n] for n in nodes if self.heartbeat_at.get(n, 0.0) >= since]
            generating = sum(self.heartbeats[n].generating for n in nodes if n in self.heartbeats)
            drained = len(fresh) == len(nodes) and all(hb.paused and hb.generating == 0 for hb in fresh)
            if drained or time.time() >= deadline:
                break
            await asyncio.sleep(0.1)
        return web.json_response(
            m.PauseReply(paused=True, drained=drained, generating=generating, nodes=len(nodes)).model_dump(
                mode="json"
            )
        )

    async def resume(self, request: web.Request) -> web.Response:
        body: m.ResumeRequest = await body_of(request, m.ResumeRequest, self.max_body)
        if body.weight_version is not None:
            self.store.put("weight_version", body.weight_version)
        self.store.put("paused", None)
        self.events.publish(
            m.Event(kind="weights", state="resumed", data={"weight_version": body.weight_version})
        )
        return web.json_response(
            m.Control(paused=False, weight_version=self.store.get("weight_version")).model_dump(mode="json")
        )

    # -- callbacks ------------------------------------------------------------------------------

    def _start_callback(self, task_id: str) -> None:
        if task_id not in self._callbacks or self._callbacks[task_id].done():
            self._callbacks[task_id] = asyncio.create_task(self._deliver(task_id))

    async def _resume_callbacks(self) -> None:
        """After a restart: deliver what was due and not yet delivered."""
        for row in self.store.pending_callbacks():
            self._start_callback(row.id)

    async def _deliver(self, task_id: str) -> None:
        row = self._task(task_id)
        req = m.TaskRequest.model_validate_json(row.request)
        assert req.callback_url and self._http is not None
        payload = {
            "task": self.view(self._summary(task_id)).model_dump(mode="json"),
            "rows": self.rows(task_id),
        }
        http, url = self._http, req.callback_url

        async def post() -> None:
            try:
                # No redirects: only the allowed host is ever posted to.
                async with http.post(url, json=payload, allow_redirects=False) as r:
                    if r.status >= 300:
                        raise CallbackFailed(f"HTTP {r.status}")
            except (aiohttp.ClientError, TimeoutError, OSError) as e:
                raise CallbackFailed(f"{e.__class__.__name__}: {e}") from e

        try:
            await Backoff(
                f"callback for {task_id}",
                attempts=self.callback_attempts,
                first=self.callback_backoff,
                retry_on=(CallbackFailed,),
                on_retry=lambda _, e: self.store.set_callback(task_id, "pending", str(e)),
                log=log,
            ).call_async(post)
        except CallbackFailed as e:
            self.store.set_callback(task_id, "failed", str(e))
        else:
            self.store.set_callback(task_id, "delivered")

    # -- plain endpoints ------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "nodes": len(self.healthy_nodes())})

    async def metrics_text(self, request: web.Request) -> web.Response:
        body, ctype = self.metrics.render()
        return web.Response(body=body, headers={"content-type": ctype})

    async def openapi_json(self, request: web.Request) -> web.Response:
        return web.json_response(openapi(self.routes()))


def stale_check(
    res: m.SampleResult, req: m.TaskRequest
) -> tuple[list[dict[str, Any]], list[str], dict[str, Any] | None]:
    """The weight versions a sample's turns span; with max_staleness, flag or mask the rows of a
    sample that spans more version changes than allowed."""
    versions: list[str] = []
    for row in res.rows:
        for v in json.loads(row.get("metadata") or "{}").get("weight_versions") or []:
            if v is not None and str(v) not in versions:
                versions.append(str(v))
    detail = dict(res.detail or {})
    rows = res.rows
    if req.max_staleness is not None and len(versions) - 1 > req.max_staleness:
        detail["stale"] = {
            "versions": versions,
            "max_staleness": req.max_staleness,
            "action": req.stale_action,
        }
        for row in rows:
            meta = json.loads(row.get("metadata") or "{}")
            meta["stale"] = versions
            if req.stale_action == "mask":
                row["loss_mask"] = [0] * len(row.get("loss_mask") or [])
                meta["masked"] = f"stale: spans weight versions {versions}"
            row["metadata"] = json.dumps(meta, sort_keys=True, separators=(",", ":"))
    return rows, versions, detail or None


def parquet_bytes(rows: list[dict[str, Any]]) -> bytes:
    import pyarrow.parquet as pq

    from polar_mitm.reconstruct.trajectory import Trajectory, to_table

    buf = io.BytesIO()
    pq.write_table(to_table([Trajectory.from_row(r) for r in rows]), buf, compression="zstd")
    return buf.getvalue()
