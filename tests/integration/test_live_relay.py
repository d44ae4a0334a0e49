"""The live viewer's relay reads the service's event stream with the one SSE stream reader: an
event whose bytes arrive in two TCP writes, cut inside a UTF-8 character, is relayed intact."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from polar_mitm.view.live import LiveRelay


async def test_an_event_cut_inside_a_character_is_relayed_whole():
    event = json.dumps({"kind": "sample", "task_id": "tâche-é", "index": 0}, ensure_ascii=False).encode()
    cut = event.index("é".encode()) + 1  # between the two bytes of é
    sent, done = asyncio.Event(), asyncio.Event()

    async def events(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + event[:cut])
        await asyncio.sleep(0.2)  # two writes, two reads on the other side
        await resp.write(event[cut:] + b"\n\n")
        sent.set()
        await done.wait()  # the stream stays open, as the service's does
        return resp

    app = web.Application()
    app.router.add_get("/v1/events", events)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    relay = LiveRelay(f"http://127.0.0.1:{port}", None, refresh=60)
    try:
        async with relay.subscribe() as q:
            relayed = []
            async with asyncio.timeout(10):
                while not relayed:
                    message = (await q.get()).decode()
                    if message.startswith("event: event\n"):
                        relayed.append(json.loads(message.split("data: ", 1)[1]))
        assert sent.is_set()
        assert relayed == [json.loads(event)]
    finally:
        done.set()
        if relay._http is not None:
            await relay._http.close()
        await runner.cleanup()
