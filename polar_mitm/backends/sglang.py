"""Client for an SGLang policy server's native API (`/generate`, `/model_info`), directly or
behind SGLang's router (`sglang-router`).

Only SGLang's own names go over the wire: `input_ids`, `sampling_params` with SGLang keys,
`return_logprob`; we read `output_ids`, `meta_info.output_token_logprobs`,
`meta_info.finish_reason` and `meta_info.weight_version`, and keep them exactly.

Every call carries the engine's API key (`Authorization: Bearer`, SGLang's and vLLM's
`--api-key`) when one is configured, and a generation carries its conversation's routing key
(`X-SMG-Routing-Key`, which the router's `manual` policy hashes to a worker), so every turn of a
conversation lands on the engine that holds its prefix cache.

vLLM is spoken in its own names (render mode on vLLM): `POST /v1/completions` with the prompt as
token ids, `return_token_ids` (vLLM >= 0.10.2: `choices[].token_ids`, `prompt_token_ids`),
`logprobs` (`choices[].logprobs.token_logprobs`, the sampled tokens' logprobs), delta streaming;
its `finish_reason` / `stop_reason` are read into SGLang's finish-reason shape, so the policy
handles both engines alike. vLLM's replies name no weight version: where it serves `GET
/weight_info` (`VLLM_SERVER_DEV_MODE=1`) `vllm_weight_version` reads the one it serves now (the
policy decides when, `polar_mitm.policy.versions`).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from typing import Any, Literal

import aiohttp
from pydantic import BaseModel

from polar_mitm import sse
from polar_mitm.backends import logprobs
from polar_mitm.neutral import ProviderError, Sampling

# Seconds the one-token probe of vLLM's logprobs mode may take at least (see _vllm_logprobs_mode).
PROBE_S = 60.0
# What opens vLLM's development endpoints (`/weight_info`, `/pause`, `/collective_rpc`, …).
VLLM_DEV_MODE = "start vLLM with VLLM_SERVER_DEV_MODE=1"
# The header SGLang's router (0.3.x, "SMG") reads for sticky routing under `--policy manual`.
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"


class EngineUnreachable(ProviderError):
    """The engine did not answer at the HTTP level (refused, reset, timed out): a retryable
    error for the harness, and for several engines a reason to move the conversation."""

    def __init__(self, url: str, e: BaseException):
        super().__init__(
            "overloaded", f"policy backend {url} is unreachable ({e.__class__.__name__}: {e})", 529
        )
        self.url = url


class EngineTimeout(EngineUnreachable):
    """The engine took the connection but did not answer in time: hung (a stopped process, a
    stuck scheduler) or overloaded, which a refused connection or an odd answer is not."""

    def __init__(self, url: str, what: str, seconds: float | None, option: str = ""):
        within = f" within {seconds:g} s" if seconds else ""
        ProviderError.__init__(
            self,
            "overloaded",
            f"policy backend {url} did not answer {what}{within}{f' ({option})' if option else ''}: "
            "the engine is hung or overloaded; retry the request",
            529,
        )
        self.url = url


class NoWorkers(ProviderError):
    """A router that has no (healthy) worker registered yet: SGLang's router answers 503
    `no_workers` until one has."""

    def __init__(self, url: str):
        super().__init__(
            "overloaded", f"the router at {url} has no healthy worker yet (503 no_workers); retry later", 529
        )
        self.url = url


class ModelInfo(BaseModel):
    model_path: str = ""
    tokenizer_path: str | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    weight_version: str | None = None
    context_length: int | None = None
    # From /get_server_info: whether streamed chunks hold only what is new (True) or everything
    # so far (False, SGLang's default); None when the server does not say.
    incremental_streaming_output: bool | None = None
    # What answered: "sglang" (an engine), "router" (sglang-router in front of `workers`).
    front: str = "sglang"
    workers: list[str] = []
    # Where the server info (context length, streaming mode) came from: "engine", "worker URL",
    # or "" when no engine said (then only the options say).
    server_info_from: str = ""
    # What the engine's logprobs are of (`polar_mitm.backends.logprobs.MODES`); None: unknown.
    logprobs_mode: str | None = None

    def describe(self) -> str:
        """One line naming the front, for the preflight."""
        if self.front == "vllm":
            version = (
                f"weight version {self.weight_version}"
                if self.weight_version is not None
                else f"no weight version: it serves no /weight_info ({VLLM_DEV_MODE})"
            )
            return (
                f"a vLLM engine (logprobs of the {self.logprobs_mode or 'unknown'} distribution; {version})"
            )
        if self.front == "router":
            where = f"; server info from worker {self.server_info_from}" if self.server_info_from else ""
            return f"an SGLang router with {len(self.workers)} worker(s){where}"
        return "an SGLang engine"


class GenerateState:
    """What one generation has produced so far. Chunks fold into it in place (no copies), so a
    reply of n tokens costs O(n) however many chunks bring it."""

    __slots__ = (
        "output_ids",
        "output_logprobs",
        "finish_reason",
        "weight_version",
        "prompt_tokens",
        "cached_tokens",
        "chunks",
        "cumulative",
        "_text",
    )

    def __init__(self, cumulative: bool | None = None):
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.finish_reason: dict[str, Any] | None = None
        self.weight_version: str | None = None
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.chunks = 0
        # Whether each chunk repeats everything so far (SGLang's default) or only adds to it
        # (--incremental-streaming-output); None: decided at the second chunk.
        self.cumulative = cumulative
        self._text: list[str] = []

    @property
    def text(self) -> str:
        if len(self._text) > 1:
            self._text[:] = ["".join(self._text)]
        return self._text[0] if self._text else ""


def _shared_params(s: Sampling) -> dict[str, Any]:
    """The sampling settings SGLang and vLLM spell alike: temperature, top_p, top_k, stop."""
    out: dict[str, Any] = {}
    if s.temperature is not None:
        out["temperature"] = s.temperature
    if s.top_p is not None:
        out["top_p"] = s.top_p
    if s.top_k is not None:
        out["top_k"] = s.top_k
    if s.stop:
        out["stop"] = list(s.stop)
    return out


def sampling_params(s: Sampling, *, default_max_tokens: int) -> dict[str, Any]:
    """Map neutral sampling settings to SGLang's names; unknown keys are a 400 there."""
    out: dict[str, Any] = {
        "max_new_tokens": s.max_tokens if s.max_tokens is not None else default_max_tokens,
        **_shared_params(s),
    }
    if s.json_schema is not None:
        out["json_schema"] = json.dumps(s.json_schema)
    # Special tokens such as <tool_call> must survive in `text` for the output parsers; SGLang
    # keeps added non-special tokens either way, and the ids are what we train on.
    return out


