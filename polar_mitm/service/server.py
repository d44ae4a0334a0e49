"""The rollout server: tasks in over HTTP, samples out to gateway nodes, scored groups back.

This module is the assembly: the parts, the route table (the API, once: who may call each route
and the models it takes), and the server's life. State lives in SQLite (`store/service.py`); the
parts, each one job:

- `http.py`: who the bearer is and what it may call, body caps, errors in one shape;
- `tasks_api.py`: the task API, what reaches the host, sealed secrets, a group's completion;
- `nodes_api.py`: the node protocol (register, heartbeat, lease, result) and lost nodes;
- `weights.py`: pause and resume around a weight update;
- `callbacks.py`: a finished group posted to its callback, with retries, resumed after a restart;
- `events.py`: server-sent events of state changes; `metrics.py`, `openapi.py`;
- `polar.py`: Polar's rollout API under a secret prefix (`serve --polar-api`), `polar_models.py`.

Only the operator drives it (`auth.py`): every route but `/health` takes the control token;
a node's credential registers, and the key a registration returns serves that node id alone.
What reaches the host (the `local` runtime, task paths, callbacks) is off unless the operator
turns it on, and a body is bounded before it is read whole (size) and parsed (depth).
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from polar_mitm import api as m
from polar_mitm import auth
from polar_mitm.recipes import all_recipes
from polar_mitm.service import http
from polar_mitm.service.callbacks import Callbacks
from polar_mitm.service.config import ServerConfig
from polar_mitm.service.events import Events
from polar_mitm.service.http import MB, Handler, Who
from polar_mitm.service.metrics import Metrics
from polar_mitm.service.nodes_api import Nodes
from polar_mitm.service.openapi import openapi
from polar_mitm.service.polar import PolarApi
from polar_mitm.service.tasks_api import Tasks
from polar_mitm.service.weights import Weights
from polar_mitm.store.service import ServiceStore


class RolloutServer:
    def __init__(self, config: ServerConfig):
        """`config.token`: the operator's control token (a random one when None: the server is
        never open; `serve` gives it one from its token file). `allow_local_runtime`, `task_root`
        and `callback_allow` turn on what reaches the host: tasks run unsandboxed, task paths read
        under that directory, callbacks to those hosts. `polar_api`: Polar's rollout API too, under
        a secret prefix (`polar.py`). `deadline_grace`: seconds past a sample's budget before the
        server gives it up on its node."""
        self.config = config
        self.store = ServiceStore(config.db)
        self.token = config.token or auth.new_token()
        self.node_token = auth.node_token(self.token)
        max_body = int(config.max_body_mb * MB)
        max_result = int(max(config.max_result_mb, config.max_body_mb) * MB)
        self.events = Events()
        self.metrics = Metrics(self)
        self.callbacks = Callbacks(
            self.store, self._group, attempts=config.callback_attempts, backoff=config.callback_backoff
        )
        self.tasks = Tasks(
            self.store,
            self.events,
            self.metrics,
            self.callbacks,
            auth.Sealer(self.token),
            max_body=max_body,
            allow_local_runtime=config.allow_local_runtime,
            task_root=config.task_root.resolve() if config.task_root else None,
            callback_allow=set(config.callback_allow),
        )
        self.nodes = Nodes(
            self.store,
            self.events,
            self.metrics,
            self.tasks,
            node_timeout=config.node_timeout,
            max_dispatches=config.max_dispatches,
            max_body=max_body,
            max_result=max_result,
            deadline_grace=config.deadline_grace,
        )
        self.weights = Weights(self.store, self.events, self.nodes, max_body=max_body)
        self.guard = http.Guard(self.token, self.node_token, self.store.node_for_key)
        self.max_result = max_result
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.host = "127.0.0.1"
        self._loops: list[asyncio.Task] = []
        self.polar = (
            PolarApi(self.token, self.tasks, self.nodes, self.weights, self.events)
            if config.polar_api
            else None
        )

    def _group(self, task_id: str) -> dict[str, Any]:
        return self.tasks.group(task_id)

    # What the metrics' gauges and the tests read of the nodes.
    @property
    def heartbeats(self) -> dict[str, m.Heartbeat]:
        return self.nodes.heartbeats

    @property
    def longest_silence(self) -> dict[str, float]:
        return self.nodes.longest_silence

    def healthy_nodes(self) -> list[str]:
        return self.nodes.healthy_nodes()

    def lose_node(self, node_id: str) -> None:
        self.nodes.lose_node(node_id)

    # -- life -----------------------------------------------------------------------------------

    def routes(self) -> list[tuple[str, str, Handler, type[BaseModel] | None, Any, str, Who]]:
        """(method, path, handler, request model, response model, summary, who may call it): the
        API, once."""
        t, n, w = self.tasks, self.nodes, self.weights
        return [
            ("POST", "/v1/tasks", t.submit, m.TaskRequest, m.Submitted, "Submit a task to roll out", "operator"),
            ("GET", "/v1/tasks", t.list_tasks, None, list[m.TaskView], "Every task", "operator"),
            ("GET", "/v1/tasks/{task_id}", t.get_task, None, m.TaskView, "A task: state, samples, rewards", "operator"),
            ("GET", "/v1/tasks/{task_id}/results", t.results, None, None, "The group's rows (json | parquet)", "operator"),
            ("DELETE", "/v1/tasks/{task_id}", t.cancel_task, None, m.TaskView, "Cancel a task", "operator"),
            ("GET", "/v1/events", self.events.event_stream, None, m.Event, "Server-sent events of state changes", "operator"),
            ("POST", "/v1/nodes/register", n.register, m.NodeRegistration, m.Registered, "A node joins", "register"),
            ("POST", "/v1/nodes/{node_id}/heartbeat", n.heartbeat, m.Heartbeat, m.Control, "A node's load", "node"),
            ("POST", "/v1/nodes/{node_id}/lease", n.lease, m.LeaseRequest, m.LeaseReply, "Samples for a node", "node"),
            ("POST", "/v1/nodes/{node_id}/results", n.result, m.SampleResult, None, "A finished sample", "node"),
            ("GET", "/v1/nodes", n.list_nodes, None, list[m.NodeView], "The nodes and their load", "operator"),
            ("DELETE", "/v1/nodes/{node_id}", n.drain_node, None, m.NodeView, "Drain a node", "operator"),
            ("POST", "/v1/admin/pause", w.pause, m.PauseRequest, m.PauseReply, "Pause generation", "operator"),
            ("POST", "/v1/admin/resume", w.resume, m.ResumeRequest, m.Control, "Resume generation", "operator"),
            ("GET", "/health", self.health, None, None, "Liveness", "public"),
            ("GET", "/metrics", self.metrics.metrics_text, None, None, "Prometheus metrics", "operator"),
            ("GET", "/openapi.json", self.openapi_json, None, None, "This API's OpenAPI schema", "operator"),
        ]  # fmt: skip

    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[self.metrics.timed, http.errors, self.guard.middleware],
            client_max_size=self.max_result,
        )
        for method, path, handler, *_, who in self.routes():
            app.router.add_route(method, path, handler)
            self.guard.who[(method, path)] = who
        for method, path, handler, polar_who in self.polar.routes() if self.polar else []:
            app.router.add_route(method, path, handler)
            self.guard.who[(method, path)] = polar_who  # type: ignore[assignment]
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self.host = host
        # Read before serving, in a thread: the first submit would read them on the loop that
        # answers the nodes' heartbeats.
        await asyncio.to_thread(all_recipes)
        self.runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._loops = [asyncio.create_task(self.nodes.watch()), self.callbacks.start()]
        if self.polar is not None:
            self._loops.append(asyncio.create_task(self.polar.watch()))
        return self.port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def polar_url(self) -> str | None:
        """The Polar API's base URL (its secret prefix included), when it is on."""
        return self.polar.url(self.url) if self.polar else None

    async def stop(self) -> None:
        for t in self._loops:
            t.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        await self.callbacks.stop()
        if self.runner is not None:
            await self.runner.cleanup()
        self.store.close()

    # -- plain endpoints ------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "nodes": len(self.healthy_nodes())})

    async def openapi_json(self, request: web.Request) -> web.Response:
        return web.json_response(openapi(self.routes()))
