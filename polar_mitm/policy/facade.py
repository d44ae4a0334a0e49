"""`Policy`: the one object the gateway and the service hold — a neutral ChatRequest in, a stream
of neutral events out. It wires the rooms of this package together and keeps their public
surface in one place: discovery (what the engines are), the weight-sync gate, prompts (render,
splice, their caches), generation (render and chat mode) and the turn record."""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import AsyncGenerator

from polar_mitm.backends.engine_api import ModelInfo
from polar_mitm.backends.engine_client import EngineClient
from polar_mitm.backends.engines import EnginePool
from polar_mitm.backends.tokenizer import Tokenizer
from polar_mitm.neutral import ChatRequest, Completion, Done, Event, ProviderError
from polar_mitm.policy.admission import Admission
from polar_mitm.policy.config import PolicyConfig, TurnContext
from polar_mitm.policy.discovery import Discovery
from polar_mitm.policy.gate import WeightGate
from polar_mitm.policy.generate import Generation
from polar_mitm.policy.prompt import Prompts
from polar_mitm.policy.versions import WeightVersions
from polar_mitm.store.writer import Store

log = logging.getLogger("polar_mitm.policy")

# Seconds `close` waits for a turn that another task is still ending before it ends the others.
CLOSE_WAIT = 2.0


class Policy:
    """A neutral request in, a stream of neutral events out, every turn stored; one per proxy."""

    def __init__(self, config: PolicyConfig, store: Store, *, model_info: ModelInfo | None = None):
        """`model_info`: what the preflight read from the engines, kept instead of asked again."""
        self.config = config
        self.store = store
        # Info requests (/model_info …) are small: an engine that does not answer one within its
        # liveness budget is as dead as one that fails its probes (without probing, the idle limit).
        urls = config.backend_urls or [config.backend_url]
        self.client = EngineClient(
            urls[0],
            timeout=config.engine_dead_after or config.idle_timeout,
            timeout_option="--engine-dead-after" if config.engine_dead_after else "--idle-timeout",
            api_key=config.backend_api_key,
            kind=config.backend_kind,
        )
        self.engines = EnginePool(urls, self.client.alive, interval=config.engine_probe_interval or 5.0)
        self.discovery = Discovery(config, self.client, self.engines, model_info)
        # The engines' liveness check is their API's (discovery sets it again from the model info).
        self.engines.health_path = self.discovery.known_api().HEALTH_PATH
        self.weights = WeightGate(config.ping_interval)
        self.versions = WeightVersions(self.client)
        if model_info is not None and model_info.front == "vllm" and model_info.weight_version is None:
            self.versions.absent(urls[0])  # the preflight said so
        self.prompts = Prompts(config, store, self.discovery)
        self.admission = Admission(config, self.discovery)
        self.generation = Generation(
            config,
            store,
            self.client,
            self.engines,
            self.discovery,
            self.prompts,
            self.weights,
            self.versions,
            self.admission,
        )
        self._turns: weakref.WeakSet[AsyncGenerator[Event, None]] = weakref.WeakSet()  # streams under way
        self._closing = False

    # -- weight sync -----------------------------------------------------------------------------

    @property
    def gate(self) -> asyncio.Event:
        """Set while generations may start."""
        return self.weights.event

    @property
    def generating(self) -> int:
        """Generations under way."""
        return self.weights.generating

    @property
    def at_gate(self) -> int:
        """Turns waiting at the closed gate now (read-only: a paused service, or a test, sees that
        a call arrived and is held rather than guessing from elapsed time)."""
        return self.weights.waiting

    def pause(self) -> None:
        """Start no new generation until `resume` (those under way finish)."""
        self.weights.pause()

    def resume(self) -> None:
        """Open the gate; vLLM's weight version is read again (the trainer may have set another)."""
        self.versions.stale()
        self.weights.resume()

    # -- what the engines are --------------------------------------------------------------------

    async def model_info(self) -> ModelInfo:
        return await self.discovery.model_info()

    async def engine_kind(self) -> str:
        return await self.discovery.engine_kind()

    async def context_length(self) -> int | None:
        return await self.discovery.context_length()

    async def tokenizer(self) -> Tokenizer:
        return await self.discovery.tokenizer()

    async def parsers(self) -> tuple[str | None, str | None]:
        return await self.discovery.parsers()

    # -- prompts and generation ------------------------------------------------------------------

    async def prompt(self, req: ChatRequest, session_id: str) -> tuple[list[int], str | None, int, list[str]]:
        """(prompt ids, referenced turn, tokens reused from it, conversation hashes)."""
        return await self.prompts.prompt(req, session_id)

    async def admit(self, raw: bytes) -> None:
        """Refuse, from a model call's body alone (before it is parsed), a prompt that cannot fit
        the context (`Admission.body`); the rest of the admission runs with the turn."""
        await self.admission.body(raw)

    async def count_tokens(self, req: ChatRequest) -> int:
        return await self.prompts.count_tokens(req)

    def stream(self, req: ChatRequest, ctx: TurnContext) -> AsyncGenerator[Event, None]:
        if self._closing:
            raise ProviderError("overloaded", "polar-mitm is shutting down; retry the request", 529)
        if self.config.backend_mode == "chat":
            events = self.generation.stream_chat(req, ctx)
        else:
            events = self.generation.stream(req, ctx)
        self._turns.add(events)
        return events

    async def complete(self, req: ChatRequest, ctx: TurnContext) -> Completion:
        async for ev in self.stream(req, ctx):
            if isinstance(ev, Done):
                return ev.completion
        raise ProviderError("api_error", "generation ended without a result", 500)

    async def close(self) -> None:
        """Stop: every turn still under way is ended first (each stores what it sampled, or logs
        that it had nothing to store) while the store is open; the caller closes the store after."""
        self._closing = True
        await self._end_turns()
        await self.versions.close()
        await self.engines.close()
        await self.client.close()

    async def _end_turns(self) -> None:
        """Close the turns' streams that nobody closed (a handler cancelled at shutdown, a reader
        gone). One that a task is ending right now is waited for, up to CLOSE_WAIT seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CLOSE_WAIT
        while any(getattr(t, "ag_running", False) for t in self._turns) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for events in list(self._turns):
            if getattr(events, "ag_running", False):
                log.warning("stopping while a turn is still being ended elsewhere; it may not be stored")
                continue
            try:
                await events.aclose()  # type: ignore[attr-defined]
            except Exception:
                log.exception("could not end a turn under way at shutdown")
