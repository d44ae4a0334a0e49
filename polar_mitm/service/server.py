"""The rollout server: tasks in over HTTP, samples out to gateway nodes, scored groups back.

State lives in SQLite (`store/service.py`); this module is the HTTP layer and the few loops
around it (node health, callbacks). Scheduling is pull-based: a node asks for work when it has
room (`POST /v1/nodes/{id}/lease` with its free capacity), so the nodes with the least stage
pressure are the ones that take samples, and the server never needs to reach a node. Every
dispatch carries a lease; a result under a stale lease is refused, so a sample is never recorded
twice. A node that misses heartbeats is lost: its unfinished samples are dispatched once more.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import io
import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from pydantic import BaseModel, ValidationError

from polar_mitm.outcomes import TRAINABLE
from polar_mitm.reconstruct.groups import advantages
from polar_mitm.service import models as m
from polar_mitm.service.metrics import Metrics
from polar_mitm.service.openapi import openapi
from polar_mitm.store.service import ServiceStore, TaskRow
from polar_mitm.tasks import TaskFileError, load_tasks
from polar_mitm.tasks.model import Task

log = logging.getLogger("polar_mitm.service")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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


async def body_of(request: web.Request, model: type[BaseModel]) -> Any:
    try:
        data = await request.json()
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, "invalid_json", f"the body is not JSON: {e}") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


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
    ):
        self.store = ServiceStore(db)
        self.token = token
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

    def routes(self) -> list[tuple[str, str, Handler, type[BaseModel] | None, Any, str]]:
        """(method, path, handler, request model, response model, summary): the API, once."""
        return [
            ("POST", "/v1/tasks", self.submit, m.TaskRequest, m.Submitted, "Submit a task to roll out"),
            ("GET", "/v1/tasks", self.list_tasks, None, list[m.TaskView], "Every task"),
            (
                "GET",
                "/v1/tasks/{task_id}",
                self.get_task,
                None,
                m.TaskView,
                "A task: state, samples, rewards",
            ),
            (
                "GET",
                "/v1/tasks/{task_id}/results",
                self.results,
                None,
                None,
                "The group's rows (json | parquet)",
            ),
            ("DELETE", "/v1/tasks/{task_id}", self.cancel_task, None, m.TaskView, "Cancel a task"),
            ("GET", "/v1/events", self.event_stream, None, m.Event, "Server-sent events of state changes"),
            ("POST", "/v1/nodes/register", self.register, m.NodeRegistration, m.Control, "A node joins"),
            (
                "POST",
                "/v1/nodes/{node_id}/heartbeat",
                self.heartbeat,
                m.Heartbeat,
                m.Control,
                "A node's load",
            ),
            (
                "POST",
                "/v1/nodes/{node_id}/lease",
                self.lease,
                m.LeaseRequest,
                m.LeaseReply,
                "Samples for a node",
            ),
            ("POST", "/v1/nodes/{node_id}/results", self.result, m.SampleResult, None, "A finished sample"),
            ("GET", "/v1/nodes", self.list_nodes, None, list[m.NodeView], "The nodes and their load"),
            ("DELETE", "/v1/nodes/{node_id}", self.drain_node, None, m.NodeView, "Drain a node"),
            ("POST", "/v1/admin/pause", self.pause, m.PauseRequest, m.PauseReply, "Pause generation"),
            ("POST", "/v1/admin/resume", self.resume, m.ResumeRequest, m.Control, "Resume generation"),
            ("GET", "/health", self.health, None, None, "Liveness"),
            ("GET", "/metrics", self.metrics_text, None, None, "Prometheus metrics"),
            ("GET", "/openapi.json", self.openapi_json, None, None, "This API's OpenAPI schema"),
        ]

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors, self._auth], client_max_size=512 * 1024 * 1024)
        for method, path, handler, *_ in self.routes():
            app.router.add_route(method, path, handler)
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
            return web.json_response(error_body(e.kind, e.message, **e.extra), status=e.status)
        except web.HTTPException:
            raise
        except Exception as e:  # last resort: a JSON error, one log line
            log.exception("%s %s failed", request.method, request.path)
            return web.json_response(error_body("internal_error", f"{e.__class__.__name__}: {e}"), status=500)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.token and request.path != "/health":
            given = request.headers.get("authorization", "")
            if not (given.startswith("Bearer ") and hmac.compare_digest(given[7:].strip(), self.token)):
                raise ApiError(
                    401, "unauthorized", "a control token is required: Authorization: Bearer TOKEN"
                )
        return await handler(request)

    # -- tasks ----------------------------------------------------------------------------------

    def _resolve(self, req: m.TaskRequest) -> Task:
        if req.task is not None:
            task = req.task
        else:
            try:
                found = load_tasks([req.task_path])  # type: ignore[list-item]
            except TaskFileError as e:
                raise ApiError(
                    422,
                    "invalid_request",
                    f"task_path: {e}",
                    fields=[{"field": "task_path", "message": str(e)}],
                ) from None
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
        if req.runtime == "local" and task.evaluator.kind in ("harbor", "swebench"):
            raise ApiError(
                422,
                "invalid_request",
                f"runtime: the {task.evaluator.kind} evaluator needs a container runtime",
            )
        return task

    async def submit(self, request: web.Request) -> web.Response:
        req: m.TaskRequest = await body_of(request, m.TaskRequest)
        task = self._resolve(req)
        task_id = req.task_id or task.id
        if not m.TASK_ID.fullmatch(task_id):
            raise ApiError(
                422, "invalid_request", f"task_id: {task_id!r} cannot name a task in a URL; pass task_id"
            )
        ok = self.store.add_task(
            task_id,
            req.model_dump_json(),
            task.model_dump_json(),
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
            raise ApiError(404, "not_found", f"no task {task_id!r}")
        return row

    def view(self, row: TaskRow) -> m.TaskView:
        req = m.TaskRequest.model_validate_json(row.request)
        samples = [
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
            for s in self.store.samples(row.id)
        ]
        return m.TaskView(
            task_id=row.id,
            state=row.state,  # type: ignore[arg-type]
            num_samples=row.num_samples,
            priority=row.priority,
            harness=req.harness,
            runtime=req.runtime,
            created_at=row.created_at,
            updated_at=row.updated_at,
            samples=samples,
            callback=row.callback_state,
        )

    async def get_task(self, request: web.Request) -> web.Response:
        return web.json_response(self.view(self._task(request.match_info["task_id"])).model_dump(mode="json"))

    async def list_tasks(self, request: web.Request) -> web.Response:
        return web.json_response([self.view(r).model_dump(mode="json") for r in self.store.tasks()])

    def rows(self, task_id: str, normalize: str | None = "std") -> list[dict[str, Any]]:
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
        normalize = request.query.get("normalize", "std")
        if normalize not in ("std", "loo", "none"):
            raise ApiError(422, "invalid_request", f"normalize: {normalize!r} is not one of std, loo, none")
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
        return web.json_response(self.view(self._task(row.id)).model_dump(mode="json"))

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

    async def register(self, request: web.Request) -> web.Response:
        reg: m.NodeRegistration = await body_of(request, m.NodeRegistration)
        self.store.register_node(reg.node_id, reg.url, reg.workers)
        self.events.publish(m.Event(kind="node", state="active", data={"node_id": reg.node_id}))
        log.info("node %s registered (%s)", reg.node_id, reg.url or "no url")
        return web.json_response(self.control(reg.node_id).model_dump(mode="json"))

    async def heartbeat(self, request: web.Request) -> web.Response:
        node_id = request.match_info["node_id"]
        hb: m.Heartbeat = await body_of(request, m.Heartbeat)
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
        body: m.LeaseRequest = await body_of(request, m.LeaseRequest)
        node = self._node(node_id)
        self.store.heartbeat(node_id, node.stats)
        if node.state != "active":
            return web.json_response(m.LeaseReply(control=self.control(node_id)).model_dump(mode="json"))
        out = []
        parsed: dict[str, tuple[TaskRow, m.TaskRequest, Task]] = {}  # each task read once per lease
        for s, lease in self.store.lease(node_id, body.capacity):
            if s.task_id not in parsed:
                row = self._task(s.task_id)
                parsed[s.task_id] = (
                    row,
                    m.TaskRequest.model_validate_json(row.request),
                    Task.model_validate_json(row.task),
                )
            row, req, task = parsed[s.task_id]
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
        res: m.SampleResult = await body_of(request, m.SampleResult)
        row = self._task(res.task_id)
        req = m.TaskRequest.model_validate_json(row.request)
        rows, versions, detail = stale_check(res, req)
        status = res.status  # a sample that finished before a cancel reached it keeps its work
        if status == "cancelled" and self.store.requeue_sample(
            res.task_id, res.index, res.lease, self.max_dispatches
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

    async def _watch_nodes(self) -> None:
        """Nodes that stopped sending heartbeats are lost; their samples go back to the queue once."""
        while True:
            await asyncio.sleep(min(1.0, self.node_timeout / 3))
            now = time.time()
            for n in self.store.nodes():
                if n.state != "lost" and now - n.last_seen > self.node_timeout:
                    self.store.set_node_state(n.id, "lost")
                    requeued, failed = self.store.requeue_node(n.id, self.max_dispatches)
                    log.warning("node %s lost: %d samples queued again, %d failed", n.id, requeued, failed)
                    self.events.publish(
                        m.Event(
                            kind="node",
                            state="lost",
                            data={"node_id": n.id, "requeued": requeued, "failed": failed},
                        )
                    )
                    for t in {r.id for r in self.store.tasks(("running",))}:
                        self._maybe_complete(t)

    # -- weight sync ----------------------------------------------------------------------------

    def _healthy_nodes(self) -> list[str]:
        now = time.time()
        return [
            n.id for n in self.store.nodes() if n.state != "lost" and now - n.last_seen < self.node_timeout
        ]

    async def pause(self, request: web.Request) -> web.Response:
        body: m.PauseRequest = await body_of(request, m.PauseRequest)
        self.store.put("paused", "1")
        self.events.publish(m.Event(kind="weights", state="paused"))
        since = time.time()
        deadline = since + body.timeout_seconds
        nodes = self._healthy_nodes()
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
        body: m.ResumeRequest = await body_of(request, m.ResumeRequest)
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
        payload = {"task": self.view(row).model_dump(mode="json"), "rows": self.rows(task_id)}
        delay = self.callback_backoff
        error = None
        for attempt in range(1, self.callback_attempts + 1):
            try:
                async with self._http.post(req.callback_url, json=payload) as r:
                    if r.status < 300:
                        self.store.set_callback(task_id, "delivered")
                        return
                    error = f"HTTP {r.status}"
            except (aiohttp.ClientError, TimeoutError, OSError) as e:
                error = f"{e.__class__.__name__}: {e}"
            log.warning("callback for %s (attempt %d) failed: %s", task_id, attempt, error)
            if attempt < self.callback_attempts:
                self.store.set_callback(task_id, "pending", error)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 60)
        self.store.set_callback(task_id, "failed", error)

    # -- plain endpoints ------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "nodes": len(self._healthy_nodes())})

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
