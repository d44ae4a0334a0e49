"""The weight version each vLLM engine serves, for the turns it samples.

SGLang names the version in every reply (`meta_info.weight_version`); vLLM's replies do not, but
with `VLLM_SERVER_DEV_MODE=1` it answers `GET /weight_info` with the version a trainer last set
(`POST /update_weight_version`). A read is a round trip, so a turn takes the version read last
unless it may have changed since:

- the turn is its session's first on that engine: a trainer updates the engine between rollouts,
  and the next rollout's turns must carry the new version;
- the weight gate was paused and resumed since (the service's weight sync);
- the reading is older than `MAX_AGE` seconds (a trainer that updates the engine mid-session
  without pausing the service: its turns carry the new version that long after at most).

A read goes out beside the turn's generation, never before it (a hung engine costs a turn no more
time), is shared by the turns that need one at once, and is waited for only when the turn is
recorded. An engine without `/weight_info` (404) is said once; its turns carry no version."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass

from polar_mitm.backends.engine_api import VLLM_DEV_MODE, EngineAPI
from polar_mitm.backends.engine_client import EngineClient
from polar_mitm.neutral import ProviderError

log = logging.getLogger("polar_mitm.policy")

MAX_AGE = 10.0  # seconds a reading serves turns of sessions that already had one
SESSIONS = 10_000  # sessions remembered as having had a turn (the oldest forgotten first)
SETTLE_S = 1.0  # seconds a finished turn waits for its reading before it is stored without one


@dataclass
class _Reading:
    version: str | None
    at: float  # loop time the read went out
    epoch: int  # the gate's resumes counted when it went out


class WeightVersions:
    """What `GET /weight_info` said, per vLLM engine; `reading` hands a turn its version."""

    def __init__(self, client: EngineClient, *, max_age: float = MAX_AGE):
        self.client = client
        self.max_age = max_age
        self.epoch = 0  # bumped by `stale`
        self._readings: dict[str, _Reading] = {}
        self._asking: dict[str, asyncio.Future[str | None]] = {}
        self._absent: set[str] = set()  # engines without /weight_info
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()  # (engine, session)

    def absent(self, url: str) -> None:
        """`url` serves no /weight_info (the preflight found so, and said it)."""
        self._absent.add(url.rstrip("/"))

    def stale(self) -> None:
        """The weights may have changed (the gate resumed): every engine is read again."""
        self.epoch += 1

    def reading(self, api: EngineAPI, url: str, session_id: str) -> asyncio.Future[str | None]:
        """The version for a turn of `session_id` that `url` is about to sample: the last reading
        when it still holds, else a read sent now in `api`'s words (shared with other turns that
        need one)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[str | None] = loop.create_future()
        if url in self._absent:
            done.set_result(None)
            return done
        first = (url, session_id) not in self._seen
        self._seen[(url, session_id)] = None
        self._seen.move_to_end((url, session_id))
        while len(self._seen) > SESSIONS:
            self._seen.popitem(last=False)
        asking = self._asking.get(url)
        if asking is not None:
            return asking
        last = self._readings.get(url)
        if (
            last is not None
            and not first
            and last.epoch == self.epoch
            and loop.time() - last.at < self.max_age
        ):
            done.set_result(last.version)
            return done
        asking = asyncio.ensure_future(self._read(api, url, _Reading(None, loop.time(), self.epoch)))
        self._asking[url] = asking
        return asking

    async def _read(self, api: EngineAPI, url: str, reading: _Reading) -> str | None:
        try:
            reading.version = await self.client.weight_version(api, url)
        except ProviderError as e:  # the turn's own call says what is wrong with the engine
            log.debug("could not read the weight version of %s: %s", url, e.message)
            return None
        finally:
            self._asking.pop(url, None)
        if reading.version is None:
            self._absent.add(url)
            log.warning(
                "the vLLM engine at %s serves no GET /weight_info (%s): its turns carry no weight version",
                url,
                VLLM_DEV_MODE,
            )
        self._readings[url] = reading
        return reading.version

    @staticmethod
    async def settle(version: asyncio.Future[str | None] | None, wait: float = SETTLE_S) -> None:
        """Wait up to `wait` seconds for a turn's reading (it went out with the generation, so it
        is nearly always back)."""
        if version is not None and not version.done():
            await asyncio.wait({version}, timeout=wait)

    @staticmethod
    def value(version: asyncio.Future[str | None] | None) -> str | None:
        """A turn's version if its reading is back, else None (never waits)."""
        if version is None or not version.done() or version.cancelled() or version.exception():
            return None
        return version.result()

    async def close(self) -> None:
        asking = list(self._asking.values())
        for a in asking:
            a.cancel()
        if asking:
            await asyncio.wait(asking)
