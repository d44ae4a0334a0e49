"""What the policy learns from its engines before a turn: the model's info (tokenizer path,
parsers, context length, how it streams), the tokenizer itself, and which engine API it speaks.

Each is asked once and kept; with several engines the first that answers is asked."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from polar_mitm.backends.engines import EnginePool
from polar_mitm.backends.large_inputs import pooled
from polar_mitm.backends.parsers import check_reasoning_parser, check_tool_parser
from polar_mitm.backends.sglang import ModelInfo, SGLangClient
from polar_mitm.backends.tokenizer import Tokenizer
from polar_mitm.neutral import ProviderError
from polar_mitm.policy.config import PolicyConfig


class Discovery:
    """The engines' model info, tokenizer and parsers, each asked for once and kept."""

    def __init__(self, config: PolicyConfig, client: SGLangClient, engines: EnginePool):
        self.config = config
        self.client = client
        self.engines = engines
        self._tok: Tokenizer | None = None
        self._info: ModelInfo | None = None

    async def model_info(self) -> ModelInfo:
        if self._info is None:
            err: ProviderError | None = None
            for engine in sorted(self.engines.engines, key=lambda e: e.dead):
                try:
                    self._info = await self.client.model_info(engine.url)
                    break
                except ProviderError as e:  # with several engines, the first that answers
                    err = e
            if self._info is None:
                assert err is not None
                raise err
            self.engines.kind = "vllm" if self._info.front == "vllm" else "sglang"
        return self._info

    async def engine_kind(self) -> str:
        """ "vllm" or "sglang" (a router in front of SGLang engines speaks SGLang's API)."""
        if self.config.backend_kind != "auto":
            return self.config.backend_kind
        try:
            return "vllm" if (await self.model_info()).front == "vllm" else "sglang"
        except ProviderError:
            return "sglang"

    async def context_length(self) -> int | None:
        if self.config.context_length:
            return self.config.context_length
        try:
            return (await self.model_info()).context_length
        except ProviderError:
            return None

    async def backend_streaming(self) -> tuple[bool, bool | None]:
        """(whether to stream from the backend, whether its chunks are cumulative; None: unknown),
        from `backend_stream` and what the server reports."""
        if self.config.backend_stream == "whole":
            return False, None
        try:
            incremental = (await self.model_info()).incremental_streaming_output
        except ProviderError:
            incremental = None
        cumulative = None if incremental is None else not incremental
        return self.config.backend_stream == "stream" or incremental is True, cumulative

    async def tokenizer(self) -> Tokenizer:
        if self._tok is None:
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
            # Long texts are tokenized in worker processes, so they stall no other session.
            self._tok = pooled(await asyncio.to_thread(Tokenizer.load, os.path.expanduser(path)))
        return self._tok

    async def parsers(self) -> tuple[str | None, str | None]:
        """(tool parser, reasoning parser): the configured ones, else the server's, else qwen's."""
        tp, rp = self.config.tool_parser, self.config.reasoning_parser
        if tp is None or rp is None:
            try:
                info = await self.model_info()
            except ProviderError:
                info = ModelInfo()
            tp = tp if tp is not None else (info.tool_call_parser or "qwen25")
            rp = rp if rp is not None else (info.reasoning_parser or "qwen3")
        try:
            return check_tool_parser(tp), check_reasoning_parser(rp)
        except ValueError as e:  # e.g. a parser the server reports that we do not implement
            raise ProviderError(
                "api_error", f"policy output parsing: {e}; pass --tool-parser / --reasoning-parser", 500
            ) from None
