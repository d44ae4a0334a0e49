"""The engine client: HTTP to one policy front (an SGLang engine, SGLang's router, a vLLM
engine), whichever engine API it speaks (`polar_mitm.backends.sglang`,
`polar_mitm.backends.vllm`, `polar_mitm.backends.vllm_generate`: `APIS`, by
`PolicyConfig.backend_kind`'s words).

Every call carries the engine's API key (`Authorization: Bearer`, SGLang's and vLLM's
`--api-key`) when one is configured, and a generation carries its conversation's routing key
(`X-SMG-Routing-Key`, which the router's `manual` policy hashes to a worker), so every turn of a
conversation lands on the engine that holds its prefix cache. A generation is a `GenerateStream`:
one request whose server-sent events (`polar_mitm.sse`) fold into its state as they arrive.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal

import aiohttp

from polar_mitm import sse
from polar_mitm.backends import sglang, vllm, vllm_generate
from polar_mitm.backends.engine_api import (
    EngineAPI,
    EngineTimeout,
    EngineUnreachable,
    GenerateState,
    ModelInfo,
    ids_json,
    status_error,
)
from polar_mitm.neutral import ProviderError

_ALL: tuple[EngineAPI, ...] = (sglang, vllm, vllm_generate)
APIS: Mapping[str, EngineAPI] = MappingProxyType({api.NAME: api for api in _ALL})
# The header SGLang's router (0.3.x, "SMG") reads for sticky routing under `--policy manual`.
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"


class EngineClient:
    """One front's HTTP: its session, API key and info timeout; what it serves (`model_info`),
    whether an engine is alive, and its generations (`generate`, and `chat` in chat mode)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float | None = None,
        api_key: str | None = None,
        kind: Literal["auto", "sglang", "vllm", "vllm-generate"] = "auto",
        timeout_option: str = "",
    ):
        """`timeout`: seconds an info request (/model_info, /get_server_info, /v1/models) may take
        (`timeout_option`: the option that set it, named when one times out).
        Generations are timed by their caller, which knows whether it awaits a first token (that
        can take minutes on a busy engine) or the next one. `api_key`: sent as a bearer token on
        every call (the engine's or the router's `--api-key`). `kind`: the engine API the front
        speaks; auto: SGLang's endpoints first, then vLLM's model card (`vllm`, never
        `vllm-generate`: that one is asked for by name)."""
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.timeout_option = timeout_option
        self.kind = kind
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    def headers(self, routing_key: str | None = None) -> dict[str, str]:
        """The headers of every call: the API key, and for a generation its routing key."""
        if routing_key is None:
            return self._auth
        return {**self._auth, ROUTING_KEY_HEADER: routing_key}

    async def _http(self) -> aiohttp.ClientSession:
        if self._closed:  # a session opened now would never be closed
            raise ProviderError("overloaded", "polar-mitm is shutting down; retry the request", 529)
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                connector=aiohttp.TCPConnector(limit=0),
            )
        return self._session

    def _info_timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.timeout or None, sock_connect=10)

    async def close(self) -> None:
        """Close the connections; the client makes no call after this."""
        self._closed = True
        if self._session is not None:
            await self._session.close()

    # -- what the front serves ------------------------------------------------------------------

    async def model_info(self, url: str | None = None) -> ModelInfo:
        """What the front at `url` (default: ours) serves, read by its engine API (with `kind`
        auto: SGLang's, and vLLM's where the front answers no SGLang model info but a vLLM
        model card). Raises NoWorkers while a router has none."""
        base = (url or self.base_url).rstrip("/")
        try:
            if self.kind != "auto":
                return await APIS[self.kind].model_info(self, base)
            try:
                return await sglang.model_info(self, base)
            except sglang.NotSGLang:
                if await vllm.serves(self, base):
                    return await vllm.model_info(self, base)
                raise
        except TimeoutError:
            raise EngineTimeout(base, "its model info", self.timeout, self.timeout_option) from None
        except (aiohttp.ClientError, OSError) as e:
            raise EngineUnreachable(base, e) from e

    async def weight_version(self, api: EngineAPI, url: str | None = None) -> str | None:
        """The weight version the engine at `url` (default: ours) serves now, asked in `api`'s
        words; None where it serves none (`EngineAPI.weight_version`). Raises EngineTimeout or
        EngineUnreachable when it does not answer."""
        base = (url or self.base_url).rstrip("/")
        try:
            return await api.weight_version(self, base)  # a timeout is EngineTimeout already
        except (aiohttp.ClientError, OSError) as e:
            raise EngineUnreachable(base, e) from e

    async def get_json(self, base: str, path: str, *, optional: bool = False) -> dict[str, Any]:
        """An info endpoint's JSON object; {} when the server lacks it or answers oddly. SGLang
        reports server args in /get_server_info and max_model_len in /v1/models.

        A server that does not answer at all is not one that lacks the endpoint: the timeout is
        raised (EngineTimeout), and a failed connection too, unless the call is `optional` (a
        worker the router lists may not be reachable from here)."""
        http = await self._http()
        try:
            async with http.get(f"{base}{path}", headers=self._auth, timeout=self._info_timeout()) as r:
                if r.status == 200:
                    value = await r.json(content_type=None)
                    return value if isinstance(value, dict) else {}
        except TimeoutError:
            if not optional:
                raise EngineTimeout(base, f"GET {path}", self.timeout, self.timeout_option) from None
        except (aiohttp.ClientConnectionError, OSError):
            if not optional:
                raise
        except (aiohttp.ClientError, ValueError):
            pass
        return {}

    async def get_text(self, base: str, path: str) -> tuple[int, str]:
        """(status, body) of a GET within the info timeout (EngineTimeout past it)."""
        http = await self._http()
        try:
            async with http.get(f"{base}{path}", headers=self._auth, timeout=self._info_timeout()) as r:
                return r.status, await r.text()
        except TimeoutError:
            raise EngineTimeout(base, f"GET {path}", self.timeout, self.timeout_option) from None

    async def post_json(self, base: str, path: str, body: dict[str, Any], *, timeout: float | None) -> Any:
        """The JSON a 200 answer to a POST holds; {} for any other answer, or none at all."""
        try:
            status, text = await self.post_text(base, path, body, timeout=timeout)
            return json.loads(text) if status == 200 else {}
        except (aiohttp.ClientError, OSError, EngineTimeout, ValueError):
            return {}

    async def post_text(
        self, base: str, path: str, body: dict[str, Any], *, timeout: float | None
    ) -> tuple[int, str]:
        """(status, body) of a POST within `timeout` (EngineTimeout past it)."""
        http = await self._http()
        try:
            async with http.post(
                f"{base}{path}",
                json=body,
                headers=self._auth,
                timeout=aiohttp.ClientTimeout(total=timeout, sock_connect=10),
            ) as r:
                return r.status, await r.text()
        except TimeoutError:
            raise EngineTimeout(base, f"POST {path}", timeout, self.timeout_option) from None

    async def alive(self, url: str, path: str, timeout: float) -> bool:
        """Whether the engine at `url` answers `path` (its liveness check: SGLang's
        /health_generate runs a token through the scheduler, vLLM's /health) with 200 in time."""
        http = await self._http()
        try:
            async with http.get(
                f"{url}{path}", headers=self._auth, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as r:
                await r.read()
                return r.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False

    # -- generations ----------------------------------------------------------------------------

    async def chat(
        self, body: dict[str, Any], *, url: str | None = None, routing_key: str | None = None
    ) -> dict[str, Any]:
        """POST /v1/chat/completions (chat backend mode), errors mapped like a generation's."""
        http = await self._http()
        base = url or self.base_url
        try:
            async with http.post(
                f"{base}/v1/chat/completions", json=body, headers=self.headers(routing_key)
            ) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise status_error(resp.status, text)
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise EngineUnreachable(base, e) from e
        try:
            return json.loads(text)
        except ValueError as e:
            raise ProviderError(
                "api_error", f"policy backend returned unreadable JSON: {text[:200]!r}", 502
            ) from e

    def generate(
        self,
        api: EngineAPI,
        input_ids: list[int] | bytes,
        params: dict[str, Any],
        *,
        stream: bool = True,
        cumulative: bool | None = None,
        url: str | None = None,
        routing_key: str | None = None,
    ) -> GenerateStream:
        """One generation in `api`'s words (`params` from its `sampling_params`), not yet sent
        (`GenerateStream.next` sends it). `input_ids` may come already serialized (`ids_json`),
        so a long conversation is not re-serialized every turn. `stream=False` asks for the whole
        reply at once; `cumulative` says how the server streams (None: decided from its second
        chunk). `url`: the engine (default: ours); `routing_key`: the conversation's, for a router."""
        ids = input_ids if isinstance(input_ids, bytes) else ids_json(input_ids)
        headers = {"Content-Type": "application/json", **self.headers(routing_key)}
        return GenerateStream(
            self, api, api.body(ids, params, stream), stream, cumulative, url or self.base_url, headers
        )


class GenerateStream:
    """One generation request on its way. A reader task (one per generation) sends it and folds
    what arrives into `state`; `next` waits for news. Chunks that arrive together come out as one
    piece of news, and of cumulative chunks that arrive together only the last is parsed: it
    repeats the others."""

    def __init__(
        self,
        client: EngineClient,
        api: EngineAPI,
        body: bytes,
        stream: bool,
        cumulative: bool | None,
        url: str,
        headers: dict[str, str],
    ):
        self.client = client
        self.api = api
        self.url = url
        self.headers = headers
        self.body = body
        self.streamed = stream
        self.state = GenerateState(cumulative)
        self.finished = False  # the reply ended (or failed); `next` says which
        self._text: list[str] = []  # text not yet handed out by `next`
        self._news = asyncio.Event()
        self._ended = asyncio.Event()  # the last chunk (one with a finish reason) or the end came
        self._task: asyncio.Task | None = None
        self._handed = float("-inf")  # loop time of the last news handed out

    async def next(self, timeout: float | None, hold: float = 0.0) -> str | None:
        """The text added since the last call, once anything arrived (or the reply ended; then
        `finished` is set); None when nothing did within `timeout` seconds. With `hold`, news comes
        at most every `hold` seconds until the last chunk (which comes at once): what streams in
        meanwhile is handed out together, so a fast stream costs its reader fewer, larger events.

        Raises ProviderError when the backend is down, refuses, or the stream breaks; the tokens
        that arrived before stay in `state`."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._read())
        if not self._news.is_set():
            if timeout is not None and timeout <= 0:
                return None
            try:
                # A timeout around the wait, not a task per chunk: cancelling an Event wait is free.
                await asyncio.wait_for(self._news.wait(), timeout)
            except TimeoutError:
                return None
        if hold > 0 and not self._ended.is_set():
            loop = asyncio.get_running_loop()
            rest = self._handed + hold - loop.time()
            if rest > 0:
                try:
                    await asyncio.wait_for(self._ended.wait(), rest)
                except TimeoutError:
                    pass
            self._handed = loop.time()
        self._news.clear()
        if self._task.done() and not self._task.cancelled() and self._task.exception() is not None:
            raise self._task.exception()  # type: ignore[misc]
        text = "".join(self._text)
        self._text.clear()
        return text

    async def aclose(self) -> None:
        """Stop reading (closing the connection aborts the generation on the server)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.wait({self._task})

    async def _read(self) -> None:
        try:
            http = await self.client._http()
            try:
                resp = await http.post(
                    f"{self.url}{self.api.GENERATE_PATH}", data=self.body, headers=self.headers
                )
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                raise EngineUnreachable(self.url, e) from e
            async with resp:
                if resp.status != 200:
                    raise status_error(resp.status, await resp.text())
                try:
                    if self.streamed:
                        await self._read_events(resp.content)
                    else:
                        self._fold(await resp.read())
                except (TimeoutError, aiohttp.ClientError, OSError) as e:
                    raise ProviderError("overloaded", f"policy backend stream broke: {e}", 529) from e
        finally:
            self.finished = True
            self._ended.set()
            self._news.set()

    async def _read_events(self, content: aiohttp.StreamReader) -> None:
        reader = sse.Reader()
        done = False
        async for data in content.iter_any():
            if done:
                continue  # drain to the end, so the connection can be reused
            payloads = reader.data(data)
            if payloads and payloads[-1] == b"[DONE]":
                done = True
                payloads.pop()
            if self.state.cumulative and len(payloads) > 1:
                payloads = payloads[-1:]
            for payload in payloads:
                self._fold(payload)
            if payloads:
                self._news.set()

    def _fold(self, payload: bytes) -> None:
        text = self.api.fold(self.state, payload)
        if text:
            self._text.append(text)
        if self.state.finish_reason is not None:
            self._ended.set()
        self._news.set()
