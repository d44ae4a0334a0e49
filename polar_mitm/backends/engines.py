"""The engines behind `--backend`: which one serves a conversation, and whether it is alive.

One URL is one front (an SGLang engine, or SGLang's router in front of many); several `--backend`
URLs are engines we balance ourselves. A conversation is known by its routing key (the same for
every turn and retry of it, see `Policy.routing_key`): behind a router the key travels as the
`X-SMG-Routing-Key` header and the router's `manual` policy pins it; over several URLs the key
picks its engine by rendezvous hashing (highest hash of key and URL wins), so each conversation
stays on one engine while that engine lives, and when it dies only its conversations move (each to
its next-highest engine: their prefix cache is lost, nothing else).

Liveness is the engine's own (its API's `HEALTH_PATH`): SGLang's `/health_generate` runs one
token through the scheduler (`/health` only says the HTTP process is up), vLLM's `/health`. While turns wait on an engine
(for their first token, or for the next after a silence), one prober per engine (however many
turns wait) probes it every `interval` seconds; a turn whose engine has passed no probe for
`dead_after` seconds (counted from the turn's start, or its last token) fails with a retryable
error, while a slow but live engine passes its probes and keeps the whole first-token timeout. A dead engine is left out of the choice until a probe passes
again.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("polar_mitm.engines")


def rendezvous_score(key: str, url: str) -> int:
    """The weight of `url` for `key` (highest random weight hashing): stable across processes."""
    return int.from_bytes(hashlib.blake2b(f"{key}\0{url}".encode(), digest_size=8).digest(), "big")


class Engine:
    """One `--backend` URL and what we know of its health."""

    __slots__ = ("url", "dead", "last_ok", "watchers", "_reviving", "_probing")

    def __init__(self, url: str):
        self.url = url
        self.dead = False
        self.last_ok = float("-inf")  # loop time a passing probe was sent
        self.watchers = 0  # turns waiting on it for a first token
        self._reviving: asyncio.Task | None = None
        self._probing: asyncio.Task | None = None


Probe = Callable[[str, str, float], Awaitable[bool]]


class EnginePool:
    """The engines of one policy: `pick` a conversation's engine, `watch` it while a turn waits,
    `mark_dead` the one that failed."""

    def __init__(
        self, urls: list[str], probe: Probe, *, health_path: str = "/health_generate", interval: float = 5.0
    ):
        self.engines = [Engine(u.rstrip("/")) for u in urls]
        self.probe = probe
        self.health_path = health_path  # the engine API's liveness check (`EngineAPI.HEALTH_PATH`)
        self.interval = interval

    def pick(self, key: str) -> Engine:
        """The conversation's engine: the live one of highest rendezvous weight for its key (the
        only one when there is one; all count as live when none is)."""
        if len(self.engines) == 1:
            return self.engines[0]
        live = [e for e in self.engines if not e.dead] or self.engines
        return max(live, key=lambda e: rendezvous_score(key, e.url))

    def mark_dead(self, engine: Engine, why: str) -> None:
        """Leave `engine` out of the choice until a probe passes again (only with several: one
        engine is still the only place to send a retry)."""
        if len(self.engines) == 1 or engine.dead:
            return
        engine.dead = True
        log.warning("engine %s is down (%s); its conversations move to the others", engine.url, why)
        engine._reviving = asyncio.ensure_future(self._revive(engine))

    async def _revive(self, engine: Engine) -> None:
        while engine.dead:
            await asyncio.sleep(self.interval)
            if await self.probe(engine.url, self.health_path, max(self.interval, 1.0)):
                engine.dead = False
                log.warning("engine %s answers its health check again", engine.url)

    async def watch(self, engine: Engine, dead_after: float, since: float | None = None) -> None:
        """Return once `engine` has passed no health probe for `dead_after` seconds, counted from
        loop time `since` (default: the call; the turn's start, or when it last heard the engine).
        Meant to run beside a turn that waits on the engine, and be cancelled when a token comes;
        the turns waiting on one engine share its prober."""
        loop = asyncio.get_running_loop()
        start = loop.time() if since is None else since
        engine.watchers += 1
        if engine._probing is None or engine._probing.done():
            engine._probing = asyncio.ensure_future(self._probe_while_watched(engine))
        try:
            while True:
                alive_at = max(start, engine.last_ok)
                left = alive_at + dead_after - loop.time()
                if left <= 0:
                    return
                await asyncio.sleep(min(left, self.interval))
        finally:
            engine.watchers -= 1

    async def _probe_while_watched(self, engine: Engine) -> None:
        """One probe every `interval` seconds (the first after one) while any turn watches."""
        loop = asyncio.get_running_loop()
        await asyncio.sleep(self.interval)
        while engine.watchers > 0:
            sent = loop.time()
            if await self.probe(engine.url, self.health_path, max(self.interval, 0.5)):
                engine.last_ok = max(engine.last_ok, sent)
            await asyncio.sleep(max(0.0, sent + self.interval - loop.time()))

    async def close(self) -> None:
        tasks = [t for e in self.engines for t in (e._reviving, e._probing) if t is not None and not t.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks)
