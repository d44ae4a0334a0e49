"""State changes as server-sent events (`GET /v1/events`): tasks, samples, nodes and weights,
published by the parts that change them, read by `polar-mitm view` and trainers that watch."""

from __future__ import annotations

import asyncio
import contextlib
import time

from aiohttp import web

from polar_mitm import api as m


class Events:
    """Server-sent events to every subscriber; a slow subscriber loses the oldest events, and
    is told how many before the next one it reads (`kind: lost`): its memory stays bounded and
    it knows to read the state it watches again (`GET /v1/tasks/{id}`)."""

    def __init__(self, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self.queues: set[asyncio.Queue[m.Event]] = set()
        self.lost: dict[asyncio.Queue[m.Event], int] = {}  # events dropped since its last read

    def publish(self, ev: m.Event) -> None:
        ev.at = ev.at or time.time()
        for q in self.queues:
            if q.full():
                q.get_nowait()
                self.lost[q] = self.lost.get(q, 0) + 1
            q.put_nowait(ev)

    @contextlib.contextmanager
    def subscribe(self):
        q: asyncio.Queue[m.Event] = asyncio.Queue(maxsize=self.capacity)
        self.queues.add(q)
        try:
            yield q
        finally:
            self.queues.discard(q)
            self.lost.pop(q, None)

    async def event_stream(self, request: web.Request) -> web.StreamResponse:
        """`GET /v1/events`: every event from now on, a keep-alive comment each 15 s of quiet."""
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache"})
        await resp.prepare(request)
        with self.subscribe() as q:
            try:
                while True:
                    try:
                        ev = await asyncio.wait_for(q.get(), 15)
                    except TimeoutError:
                        await resp.write(b": keep-alive\n\n")
                        continue
                    lost = self.lost.pop(q, 0)
                    if lost:
                        gap = m.Event(kind="lost", data={"events": lost}, at=time.time())
                        await resp.write(f"event: lost\ndata: {gap.model_dump_json()}\n\n".encode())
                    await resp.write(f"event: {ev.kind}\ndata: {ev.model_dump_json()}\n\n".encode())
            except (ConnectionResetError, asyncio.CancelledError):
                pass
        return resp