class SGLangClient:
    def __init__(
        self,
        base_url: str,
        *,
        timeout: float | None = None,
        api_key: str | None = None,
        kind: Literal["auto", "sglang", "vllm"] = "auto",
        timeout_option: str = "",
    ):
        """`timeout`: seconds an info request (/model_info, /get_server_info, /v1/models) may take
        (`timeout_option`: the option that set it, named when one times out).
        Generations are timed by their caller, which knows whether it awaits a first token (that
        can take minutes on a busy engine) or the next one. `api_key`: sent as a bearer token on
        every call (the engine's or the router's `--api-key`)."""
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.timeout_option = timeout_option
        self.kind = kind  # auto: SGLang's endpoints first, then vLLM's /v1/models
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

    async def model_info(self, url: str | None = None) -> ModelInfo:
        """What the front at `url` (default: ours) serves, read the way each front offers it.

        An engine answers /model_info (older SGLang only /get_model_info) and /get_server_info.
        SGLang's router answers /get_model_info from a worker, but /get_server_info is its own
        (`router_manager`, `workers_count`): the context length and the streaming mode come from a
        worker it lists at /workers. Raises NoWorkers while the router has none."""
        base = (url or self.base_url).rstrip("/")
        http = await self._http()
        try:
            if self.kind == "vllm":
                return await self._vllm_info(http, base)
            server = await self._get_json(http, base, "/get_server_info")
            info_from = "engine"
            workers: list[str] = []
            if server.get("router_manager"):
                listed = await self._get_json(http, base, "/workers")
                workers = [
                    w["url"]
                    for w in listed.get("workers") or []
                    if isinstance(w, dict) and isinstance(w.get("url"), str) and w.get("is_healthy", True)
                ]
                if not workers:
                    raise NoWorkers(base)
                server, info_from = {}, ""
                for worker in workers:  # the first that tells (a worker may sit behind its own key)
                    server = await self._get_json(http, worker.rstrip("/"), "/get_server_info", optional=True)
                    if server and not server.get("router_manager"):
                        info_from = worker
                        break
            info = await self._model_info(http, base)
            if info.front != "vllm":
                info.logprobs_mode = logprobs.SGLANG_MODE
            if workers:
                info.front, info.workers = "router", workers
            info.server_info_from = info_from if server else ""
            if isinstance(server.get("incremental_streaming_output"), bool):
                info.incremental_streaming_output = server["incremental_streaming_output"]
            if info.context_length is None:
                info.context_length = _positive(server.get("context_length"))
            if info.context_length is None:
                models = await self._get_json(http, base, "/v1/models", optional=True)
                try:
                    info.context_length = _positive(models["data"][0].get("max_model_len"))
                except (KeyError, IndexError, TypeError, AttributeError):
                    pass
            return info
        except TimeoutError:
            raise EngineTimeout(base, "its model info", self.timeout, self.timeout_option) from None
        except (aiohttp.ClientError, OSError) as e:
            raise EngineUnreachable(base, e) from e

    async def _model_info(self, http: aiohttp.ClientSession, base: str) -> ModelInfo:
        """/model_info, else /get_model_info (SGLang's older name, and the router's only one);
        with neither, vLLM's model card when `kind` allows it."""
        for path in ("/model_info", "/get_model_info"):
            try:
                async with http.get(f"{base}{path}", headers=self._auth, timeout=self._info_timeout()) as r:
                    if r.status == 404:
                        continue
                    text = await r.text()
            except TimeoutError:
                raise EngineTimeout(base, f"GET {path}", self.timeout, self.timeout_option) from None
            if r.status == 503 and "no_workers" in text:
                raise NoWorkers(base)
            if r.status != 200:
                raise status_error(r.status, text)
            try:
                return ModelInfo.model_validate_json(text)
            except ValueError as e:
                raise ProviderError(
                    "api_error", f"policy backend {base} sent an unreadable {path}: {e}", 502
                ) from None
        if self.kind == "auto":
            models = await self._get_json(http, base, "/v1/models")
            cards = models.get("data") if isinstance(models.get("data"), list) else []
            if cards and isinstance(cards[0], dict) and cards[0].get("owned_by") == "vllm":
                return await self._vllm_info(http, base)
        raise ProviderError(
            "api_error",
            f"policy backend {base} answered 404 for /model_info and /get_model_info: is --backend an "
            "SGLang server's (or router's) root URL?",
            502,
        )

    async def _vllm_info(self, http: aiohttp.ClientSession, base: str) -> ModelInfo:
        """vLLM's model card (`/v1/models`): the model's path (`root`, a tokenizer directory when
        it is a local one) and `max_model_len`; vLLM streams deltas."""
        models = await self._get_json(http, base, "/v1/models")
        try:
            card = models["data"][0]
            root = card.get("root") or card["id"]
        except (KeyError, IndexError, TypeError, AttributeError):
            raise ProviderError(
                "api_error", f"policy backend {base} answered no model card at /v1/models: is it vLLM?", 502
            ) from None
        return ModelInfo(
            model_path=str(card.get("id") or root),
            tokenizer_path=root if isinstance(root, str) and os.path.isdir(root) else None,
            context_length=_positive(card.get("max_model_len")),
            incremental_streaming_output=True,
            front="vllm",
            server_info_from="engine",
            logprobs_mode=await self._vllm_logprobs_mode(http, base),
            weight_version=await self._vllm_weight_version(http, base),
        )

    async def vllm_weight_version(self, url: str | None = None) -> str | None:
        """The weight version the vLLM engine at `url` (default: ours) serves now (`GET
        /weight_info`); None where it serves none (404 without `VLLM_SERVER_DEV_MODE=1`). Raises
        EngineTimeout or EngineUnreachable when it does not answer."""
        base = (url or self.base_url).rstrip("/")
        http = await self._http()
        try:
            return await self._vllm_weight_version(http, base)  # a timeout is EngineTimeout already
        except (aiohttp.ClientError, OSError) as e:
            raise EngineUnreachable(base, e) from e

    async def _vllm_weight_version(self, http: aiohttp.ClientSession, base: str) -> str | None:
        try:
            async with http.get(f"{base}/weight_info", headers=self._auth, timeout=self._info_timeout()) as r:
                if r.status == 404:
                    return None
                text = await r.text()
        except TimeoutError:
            raise EngineTimeout(base, "GET /weight_info", self.timeout, self.timeout_option) from None
        if r.status != 200:
            raise status_error(r.status, text)
        try:
            version = json.loads(text)["weight_version"]
        except (ValueError, KeyError, TypeError):
            version = None
        if not isinstance(version, str):
            raise ProviderError(
                "api_error", f"policy backend {base} sent an unreadable /weight_info: {text[:200]!r}", 502
            )
        return version

    async def _vllm_logprobs_mode(self, http: aiohttp.ClientSession, base: str) -> str | None:
        """vLLM's `--logprobs-mode` in our words: from `/server_info` where it is served
        (`VLLM_SERVER_DEV_MODE=1`), else from one sampled token at top_k 1, whose logprob is
        exactly 0 in the sampling distribution (one token kept) and that token's share of the
        model's distribution otherwise. None when neither tells. The token may be the engine's
        first since it started, which takes seconds more than an info call (vLLM CPU warms up
        then): it gets `PROBE_S` at least."""
        server = await self._get_json(http, base, "/server_info?config_format=json", optional=True)
        config = server.get("vllm_config")
        model = config.get("model_config") if isinstance(config, dict) else None
        named = model.get("logprobs_mode") if isinstance(model, dict) else None
        if isinstance(named, str):
            return logprobs.VLLM_MODES.get(named)
        body = {"prompt": [0], "max_tokens": 1, "temperature": 1.0, "top_k": 1, "logprobs": 0}
        timeout = aiohttp.ClientTimeout(
            total=max(self.timeout, PROBE_S) if self.timeout else None, sock_connect=10
        )
        try:
            async with http.post(
                f"{base}/v1/completions", json=body, headers=self._auth, timeout=timeout
            ) as r:
                reply = await r.json(content_type=None) if r.status == 200 else {}
            value = float(reply["choices"][0]["logprobs"]["token_logprobs"][0])
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError, IndexError, TypeError):
            return None
        return "sampling" if value == 0.0 else "raw" if value < 0.0 else None

    async def _get_json(
        self, http: aiohttp.ClientSession, base: str, path: str, *, optional: bool = False
    ) -> dict[str, Any]:
        """An info endpoint's JSON object; {} when the server lacks it or answers oddly. SGLang
        reports server args in /get_server_info and max_model_len in /v1/models.

        A server that does not answer at all is not one that lacks the endpoint: the timeout is
        raised (EngineTimeout), and a failed connection too, unless the call is `optional` (a
        worker the router lists may not be reachable from here)."""
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

    async def chat(
        self, body: dict[str, Any], *, url: str | None = None, routing_key: str | None = None
    ) -> dict[str, Any]:
        """POST /v1/chat/completions (chat backend mode), errors mapped like /generate."""
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
        input_ids: list[int] | bytes,
        params: dict[str, Any],
        *,
        stream: bool = True,
        cumulative: bool | None = None,
        url: str | None = None,
        routing_key: str | None = None,
    ) -> GenerateStream:
        """One generation, not yet sent (`GenerateStream.next` sends it). `input_ids` may come
        already serialized (`ids_json`), so a long conversation is not re-serialized every turn.
        `stream=False` asks for the whole reply at once; `cumulative` says how the server streams
        (None: decided from its second chunk). `url`: the engine (default: ours); `routing_key`:
        the conversation's, for a router."""
        ids = input_ids if isinstance(input_ids, bytes) else ids_json(input_ids)
        headers = {"Content-Type": "application/json", **self.headers(routing_key)}
        return GenerateStream(
            self, generate_body(ids, params, stream), stream, cumulative, url or self.base_url, headers
        )

    def complete_ids(
        self,
        input_ids: list[int] | bytes,
        params: dict[str, Any],
        *,
        stream: bool = True,
        url: str | None = None,
        routing_key: str | None = None,
    ) -> GenerateStream:
        """One generation on vLLM (`/v1/completions` with a token-id prompt), read into the same
        state as SGLang's: `params` from `vllm_params`."""
        ids = input_ids if isinstance(input_ids, bytes) else ids_json(input_ids)
        headers = {"Content-Type": "application/json", **self.headers(routing_key)}
        body = vllm_body(ids, params, stream)
        return GenerateStream(
            self, body, stream, False, url or self.base_url, headers, "/v1/completions", _apply_vllm_chunk
        )


