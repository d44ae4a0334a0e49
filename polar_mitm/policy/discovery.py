"""What the policy learns from its engines before a turn: the model's info (tokenizer path,
parsers, context length, how it streams), the tokenizer itself, and which engine API it speaks.

Each is asked once and kept; with several engines the first that answers is asked. Every lazy
load is single-flight (`polar_mitm.once.Flights`): the first caller starts it, the callers
meanwhile wait for that one (the tokenizer is loaded once, in a worker thread with its chat
template compiled, however many turns arrive at once), and a failed load is tried again by the
next caller. The info the
preflight read is handed in and never asked again. Asking is bounded by the liveness budget
(`engine_dead_after`): a hung engine costs a turn that long, not one `idle_timeout` per info
call. A failed ask is kept for a pause that grows (`retry.delays`, Backoff's schedule), so the
turns meanwhile fail at once with its error, and the next ask after the pause tries again.

An engine that does not answer (refused, timed out) fails the turn; one that answers without the
info a turn can do without (its parsers, context length, streaming mode) leaves the defaults."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from polar_mitm import retry
from polar_mitm.backends.engine_api import EngineAPI, EngineTimeout, EngineUnreachable, ModelInfo, NoWorkers
from polar_mitm.backends.engine_client import APIS, EngineClient
from polar_mitm.backends.engines import EnginePool
from polar_mitm.backends.large_inputs import pooled
from polar_mitm.backends.parsers import check_reasoning_parser, check_tool_parser
from polar_mitm.backends.tokenizer import Tokenizer
from polar_mitm.neutral import ProviderError
from polar_mitm.once import Flights
from polar_mitm.policy.config import PolicyConfig

# After a failed ask: no other for 1 s, then 2, 4 … at most 15 s (the pauses reset once one answers).
RETRY_FIRST, RETRY_CAP = 1.0, 15.0


def _unanswered(e: ProviderError) -> bool:
    """The engine did not answer at all (or has no worker): no turn can go on without it."""
    return isinstance(e, (EngineUnreachable, NoWorkers))


class Discovery:
    """The engines' model info, tokenizer and parsers, each asked for once and kept."""

    def __init__(
        self, config: PolicyConfig, client: EngineClient, engines: EnginePool, info: ModelInfo | None = None
    ):
        self.config = config
        self.client = client
        self.engines = engines
        # Under the keys "tokenizer" and "info": each load once, shared by the callers meanwhile.
        self._loads: Flights[str, Any] = Flights()
        self._failed: ProviderError | None = None
        self._retry_at = float("-inf")  # loop time before which `_failed` is raised unasked
        self._pauses: Iterator[float] = retry.delays(RETRY_FIRST, cap=RETRY_CAP)
        if info is not None:
            self._keep(info)

    @property
    def budget(self) -> float | None:
        """Seconds one ask for the model info may take: the liveness budget (else the idle limit)."""
        return self.config.engine_dead_after or self.config.idle_timeout or None

    @property
    def _info(self) -> ModelInfo | None:
        return self._loads.kept("info")

    @_info.setter
    def _info(self, info: ModelInfo) -> None:
        self._loads.keep("info", info)

    @property
    def _tok(self) -> Tokenizer | None:
        return self._loads.kept("tokenizer")

    def _keep(self, info: ModelInfo) -> None:
        self._info = info
        self.engines.health_path = self.known_api().HEALTH_PATH

    async def model_info(self) -> ModelInfo:
        info = self._info
        if info is not None:
            return info
        if self._failed is not None and asyncio.get_running_loop().time() < self._retry_at:
            raise self._failed
        return await self._loads.get("info", self._ask)

    async def _ask(self) -> ModelInfo:
        """Ask the engines (the live first) until one answers, within `budget` seconds in all."""
        err: ProviderError | None = None
        engines = sorted(self.engines.engines, key=lambda e: e.dead)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.budget):
                for engine in engines:
                    try:
                        info = await self.client.model_info(engine.url)
                    except ProviderError as e:  # with several engines, the first that answers
                        err = e
                        continue
                    self._keep(info)
                    self._failed, self._pauses = None, retry.delays(RETRY_FIRST, cap=RETRY_CAP)
                    return info
        except TimeoutError:
            err = EngineTimeout(engines[0].url, "its model info", self.budget, "--engine-dead-after")
        assert err is not None
        self._failed, self._retry_at = err, loop.time() + next(self._pauses)
        raise err

    async def engine_kind(self) -> str:
        """ "vllm" or "sglang" (a router in front of SGLang engines speaks SGLang's API)."""
        if self.config.backend_kind != "auto":
            return self.config.backend_kind
        try:
            return "vllm" if (await self.model_info()).front == "vllm" else "sglang"
        except ProviderError as e:
            if _unanswered(e):
                raise
            return "sglang"

    async def engine_api(self) -> EngineAPI:
        """The engine API generations are asked in (`engine_kind`'s)."""
        return APIS[await self.engine_kind()]

    def known_api(self) -> EngineAPI:
        """The engine API as far as it is known without asking the engines (chat mode asks them
        nothing): the configured one, else the one the kept model info shows, else SGLang's."""
        if self.config.backend_kind != "auto":
            return APIS[self.config.backend_kind]
        return APIS["vllm" if self._info is not None and self._info.front == "vllm" else "sglang"]

    async def context_length(self) -> int | None:
        if self.config.context_length:
            return self.config.context_length
        try:
            return (await self.model_info()).context_length
        except ProviderError as e:
            if _unanswered(e):
                raise
            return None

    async def logprobs_mode(self, ask: bool = True) -> str | None:
        """What the engine's logprobs are of (`polar_mitm.backends.logprobs`); None: unknown.
        Without `ask`, only what is known already (chat mode asks the engine for nothing else)."""
        if not ask:
            return self._info.logprobs_mode if self._info is not None else None
        try:
            return (await self.model_info()).logprobs_mode
        except ProviderError as e:
            if _unanswered(e):
                raise
            return None

    async def backend_streaming(self) -> tuple[bool, bool | None]:
        """(whether to stream from the backend, whether its chunks are cumulative; None: unknown),
        from `backend_stream` and what the server reports."""
        if self.config.backend_stream == "whole":
            return False, None
        try:
            incremental = (await self.model_info()).incremental_streaming_output
        except ProviderError as e:
            if _unanswered(e):
                raise
            incremental = None
        cumulative = None if incremental is None else not incremental
        return self.config.backend_stream == "stream" or incremental is True, cumulative

    async def tokenizer(self) -> Tokenizer:
        """The policy's tokenizer, loaded once (single-flight: see the module)."""
        tok = self._tok
        return tok if tok is not None else await self._loads.get("tokenizer", self._load_tokenizer)

    async def _load_tokenizer(self) -> Tokenizer:
        path = self.config.tokenizer
        if path is None:
            path = (await self.model_info()).tokenizer_path
            if not path or not Path(path).is_dir():
                raise ProviderError(
                    "api_error",
                    f"no tokenizer: the backend reports tokenizer_path={path!r}, which is not a local "
                    "directory; pass --tokenizer DIR (or POLAR_MITM_TOKENIZER)",
                    500,
                )
        # Off the event loop (a second of a core; its chat template compiled there too), and long
        # texts are tokenized in worker processes, so neither stalls other sessions' streams.
        where = os.path.expanduser(path)
        loaded = await asyncio.to_thread(lambda: Tokenizer.load(where).ready())
        return pooled(loaded)

    async def parsers(self) -> tuple[str | None, str | None]:
        """(tool parser, reasoning parser): the configured ones, else the server's, else qwen's."""
        tp, rp = self.config.tool_parser, self.config.reasoning_parser
        if tp is None or rp is None:
            try:
                info = await self.model_info()
            except ProviderError as e:
                if _unanswered(e):
                    raise
                info = ModelInfo()
            tp = tp if tp is not None else (info.tool_call_parser or "qwen25")
            rp = rp if rp is not None else (info.reasoning_parser or "qwen3")
        try:
            return check_tool_parser(tp), check_reasoning_parser(rp)
        except ValueError as e:  # e.g. a parser the server reports that we do not implement
            raise ProviderError(
                "api_error", f"policy output parsing: {e}; pass --tool-parser / --reasoning-parser", 500
            ) from None
