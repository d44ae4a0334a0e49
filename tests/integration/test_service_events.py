"""The rollout server's event stream with a subscriber that reads too slowly: its queue stays
bounded (the oldest events go first) and it is told how many it missed before the next one."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from polar_mitm import api as m
from polar_mitm.service.events import Events
from polar_mitm.sse import Reader


async def test_a_slow_subscriber_is_told_what_it_lost():
    events = Events(capacity=2)
    app = web.Application()
    app.router.add_get("/v1/events", events.event_stream)
    async with TestClient(TestServer(app)) as client:
        resp = await client.get("/v1/events")
        for _ in range(100):
            if events.queues:
                break
            await asyncio.sleep(0.01)
        for i in range(5):  # in one go: the stream reads none of them meanwhile
            events.publish(m.Event(kind="sample", task_id="t", index=i, state="finished"))
        reader, got = Reader(), []
        while len(got) < 3:
            chunk = await asyncio.wait_for(resp.content.readany(), 5)
            got += [(ev.event, json.loads(ev.data)) for ev in reader.feed(chunk)]
        resp.close()
    assert [(kind, data.get("index"), data["data"]) for kind, data in got] == [
        ("lost", None, {"events": 3}),
        ("sample", 3, {}),
        ("sample", 4, {}),
    ]
    assert events.lost == {} and events.queues == set()