def ids_json(ids: list[int]) -> bytes:
    """Token ids as the inside of a JSON list ("1,2,3"); two of these join with a comma."""
    return json.dumps(ids, separators=(",", ":"))[1:-1].encode()


def vllm_params(s: Sampling, *, default_max_tokens: int) -> dict[str, Any]:
    """Neutral sampling settings in vLLM's completion-request names (with the token capture:
    `return_token_ids`, the sampled tokens' `logprobs`)."""
    out: dict[str, Any] = {
        "max_tokens": s.max_tokens if s.max_tokens is not None else default_max_tokens,
        "logprobs": 0,  # the sampled token's logprob, no alternatives
        "return_token_ids": True,
        "skip_special_tokens": False,  # special tokens such as <tool_call> stay in the text
        **_shared_params(s),
    }
    if s.json_schema is not None:
        out["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "reply", "schema": s.json_schema},
        }
    return out


def vllm_body(ids: bytes, params: dict[str, Any], stream: bool) -> bytes:
    """The /v1/completions request body around already serialized prompt ids."""
    extra = json.dumps({**params, "stream": stream}).encode()
    return b'{"prompt":[' + ids + b"]," + extra[1:]


def generate_body(ids: bytes, params: dict[str, Any], stream: bool) -> bytes:
    """The /generate request body around already serialized input ids."""
    return b"".join(
        (
            b'{"input_ids":[',
            ids,
            b'],"sampling_params":',
            json.dumps(params).encode(),
            b',"return_logprob":true,"stream":',
            b"true}" if stream else b"false}",
        )
    )


