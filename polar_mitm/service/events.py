"""State changes as server-sent events (`GET /v1/events`): tasks, samples, nodes and weights,
published by the parts that change them, read by `polar-mitm view` and trainers that watch."""

from __future__ import annotations

import asyncio
import contextlib
import time

from aiohttp import web

from polar_mitm import api as m


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
                    await resp.write(f"event: {ev.kind}\ndata: {ev.model_dump_json()}\n\n".encode())
            except (ConnectionResetError, asyncio.CancelledError):
                pass
        return resp
