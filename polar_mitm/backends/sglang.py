"""Client for an SGLang policy server's native API (`/generate`, `/model_info`).

Only SGLang's own names go over the wire: `input_ids`, `sampling_params` with SGLang keys,
`return_logprob`; we read `output_ids`, `meta_info.output_token_logprobs`,
`meta_info.finish_reason` and `meta_info.weight_version`, and keep them exactly.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from pydantic import BaseModel, Field

from polar_mitm.neutral import ProviderError, Sampling


class ModelInfo(BaseModel):
    model_path: str = ""
    tokenizer_path: str | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    weight_version: str | None = None
    context_length: int | None = None


class GenerateChunk(BaseModel):
    """The cumulative state of one generation after a streamed chunk (or at the end)."""

    text: str = ""
    output_ids: list[int] = Field(default_factory=list)
    output_logprobs: list[float] = Field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    weight_version: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    chunks: int = 0
    cumulative: bool | None = None  # decided at the second chunk


def sampling_params(s: Sampling, *, default_max_tokens: int) -> dict[str, Any]:
    """Map neutral sampling settings to SGLang's names; unknown keys are a 400 there."""
    out: dict[str, Any] = {"max_new_tokens": s.max_tokens if s.max_tokens is not None else default_max_tokens}
    if s.temperature is not None:
        out["temperature"] = s.temperature
    if s.top_p is not None:
        out["top_p"] = s.top_p
    if s.top_k is not None:
        out["top_k"] = s.top_k
    if s.stop:
        out["stop"] = list(s.stop)
    if s.json_schema is not None:
        out["json_schema"] = json.dumps(s.json_schema)
    # Special tokens such as <tool_call> must survive in `text` for the output parsers; SGLang
    # keeps added non-special tokens either way, and the ids are what we train on.
    return out