class GenerateStream:
    """One /generate request on its way. A reader task (one per generation) sends it and folds
    what arrives into `state`; `next` waits for news. Chunks that arrive together come out as one
    piece of news, and of cumulative chunks that arrive together only the last is parsed: it
    repeats the others."""

    def __init__(
        self,
        client: SGLangClient,
        body: bytes,
        stream: bool,
        cumulative: bool | None,
        url: str,
        headers: dict[str, str],
        path: str = "/generate",
        apply: Callable[[GenerateState, bytes], str] | None = None,
    ):
        self.client = client
        self.url = url
        self.headers = headers
        self.path = path
        self._apply = apply or _apply_chunk
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
                resp = await http.post(f"{self.url}{self.path}", data=self.body, headers=self.headers)
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
        text = self._apply(self.state, payload)
        if text:
            self._text.append(text)
        if self.state.finish_reason is not None:
            self._ended.set()
        self._news.set()


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def status_error(status: int, body: str) -> ProviderError:
    """A non-200 answer from the backend, as the error the harness should see."""
    detail = body[:2000]
    if status in (400, 422):
        return ProviderError("invalid_request", f"policy backend rejected the request: {detail}", 400)
    if status in (429, 503):
        return ProviderError("overloaded", f"policy backend answered HTTP {status}: {detail}", 529)
    if status in (401, 403):
        return ProviderError(
            "api_error",
            f"policy backend refused our credentials (HTTP {status}): set --backend-api-key "
            f"(POLAR_MITM_BACKEND_API_KEY) to the engine's --api-key: {detail}",
            500,
        )
    return ProviderError("api_error", f"policy backend answered HTTP {status}: {detail}", 500)


