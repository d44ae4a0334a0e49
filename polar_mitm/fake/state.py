"""What one fake server remembers (`FakeBackendState`, reached as `app[STATE]`).

The request log behind `GET /_fake/requests`, pending faults (`Fault`, from `POST /_fake/fault`
or `fail_next`), the in-flight requests that `/abort_request` and `/update_weight_version` abort,
the recent prompts behind `meta_info.cached_tokens` (a radix cache's hit), and how many samples
each prompt has drawn (which sampling stream the random model uses next).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from aiohttp import web
from pydantic import BaseModel, ConfigDict

from polar_mitm.backends.tokenizer import Tokenizer
from polar_mitm.fake.config import FakeBackendConfig
from polar_mitm.fake.contract import GenParams
from polar_mitm.fake.engine import Engine
from polar_mitm.fake.model import _hash64, _ids_hash

FaultMode = Literal["http500", "garbage", "hang", "drop_midstream", "abort"]


class Fault(BaseModel):
    """`POST /_fake/fault` body: the next `count` generation requests (optionally only those on
    `path`) fail this way. `http500`: HTTP 500 with an SGLang error body; `garbage`: HTTP 200 with
    a body that is not JSON (or an SSE event that is not); `hang`: no answer until the server stops
    (or `hang_seconds`); `drop_midstream`: the connection is cut half-way through the body or
    stream; `abort`: the generation ends half-way with SGLang's graceful abort finish reason."""

    model_config = ConfigDict(extra="forbid")

    mode: FaultMode
    count: int = 1
    path: str | None = None


@dataclass
class _InFlight:
    rid: str
    aborted: bool = False


@dataclass
class FakeBackendState:
    """What one fake server remembers; tests reach it as `app[STATE]`."""

    config: FakeBackendConfig
    tokenizer: Tokenizer
    engine: Engine
    weight_version: str
    request_count: int = 0
    counts: Counter[str] = field(default_factory=Counter)
    requests: deque[dict[str, Any]] = field(default_factory=deque)
    faults: list[Fault] = field(default_factory=list)
    in_flight: dict[str, _InFlight] = field(default_factory=dict)
    prompt_cache: deque[np.ndarray] = field(default_factory=lambda: deque(maxlen=64))
    draws: Counter[int] = field(default_factory=Counter)  # samples drawn so far, per prompt
    shutting_down: asyncio.Event = field(default_factory=asyncio.Event)
    started_at: float = field(default_factory=time.time)

    def take_fault(self, path: str) -> FaultMode | None:
        for f in self.faults:
            if f.count > 0 and (f.path is None or f.path == path):
                f.count -= 1
                self.faults = [x for x in self.faults if x.count > 0]
                return f.mode
        return None

    def next_draw(self, prompt_ids: Sequence[int], params: GenParams, sample_index: int) -> int:
        """Which sampling stream a generation uses. With `sampling_seed` a request is reproducible
        by itself (as in SGLang); without, the k-th sample of a prompt takes the k-th stream, so a
        group of identical requests differs while a fresh server replays the same sequence."""
        if params.sampling_seed is not None:
            return _hash64("sampling_seed", params.sampling_seed, sample_index)
        key = _ids_hash(prompt_ids)
        self.draws[key] += 1
        return self.draws[key] - 1

    def cached_tokens(self, prompt_ids: Sequence[int]) -> int:
        """A radix cache's hit: the longest prefix shared with a recent prompt (at most len - 1)."""
        ids = np.asarray(prompt_ids, dtype=np.int64)
        best = 0
        for old in self.prompt_cache:
            n = min(len(old), len(ids))
            if n <= best:
                continue
            diff = np.nonzero(old[:n] != ids[:n])[0]
            best = max(best, int(diff[0]) if len(diff) else n)
        self.prompt_cache.append(ids)
        return min(best, max(0, len(ids) - 1))


STATE = web.AppKey("polar_mitm_fake_state", FakeBackendState)