class SGLangClient:
    def __init__(self, base_url: str, *, timeout: float | None = None):
        """`timeout`: seconds an info request (/model_info, /get_server_info, /v1/models) may take.
        Generations are timed by their caller, which knows whether it awaits a first token (that
        can take minutes on a busy engine) or the next one."""
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    async def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                connector=aiohttp.TCPConnector(limit=0),
            )
        return self._session

    def _info_timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.timeout or None, sock_connect=10)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def model_info(self) -> ModelInfo:
        http = await self._http()
        try:
            async with http.get(f"{self.base_url}/model_info", timeout=self._info_timeout()) as r:
                r.raise_for_status()
                info = ModelInfo.model_validate(await r.json(content_type=None))
            if info.context_length is None:
                info.context_length = await self._context_length(http)
            return info
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            raise self._unreachable(e) from e

    async def _context_length(self, http: aiohttp.ClientSession) -> int | None:
        """SGLang reports it in /get_server_info (server args) and /v1/models (max_model_len)."""
        for path, pick in (
            ("/get_server_info", lambda d: d.get("context_length")),
            ("/v1/models", lambda d: (d.get("data") or [{}])[0].get("max_model_len")),
        ):
            try:
                async with http.get(f"{self.base_url}{path}", timeout=self._info_timeout()) as r:
                    if r.status == 200:
                        value = pick(await r.json(content_type=None))
                        if isinstance(value, int) and value > 0:
                            return value
            except (
                aiohttp.ClientError,
                OSError,
                TimeoutError,
                ValueError,
                AttributeError,
                IndexError,
            ):
                continue
        return None

    def _unreachable(self, e: BaseException) -> ProviderError:
        return ProviderError(
            "overloaded", f"policy backend {self.base_url} is unreachable ({e.__class__.__name__}: {e})", 529
        )

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/chat/completions (chat backend mode), errors mapped like /generate."""
        http = await self._http()
        try:
            async with http.post(f"{self.base_url}/v1/chat/completions", json=body) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise status_error(resp.status, text)
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise self._unreachable(e) from e
        try:
            return json.loads(text)
        except ValueError as e:
            raise ProviderError(
                "api_error", f"policy backend returned unreadable JSON: {text[:200]!r}", 502
            ) from e

    async def generate(self, input_ids: list[int], params: dict[str, Any]) -> AsyncIterator[GenerateChunk]:
        """Stream one generation. Yields the cumulative state after every chunk.

        Raises ProviderError before the first chunk when the backend is down or refuses.
        """
        http = await self._http()
        body = {"input_ids": input_ids, "sampling_params": params, "return_logprob": True, "stream": True}
        try:
            resp = await http.post(f"{self.base_url}/generate", json=body)
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            raise self._unreachable(e) from e
        async with resp:
            if resp.status != 200:
                raise status_error(resp.status, await resp.text())
            state = GenerateChunk()
            buf = b""
            try:
                async for data in resp.content.iter_any():
                    buf += data
                    while b"\n\n" in buf:
                        event, buf = buf.split(b"\n\n", 1)
                        for line in event.split(b"\n"):
                            if not line.startswith(b"data:"):
                                continue
                            payload = line[5:].strip()
                            if payload == b"[DONE]":
                                return
                            state = _apply_chunk(state, payload)
                            yield state
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                raise ProviderError("overloaded", f"policy backend stream broke: {e}", 529) from e


def status_error(status: int, body: str) -> ProviderError:
    """A non-200 answer from the backend, as the error the harness should see."""
    detail = body[:2000]
    if status in (400, 422):
        return ProviderError("invalid_request", f"policy backend rejected the request: {detail}", 400)
    if status in (429, 503):
        return ProviderError("overloaded", f"policy backend answered HTTP {status}: {detail}", 529)
    return ProviderError("api_error", f"policy backend answered HTTP {status}: {detail}", 500)


def _apply_chunk(state: GenerateChunk, payload: bytes) -> GenerateChunk:
    try:
        obj = json.loads(payload)
        meta = obj.get("meta_info") or {}
        if "error" in obj and "text" not in obj:
            err = obj["error"]
            code = err.get("code") if isinstance(err, dict) else None
            message = err.get("message", err) if isinstance(err, dict) else err
            if code in (400, 422):
                raise ProviderError("invalid_request", f"policy backend rejected the request: {message}", 400)
            raise ProviderError("api_error", f"policy backend error: {message}", 500)
        text = obj["text"]
        ids = list(obj["output_ids"])
        lps = [float(t[0]) for t in meta.get("output_token_logprobs") or []]
    except ProviderError:
        raise
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise ProviderError(
            "api_error", f"policy backend returned an unreadable chunk: {payload[:200]!r}", 502
        ) from e
    # SGLang streams cumulative state by default and increments with --incremental-streaming-output;
    # accept both, deciding once at the second chunk.
    acc = state.output_ids
    cumulative = state.cumulative
    if state.chunks == 1 and cumulative is None:
        cumulative = len(ids) > len(acc) and ids[: len(acc)] == acc
    if state.chunks == 0 or cumulative:
        new_ids, new_lps, new_text = ids, lps, text
    else:
        new_ids = acc + ids
        new_lps = state.output_logprobs + lps
        new_text = state.text + text
    if len(new_lps) != len(new_ids):
        raise ProviderError(
            "api_error",
            f"policy backend returned {len(new_ids)} output ids but {len(new_lps)} logprobs; "
            "is return_logprob supported?",
            502,
        )
    return GenerateChunk(
        text=new_text,
        output_ids=new_ids,
        output_logprobs=new_lps,
        finish_reason=meta.get("finish_reason"),
        weight_version=meta.get("weight_version", state.weight_version),
        prompt_tokens=meta.get("prompt_tokens", state.prompt_tokens),
        cached_tokens=meta.get("cached_tokens", state.cached_tokens),
        chunks=state.chunks + 1,
        cumulative=cumulative,
    )
