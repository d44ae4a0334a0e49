"""Weight control: a trainer pauses generation before it pushes new weights to the engine, and
resumes with the new weight version (`POST /v1/admin/pause|resume`).

The server does not reach the nodes: the pause is a flag in the store that every node reads in
the `Control` of its next heartbeat; the pause call waits until each healthy node has reported,
since the pause, a closed gate and nothing under way (or until its timeout).
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from polar_mitm import api as m
from polar_mitm.service.events import Events
from polar_mitm.service.http import body_of
from polar_mitm.service.nodes_api import Nodes
from polar_mitm.store.service import ServiceStore


class Weights:
    def __init__(self, store: ServiceStore, events: Events, nodes: Nodes, *, max_body: int):
        self.store = store
        self.events = events
        self.nodes = nodes
        self.max_body = max_body

    async def pause(self, request: web.Request) -> web.Response:
        body: m.PauseRequest = await body_of(request, m.PauseRequest, self.max_body)
        reply = await self.pause_and_drain(body.timeout_seconds)
        return web.json_response(reply.model_dump(mode="json"))

    async def pause_and_drain(self, timeout_seconds: float) -> m.PauseReply:
        """Pause, and wait up to `timeout_seconds` for every healthy node to have drained."""
        self.store.put("paused", "1")
        self.events.publish(m.Event(kind="weights", state="paused"))
        since = time.time()
        deadline = since + timeout_seconds
        nodes = self.nodes.healthy_nodes()
        heartbeats, heartbeat_at = self.nodes.heartbeats, self.nodes.heartbeat_at
        while True:
            # Drained when every node has reported, since the pause, a closed gate and nothing under way.
            fresh = [heartbeats[n] for n in nodes if heartbeat_at.get(n, 0.0) >= since]
            generating = sum(heartbeats[n].generating for n in nodes if n in heartbeats)
            drained = len(fresh) == len(nodes) and all(hb.paused and hb.generating == 0 for hb in fresh)
            if drained or time.time() >= deadline:
                break
            await asyncio.sleep(0.1)
        return m.PauseReply(paused=True, drained=drained, generating=generating, nodes=len(nodes))

    async def resume(self, request: web.Request) -> web.Response:
        body: m.ResumeRequest = await body_of(request, m.ResumeRequest, self.max_body)
        return web.json_response(self.resume_with(body.weight_version).model_dump(mode="json"))

    def resume_with(self, weight_version: str | None) -> m.Control:
        """Resume; `weight_version`, when given, is what the nodes are told is now served."""
        if weight_version is not None:
            self.store.put("weight_version", weight_version)
        self.store.put("paused", None)
        self.events.publish(m.Event(kind="weights", state="resumed", data={"weight_version": weight_version}))
        return m.Control(paused=False, weight_version=self.store.get("weight_version"))