def _apply_chunk(state: GenerateState, payload: bytes) -> str:
    """Fold one /generate output (a streamed chunk, or the whole reply) into `state`; returns the
    text it adds."""
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
        ids = obj["output_ids"]
        lps = [float(t[0]) for t in meta.get("output_token_logprobs") or []]
        if not isinstance(ids, list) or not isinstance(text, str):
            raise TypeError("output_ids is not a list or text is not a string")
    except ProviderError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise ProviderError(
            "api_error", f"policy backend returned an unreadable chunk: {payload[:200]!r}", 502
        ) from e
    # SGLang streams cumulative state by default and increments with --incremental-streaming-output;
    # accept both, deciding once at the second chunk unless the server said which.
    if state.chunks == 1 and state.cumulative is None:
        acc = state.output_ids
        state.cumulative = len(ids) > len(acc) and ids[: len(acc)] == acc
    if state.chunks == 0 or state.cumulative:
        prev = state.text
        added = text[len(prev) :] if text.startswith(prev) else text
        state.output_ids, state.output_logprobs = ids, lps
        state._text[:] = [text]
    else:
        added = text
        state.output_ids.extend(ids)
        state.output_logprobs.extend(lps)
        state._text.append(text)
    if len(state.output_logprobs) != len(state.output_ids):
        raise ProviderError(
            "api_error",
            f"policy backend returned {len(state.output_ids)} output ids but {len(state.output_logprobs)} "
            "logprobs; is return_logprob supported?",
            502,
        )
    state.finish_reason = meta.get("finish_reason")
    state.weight_version = meta.get("weight_version", state.weight_version)
    state.prompt_tokens = meta.get("prompt_tokens", state.prompt_tokens)
    state.cached_tokens = meta.get("cached_tokens", state.cached_tokens)
    state.chunks += 1
    return added


