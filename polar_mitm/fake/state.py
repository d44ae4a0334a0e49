"""What one fake server remembers (`FakeBackendState`, reached as `app[STATE]`).

The request log behind `GET /_fake/requests`, pending faults (`Fault`, from `POST /_fake/fault`
or `fail_next`), the in-flight requests that `/abort_request` and `/update_weight_version` abort,
the engine's prefix cache behind `meta_info.cached_tokens` (`PrefixCacheSim`: the sequences it
has seen, prompt and generated tokens, as SGLang's radix cache keeps them), how many samples
each prompt has drawn (which sampling stream the random model uses next), and how many requests a
`hang` fault holds (a stuck scheduler: `/health_generate` waits while any is held).
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


class PrefixCacheSim:
    """One engine's prefix cache, as a radix cache behaves from outside: a prompt's hit is the
    longest prefix it shares with a sequence this engine has seen (a prompt with the tokens
    generated after it), least recently used sequences evicted past `max_tokens`.

    Kept as whole sequences (a sequence that extends another replaces it), compared with numpy:
    enough for tests and benches of a few hundred conversations per engine."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.seqs: list[np.ndarray] = []  # least recently used first
        self.tokens = 0

    def clear(self) -> None:
        self.seqs.clear()
        self.tokens = 0

    def hit(self, ids: Sequence[int]) -> int:
        """The longest cached prefix of `ids` (at most len - 1: one token is always computed);
        the sequence it came from becomes the most recently used."""
        a = np.asarray(ids, dtype=np.int64)
        best, where = 0, -1
        for i, old in enumerate(self.seqs):
            n = min(len(old), len(a))
            if n <= best:
                continue
            diff = np.nonzero(old[:n] != a[:n])[0]
            got = int(diff[0]) if len(diff) else n
            if got > best:
                best, where = got, i
        if where >= 0:
            self.seqs.append(self.seqs.pop(where))
        return min(best, max(0, len(a) - 1))

    def add(self, ids: Sequence[int]) -> None:
        """Remember a sequence (dropping those it extends), then evict past the budget."""
        a = np.asarray(ids, dtype=np.int64)
        keep = []
        for old in self.seqs:
            if len(old) <= len(a) and np.array_equal(old, a[: len(old)]):
                self.tokens -= len(old)
            else:
                keep.append(old)
        keep.append(a)
        self.seqs = keep
        self.tokens += len(a)
        while self.tokens > self.max_tokens and len(self.seqs) > 1:
            self.tokens -= len(self.seqs.pop(0))


@dataclass
class _InFlight:
    rid: str
    aborted: bool = False


def _set_event() -> asyncio.Event:
    e = asyncio.Event()
    e.set()
    return e


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
    prompt_cache: PrefixCacheSim = field(default_factory=lambda: PrefixCacheSim(2_000_000))
    hanging: int = 0  # requests a `hang` fault holds now
    draws: Counter[int] = field(default_factory=Counter)  # samples drawn so far, per prompt
    shutting_down: asyncio.Event = field(default_factory=asyncio.Event)
    resumed: asyncio.Event = field(default_factory=_set_event)  # cleared by vLLM's /pause
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

    def cached_tokens(self, prompt_ids: Sequence[int], output_ids: Sequence[int] = ()) -> int:
        """A radix cache's hit for this prompt (the longest prefix this engine has seen, at most
        len - 1); the prompt and the tokens generated after it are cached from now on (the fake
        decides a generation whole, so they are cached at its start)."""
        hit = self.prompt_cache.hit(prompt_ids)
        self.prompt_cache.add([*prompt_ids, *output_ids])
        return hit


STATE = web.AppKey("polar_mitm_fake_state", FakeBackendState)
