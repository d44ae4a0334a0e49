"""The Polar-compatible door of the rollout server (`serve --polar-api`): the routes Polar's
trainers and tools call (its slime bridge, Miles' bridge, ClawBench, `polar status`), on the same
store and the same task pipeline as `/v1`, answering in Polar's shapes (`polar_models.py`).

Who may call it. Polar's clients send no bearer token, so every route lives under a secret path
segment, a capability derived from the service token (`auth.polar_prefix`): `serve --polar-api`
prints `http://HOST:PORT/<secret>`, the base URL a client is given. The same routes answer without
the segment to the operator: its bearer token, or `X-Polar-Control-Token` equal to it (the header
Polar's clients send when `POLAR_CONTROL_PLANE_TOKEN` is set). A wrong segment is a 404; a route
without it and without the token a 401. What the door allows is in docs/threat-model.md.

Polar's gateways are our nodes: `GET /nodes` names, for each, a gateway URL under this door whose
`/admin/inference/pause|resume|status` are the server's pause and resume (a pause of one is a
pause of all, so a client pausing every gateway pauses once and waits for every node to drain).
A task's callback is Polar's: one POST of its `TaskResult` when it completes, never retried once
the listener answered (a client falls back to polling).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from polar_mitm import auth, jsontext
from polar_mitm.outcomes import TRAINABLE
from polar_mitm.service import polar_models as p
from polar_mitm.service.events import Events
from polar_mitm.service.http import ApiError, Handler, body_of, forbid, json_body
from polar_mitm.service.nodes_api import Nodes
from polar_mitm.service.tasks_api import Tasks
from polar_mitm.service.weights import Weights
from polar_mitm.store.service import unpack_rows

log = logging.getLogger("polar_mitm.service")

TOMBSTONE_SECONDS = 300.0  # Polar's: a late submit of a task cancelled before it existed is refused
CALLBACK_TIMEOUT = 10.0  # Polar's callback timeout


def _tombstone_key(task_id: str) -> str:
    return f"polar:tombstone:{task_id}"


def _callback_key(task_id: str) -> str:
    return f"polar:callback:{task_id}"


class PolarApi:
    def __init__(self, token: str, tasks: Tasks, nodes: Nodes, weights: Weights, events: Events):
        """`token`: the service token, whose derived secret is the routes' prefix."""
        self.store = tasks.store
        self.tasks = tasks
        self.nodes = nodes
        self.weights = weights
        self.events = events
        self.prefix = "/" + auth.polar_prefix(token)
        self._kept: dict[str, dict[str, Any]] = {}  # task id -> what the mapping kept (its request's)

    def routes(self) -> list[tuple[str, str, Handler, str]]:
        """(method, path, handler, who): each route under the secret prefix (the path is the
        capability: public to whoever holds it), and again at the root for the operator."""
        table: list[tuple[str, str, Handler]] = [
            ("POST", "/rollout/task/submit", self.submit),
            ("GET", "/rollout/task/{task_id}", self.get_task),
            ("DELETE", "/rollout/task/{task_id}", self.cancel_task),
            ("GET", "/rollout/status", self.rollout_status),
            ("GET", "/nodes", self.list_nodes),
            ("GET", "/tasks", self.list_tasks),
            ("GET", "/tasks/{task_id}/sessions", self.sessions),
            ("GET", "/admin/inference/status", self.inference_status),
            ("POST", "/admin/inference/pause", self.pause),
            ("POST", "/admin/inference/resume", self.resume),
            ("GET", "/gateway/{node_id}/admin/inference/status", self.inference_status),
            ("POST", "/gateway/{node_id}/admin/inference/pause", self.pause),
            ("POST", "/gateway/{node_id}/admin/inference/resume", self.resume),
        ]
        out = [(method, self.prefix + path, h, "public") for method, path, h in table]
        out.append(("GET", self.prefix + "/health", self.health, "public"))  # the root's /health is ours
        out += [(method, path, h, "polar") for method, path, h in table]
        return out

    def url(self, origin: str) -> str:
        return origin + self.prefix

    def _base(self, request: web.Request) -> str:
        """The base URL the client called: with the secret prefix or, for the operator, without."""
        origin = f"{request.scheme}://{request.host}"
        return origin + self.prefix if request.path.startswith(self.prefix + "/") else origin

    # -- tasks ----------------------------------------------------------------------------------

    def _check_callback(self, url: str | None) -> None:
        if url is None:
            return
        if not url.startswith(("http://", "https://")):
            raise p.refuse("callback_url", "an http(s) URL")
        allow = self.tasks.callback_allow
        host = (urlsplit(url).hostname or "").lower()
        if not allow:
            raise forbid(
                "callback_url", "the server posts to no address unless started with --callback-allow HOST"
            )
        if host not in allow:
            raise forbid(
                "callback_url", f"host {host!r} is not among --callback-allow ({', '.join(sorted(allow))})"
            )

    async def submit(self, request: web.Request) -> web.Response:
        req: p.TaskRequest = await body_of(request, p.TaskRequest, self.tasks.max_body)
        dead = self.store.get(_tombstone_key(req.task_id))
        if dead is not None:
            if float(dead) > time.time():
                raise ApiError(409, "conflict", f"task {req.task_id} was cancelled before submission")
            self.store.put(_tombstone_key(req.task_id), None)
        ours = p.to_request(req, task_root=self.tasks.task_root)
        self._check_callback(req.callback_url)
        task_id = self.tasks.accept(ours)
        return web.json_response({"task_id": task_id, "status": "running"})

    def kept(self, task_id: str) -> dict[str, Any]:
        """What the mapping kept of a task's Polar request ({} for one submitted to /v1)."""
        if task_id not in self._kept:
            row = self.store.task(task_id)
            if row is None:
                raise ApiError(404, "not_found", "Task not found")
            self._kept[task_id] = p.polar_meta(row.request)
        return self._kept[task_id]

    def status(self, task_id: str) -> dict[str, Any]:
        """The task as Polar's TaskStatus (a 404 when there is none)."""
        found = self.store.summaries(task_id)
        if not found:
            raise ApiError(404, "not_found", "Task not found")
        kept = self.kept(task_id)
        samples = self.store.samples(task_id)
        rows = {s.idx: unpack_rows(s.rows) for s in samples if s.state == "finished" and s.rows}
        return p.task_status(found[0], samples, rows, kept)

    async def get_task(self, request: web.Request) -> web.Response:
        return status_body(self.status(request.match_info["task_id"]))

    async def cancel_task(self, request: web.Request) -> web.Response:
        task_id = request.match_info["task_id"]
        register = request.query.get("register_if_missing", "false").lower() in ("1", "true", "yes")
        if self.store.task(task_id) is None:
            if not register:
                raise ApiError(404, "not_found", "Task not found")
            if not p.m.TASK_ID.fullmatch(task_id):
                raise p.refuse("task_id", "letters, digits and . _ : @ + - (it appears in URLs), at most 200")
            self.store.put(_tombstone_key(task_id), repr(time.time() + TOMBSTONE_SECONDS))
            return json_body(
                {
                    "task_id": task_id,
                    "status": "cancelled",
                    "total_sessions": 0,
                    "completed_sessions": 0,
                    "results": [],
                    "result_paths": [],
                    "sessions": [],
                }  # fmt: skip
            )
        self.tasks.cancel(task_id)
        return status_body(self.status(task_id))

    async def list_tasks(self, request: web.Request) -> web.Response:
        q = request.query
        try:
            limit = int(q.get("limit", "200"))
            since = float(q["since"]) if "since" in q else None
        except ValueError:
            raise p.refuse("limit" if "limit" in q else "since", "a number") from None
        if not 1 <= limit <= 1000:
            raise p.refuse("limit", "between 1 and 1000")
        samples = self.store.all_samples()
        out = []
        for t in self.store.summaries():
            mine = samples.get(t.id, [])
            done = [s for s in mine if s.state == "finished" and s.status != "cancelled"]
            rewards = [s.reward for s in done if s.reward is not None]
            item: dict[str, Any] = {
                "task_id": t.id,
                "status": p.task_state(t.state),
                "harness": t.harness.replace("-", "_"),
                "model": None,
                "num_samples": t.num_samples,
                "completed_sessions": len(done),
                "errored_sessions": sum(1 for s in done if s.status not in TRAINABLE),
                "mean_reward": sum(rewards) / len(rewards) if rewards else None,
                "mean_traces": None,
                "mean_completions": None,
                "created_at": t.created_at,
                "updated_at": t.updated_at,
                "source": "live",
            }
            if q.get("status") and item["status"] != q["status"]:
                continue
            if q.get("harness") and q["harness"] not in (t.harness, item["harness"]):
                continue
            if since is not None and t.updated_at < since:
                continue
            out.append(item)
        out.sort(key=lambda t: t["updated_at"], reverse=True)
        return json_body({"tasks": out[:limit]})

    async def sessions(self, request: web.Request) -> web.Response:
        task_id = request.match_info["task_id"]
        if self.store.task(task_id) is None:
            raise ApiError(404, "not_found", "Task not found")
        out = []
        for s in self.store.samples(task_id, rows=False):
            item: dict[str, Any] = {
                "session_id": s.session_id or f"{task_id}:{s.idx}",
                "task_id": task_id,
                "status": p.session_status(s),
            }
            if s.state == "finished":
                item |= {
                    "node_id": s.node_id,
                    "reward": s.reward,
                    "timing": p.timing(json.loads(s.timings or "{}")),
                    "error": None if s.status == "completed" else (s.cause or s.status),
                }
            out.append(item)
        return json_body({"task_id": task_id, "sessions": out})

    # -- nodes, health, weights -----------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "nodes": len(self.nodes.healthy_nodes())})

    async def list_nodes(self, request: web.Request) -> web.Response:
        nodes = self.nodes
        beat = max(1, int(nodes.node_timeout // 3))
        base = self._base(request)
        out = [
            p.node_info(nodes.node_view(n), f"{base}/gateway/{n.id}", beat)
            for n in self.store.nodes()
            if n.state != "lost"
        ]
        return json_body(out)

    async def rollout_status(self, request: web.Request) -> web.Response:
        counts: dict[str, int] = {}
        for (state, _), n in self.store.counts().items():
            counts[state] = counts.get(state, 0) + n
        return json_body(
            {
                "tasks": {t.id: p.task_state(t.state) for t in self.store.summaries()},
                "pipeline": {"samples": counts, "paused": self.store.get("paused") == "1"},
                "nodes": {"registered": len(self.store.nodes()), "healthy": len(self.nodes.healthy_nodes())},
            }
        )

    def _generation(self) -> dict[str, Any]:
        healthy = self.nodes.healthy_nodes()
        beats = self.nodes.heartbeats
        inflight = sum(beats[n].generating for n in healthy if n in beats)
        return {
            "paused": self.store.get("paused") == "1",
            "drained": inflight == 0,
            "inflight": inflight,
            "engine": "polar-mitm",
            "nodes": len(healthy),
            "weight_version": self.store.get("weight_version"),
        }

    async def inference_status(self, request: web.Request) -> web.Response:
        return web.json_response(self._generation())

    async def pause(self, request: web.Request) -> web.Response:
        try:
            timeout = float(request.query.get("timeout_seconds", "300"))
        except ValueError:
            timeout = math.nan
        if not math.isfinite(timeout) or not 0 <= timeout <= 24 * 3600:
            raise p.refuse("timeout_seconds", "seconds, between 0 and 86400")
        reply = await self.weights.pause_and_drain(timeout)
        if not reply.drained:
            # Polar's answer to a drain that overran: the pause holds, the caller decides.
            raise ApiError(
                504, "timeout", f"Timed out waiting for inference requests to drain after {timeout:g}s",
                inflight=reply.generating,
            )  # fmt: skip
        return web.json_response({**self._generation(), "paused": True, "inflight": 0, "drained": True,
                                  "timed_out": False, "wait_for_drain": True})  # fmt: skip

    async def resume(self, request: web.Request) -> web.Response:
        # Polar's clients send no weight version: each turn records the one its engine reports.
        self.weights.resume_with(None)
        return web.json_response(self._generation())

    # -- the callback ---------------------------------------------------------------------------

    async def watch(self) -> None:
        """Post each completed Polar task's TaskResult to its callback, once."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CALLBACK_TIMEOUT)) as http:
            with self.events.subscribe() as q:
                pending: set[asyncio.Task] = set()
                try:
                    while True:
                        ev = await q.get()
                        if ev.kind == "task" and ev.state == "done" and ev.task_id:
                            t = asyncio.create_task(self._deliver(http, ev.task_id))
                            pending.add(t)
                            t.add_done_callback(pending.discard)
                finally:
                    for t in pending:
                        t.cancel()
                    await asyncio.gather(*pending, return_exceptions=True)

    async def _deliver(self, http: aiohttp.ClientSession, task_id: str) -> None:
        try:
            url = self.kept(task_id).get("callback_url")
        except ApiError:
            return
        if not url or self.store.get(_callback_key(task_id)) is not None:
            return
        # Marked before the POST: whatever happens, it is never posted twice.
        self.store.put(_callback_key(task_id), "posting")
        status = self.status(task_id)
        body = {k: status[k] for k in ("task_id", "status", "results", "result_paths")}
        outcome = _post_once(http, url, body)
        self.store.put(_callback_key(task_id), await outcome)


def status_body(status: dict[str, Any]) -> web.Response:
    """A TaskStatus as JSON, its results written once for both `results` and `sessions` (the
    same list: a group's token ids are the bulk of the reply)."""
    results = jsontext.dumps(status["results"])
    head = jsontext.dumps({k: v for k, v in status.items() if k not in ("results", "sessions")})
    body = head[:-1] + b',"results":' + results + b',"sessions":' + results + b"}"
    return web.Response(body=body, content_type="application/json")


async def _post_once(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str:
    """POST once, never following a redirect: what happened, for the store."""
    try:
        headers = {"content-type": "application/json"}
        async with http.post(url, data=jsontext.dumps(body), headers=headers, allow_redirects=False) as r:
            if r.status >= 300:
                log.warning(
                    "Polar callback to %s answered HTTP %d; the trainer falls back to polling", url, r.status
                )
            return f"HTTP {r.status}"
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        log.warning("Polar callback to %s failed (%s); the trainer falls back to polling", url, e)
        return f"failed: {e.__class__.__name__}"