# vLLM's finish reasons in SGLang's shape (`stop_reason`: the stop string or token id; None for EOS).
def _vllm_finish(choice: dict[str, Any]) -> dict[str, Any] | None:
    fr = choice.get("finish_reason")
    if fr is None:
        return None
    if fr == "stop":
        return {"type": "stop", "matched": choice.get("stop_reason")}
    if fr == "abort":
        return {"type": "abort", "message": "aborted by the engine"}
    return {"type": str(fr)}


def _apply_vllm_chunk(state: GenerateState, payload: bytes) -> str:
    """Fold one vLLM /v1/completions output (a delta chunk, or the whole reply) into `state`;
    returns the text it adds. A chunk with no choices (the usage one) adds only the usage."""
    try:
        obj = json.loads(payload)
        if "error" in obj or obj.get("object") == "error":
            err = obj.get("error", obj)
            message = err.get("message", err) if isinstance(err, dict) else err
            code = err.get("code") if isinstance(err, dict) else None
            if code in (400, 422):
                raise ProviderError("invalid_request", f"policy backend rejected the request: {message}", 400)
            raise ProviderError("api_error", f"policy backend error: {message}", 500)
        usage = obj.get("usage") or {}
        choices = obj.get("choices") or []
        choice = choices[0] if choices else None
        if choice is not None:
            text = choice.get("text") or ""
            ids = choice.get("token_ids")
            lps = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
            if not isinstance(ids, list) or not isinstance(text, str):
                raise ProviderError(
                    "api_error",
                    "the vLLM backend returned no token_ids: it needs return_token_ids (vLLM >= 0.10.2)",
                    502,
                )
    except ProviderError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise ProviderError(
            "api_error", f"policy backend returned an unreadable chunk: {payload[:200]!r}", 502
        ) from e
    if isinstance(usage, dict) and usage:
        state.prompt_tokens = usage.get("prompt_tokens", state.prompt_tokens)
        details = usage.get("prompt_tokens_details") or {}
        state.cached_tokens = details.get("cached_tokens", state.cached_tokens)
    if choice is None:
        return ""
    if len(lps) != len(ids):
        raise ProviderError(
            "api_error",
            f"policy backend returned {len(ids)} token ids but {len(lps)} logprobs; is logprobs supported?",
            502,
        )
    state.output_ids.extend(int(i) for i in ids)
    state.output_logprobs.extend(lps)
    state._text.append(text)
    state.finish_reason = _vllm_finish(choice)
    state.chunks += 1
    return text
