"""The live page's one connection to the rollout service, shared by every open browser tab.

The viewer subscribes once to the service's `GET /v1/events` (SSE) while at least one tab is
watching, and passes each event on. What events do not carry (a sample's stage, a node's queues
and in-flight counts, which come with heartbeats) is read back from the service by this relay
alone, at most once per `refresh` seconds and only for tasks an event touched or that are still
running, so a hundred open tabs cost the service what one does: no polling storm.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import aiohttp

from polar_mitm import sse
from polar_mitm.retry import delays

log = logging.getLogger("polar_mitm.view")


class LiveRelay:
    def __init__(self, server: str, token: str | None, *, refresh: float = 2.0):
        self.server = server.rstrip("/")
        self.token = token
        self.refresh = refresh
        self.subscribers: set[asyncio.Queue[bytes]] = set()
        self._http: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        self._dirty: set[str] = set()
        self._running: set[str] = set()
        self.upstream_requests = 0  # GETs sent to the service (tests check it stays bounded)

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.token}"} if self.token else {}

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        return self._http

    async def get(self, path: str) -> Any:
        self.upstream_requests += 1
        async with self._session().get(
            self.server + path, headers=self.headers, timeout=aiohttp.ClientTimeout(total=10)
        ) as r:
            if r.status != 200:
                raise RuntimeError(f"GET {path}: HTTP {r.status} {(await r.text())[:200]}")
            return await r.json()

    async def snapshot(self) -> dict[str, Any]:
        """Tasks and nodes as the service has them now (what the page starts from)."""
        tasks, nodes = await asyncio.gather(self.get("/v1/tasks"), self.get("/v1/nodes"))
        self._running = {t["task_id"] for t in tasks if t["state"] in ("queued", "running")}
        return {"tasks": tasks, "nodes": nodes}

    @contextlib.asynccontextmanager
    async def subscribe(self) -> AsyncIterator[asyncio.Queue[bytes]]:
        q: asyncio.Queue[bytes] = asyncio.Queue(maxsize=1000)
        self.subscribers.add(q)
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._upstream()), asyncio.create_task(self._refresher())]
        try:
            yield q
        finally:
            self.subscribers.discard(q)
            if not self.subscribers:
                await self._stop_tasks()

    def _broadcast(self, event: str, data: Any) -> None:
        message = sse.encode(data if isinstance(data, dict) else {"items": data}, event=event)
        for q in self.subscribers:
            if q.full():  # a tab that stopped reading loses its oldest events, never blocks others
                q.get_nowait()
            q.put_nowait(message)

    async def _upstream(self) -> None:
        """Follow the service's event stream; reconnect (with a pause) when it drops."""
        pauses = delays(0.5, cap=5.0)
        while True:
            try:
                async with self._session().get(self.server + "/v1/events", headers=self.headers) as r:
                    if r.status != 200:
                        raise RuntimeError(f"HTTP {r.status}")
                    self._broadcast("status", {"connected": True})
                    pauses = delays(0.5, cap=5.0)
                    reader = sse.Reader()
                    async for chunk in r.content.iter_any():
                        for ev in reader.feed(chunk):
                            self._relay(ev)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the service went away: say so, and try again
                self._broadcast("status", {"connected": False, "error": str(e) or type(e).__name__})
            await asyncio.sleep(next(pauses))

    def _relay(self, ev: sse.SSEEvent) -> None:
        try:
            data = json.loads(ev.data)
        except ValueError:
            return
        if not isinstance(data, dict):
            return
        self._broadcast("event", data)
        task_id = data.get("task_id")
        if isinstance(task_id, str):
            self._dirty.add(task_id)
            if data.get("kind") == "task" and data.get("state") in ("done", "cancelled"):
                self._running.discard(task_id)
            else:
                self._running.add(task_id)

    async def _refresher(self) -> None:
        """Every `refresh` seconds: the tasks events touched or still running, and the nodes."""
        while True:
            await asyncio.sleep(self.refresh)
            todo, self._dirty = self._dirty | self._running, set()
            try:
                for task_id in sorted(todo):
                    view = await self.get(f"/v1/tasks/{quote(task_id, safe='')}")
                    if view.get("state") in ("done", "cancelled"):
                        self._running.discard(task_id)
                    self._broadcast("task", view)
                self._broadcast("nodes", await self.get("/v1/nodes"))
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.debug("live refresh failed: %s", e)

    async def _stop_tasks(self) -> None:
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    async def close(self) -> None:
        await self._stop_tasks()
        if self._http is not None:
            await self._http.close()
