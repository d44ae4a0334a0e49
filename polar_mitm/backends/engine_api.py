"""What every engine API implements, and what the engine client and those APIs share.

An engine API is one module (`sglang`, `vllm`, `vllm_generate`); the module itself is the object that implements
`EngineAPI`, and the type checker holds each one to it (see the registry in
`polar_mitm.backends.engine_client`). It knows its engine's words: how a generation is asked
(`sampling_params`, `body`, `GENERATE_PATH`), how what comes back folds into a `GenerateState`
(`fold`), and how the front reports its model (`model_info`, asked through a `Fetch`: the
client's HTTP, so no API module opens a connection of its own).

Both engines' replies fold into the same state, in SGLang's shapes (finish reasons included), so
the policy handles both alike. Nothing here does I/O.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import orjson
from pydantic import BaseModel

from polar_mitm.neutral import ProviderError, Sampling

# What opens vLLM's development endpoints (`/weight_info`, `/pause`, `/collective_rpc`, …).
VLLM_DEV_MODE = "start vLLM with VLLM_SERVER_DEV_MODE=1"
# What opens vLLM's token-in, token-out endpoint (`/inference/v1/generate`): 403 without it.
VLLM_SCALE_OUT = "start vLLM with --enable-scale-out"


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


def status_error(status: int, body: str) -> ProviderError:
    """A non-200 answer from the backend, as the error the harness should see."""
    detail = body[:2000]
    if status in (400, 422):
        return ProviderError("invalid_request", f"policy backend rejected the request: {detail}", 400)
    if status in (429, 503):
        return ProviderError("overloaded", f"policy backend answered HTTP {status}: {detail}", 529)
    if status == 403 and "--enable-scale-out" in body:  # vLLM's scale-out endpoints, turned off
        return ProviderError(
            "api_error", f"policy backend refused the call ({VLLM_SCALE_OUT}): {detail}", 500
        )
    if status in (401, 403):
        return ProviderError(
            "api_error",
            f"policy backend refused our credentials (HTTP {status}): set --backend-api-key "
            f"(POLAR_MITM_BACKEND_API_KEY) to the engine's --api-key: {detail}",
            500,
        )
    return ProviderError("api_error", f"policy backend answered HTTP {status}: {detail}", 500)


def unreadable(payload: bytes) -> ProviderError:
    """A chunk (or whole reply) that is not what the engine API says it sends."""
    return ProviderError("api_error", f"policy backend returned an unreadable chunk: {payload[:200]!r}", 502)


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
    # What answered: "sglang" (an engine), "router" (sglang-router in front of `workers`), "vllm".
    front: str = "sglang"
    workers: list[str] = []
    # Where the server info (context length, streaming mode) came from: "engine", "worker URL",
    # or "" when no engine said (then only the options say).
    server_info_from: str = ""
    # What the engine's logprobs are of (`polar_mitm.backends.logprobs.MODES`); None: unknown.
    logprobs_mode: str | None = None
    # Where generations go when the engine API is not the front's usual one ("" for that).
    generate_path: str = ""

    def describe(self) -> str:
        """One line naming the front, for the preflight."""
        if self.front == "vllm":
            version = (
                f"weight version {self.weight_version}"
                if self.weight_version is not None
                else f"no weight version: it serves no /weight_info ({VLLM_DEV_MODE})"
            )
            if self.generate_path:  # the replies name their weight versions
                version = f"weight version {self.weight_version}; generations at {self.generate_path}"
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
        # In SGLang's shape: {"type": "stop"|"length"|"abort", ...}; None until the last chunk.
        self.finish_reason: dict[str, Any] | None = None
        self.weight_version: str | None = None
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.chunks = 0
        # Whether each chunk repeats everything so far (SGLang's default) or only adds to it
        # (--incremental-streaming-output, and vLLM's deltas); None: decided at the second chunk.
        self.cumulative = cumulative
        self._text: list[str] = []

    @property
    def text(self) -> str:
        if len(self._text) > 1:
            self._text[:] = ["".join(self._text)]
        return self._text[0] if self._text else ""


def ids_json(ids: list[int]) -> bytes:
    """Token ids as the inside of a JSON list ("1,2,3"); two of these join with a comma. Both
    engines take a prompt as such a list, so a long conversation is serialized once.

    orjson writes the same text as `json` for ints, ten times faster (a 32k-token conversation
    whose serialized ids are not kept: ~4 ms → 0.4 ms); what it refuses (an int past 64 bits, an
    array) goes through `json`."""
    try:
        return orjson.dumps(ids)[1:-1]
    except TypeError:  # orjson.JSONEncodeError is one
        return json.dumps(list(ids), separators=(",", ":"))[1:-1].encode()


def shared_params(s: Sampling) -> dict[str, Any]:
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


def span_version(spans: Any) -> str | None:
    """A reply's weight version from its spans over the sampled tokens (`[{"version", "start",
    "end"}, …]`: vLLM's `choices[].weight_versions`, SGLang's `meta_info.weight_versions`): the
    one version when every token carries it; with several (the weights changed mid-reply), the
    first, the oldest that sampled any of its tokens. None for no spans. Raises ValueError for
    spans that are not that shape."""
    if spans is None or spans == []:
        return None
    if not isinstance(spans, list) or not all(
        isinstance(s, dict) and isinstance(s.get("version"), str) for s in spans
    ):
        raise ValueError(f"unreadable weight version spans: {spans!r}"[:300])
    return spans[0]["version"]


def positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


class Fetch(Protocol):
    """How an engine API asks a front for its info: the engine client's HTTP (its session, API
    key and info timeout). A connection that fails raises, and so does a timeout (EngineTimeout),
    unless the call is `optional`."""

    timeout: float | None  # seconds an info request may take (None: unbounded)

    async def get_json(self, base: str, path: str, *, optional: bool = False) -> dict[str, Any]:
        """An info endpoint's JSON object; {} when the server lacks it or answers oddly."""
        ...

    async def get_text(self, base: str, path: str) -> tuple[int, str]:
        """(status, body) of a GET."""
        ...

    async def post_json(self, base: str, path: str, body: dict[str, Any], *, timeout: float | None) -> Any:
        """The JSON a 200 answer to a POST holds; {} for any other answer, or none at all."""
        ...

    async def post_text(
        self, base: str, path: str, body: dict[str, Any], *, timeout: float | None
    ) -> tuple[int, str]:
        """(status, body) of a POST within `timeout` (EngineTimeout past it)."""
        ...


class EngineAPI(Protocol):
    """One engine's HTTP API: how a generation is asked and read, and how its front says what
    it serves."""

    NAME: str  # PolicyConfig.backend_kind's word for it
    GENERATE_PATH: str  # where a generation is posted
    # Whether its generations' replies name the weight version that sampled them, and whether
    # the front's chat completions (chat backend mode) do; where not, the policy reads the
    # version the engine serves beside the turn (`weight_version`, `polar_mitm.policy.versions`).
    VERSION_IN_REPLY: bool
    VERSION_IN_CHAT_REPLY: bool
    HEALTH_PATH: str  # its liveness check, probed while a turn waits (`backends/engines.py`)

    def sampling_params(self, s: Sampling, *, default_max_tokens: int) -> dict[str, Any]:
        """Neutral sampling settings in the engine's names (with what captures the tokens)."""
        ...

    def body(self, ids: bytes, params: dict[str, Any], stream: bool) -> bytes:
        """The request body around already serialized prompt ids (`ids_json`)."""
        ...

    def fold(self, state: GenerateState, payload: bytes) -> str:
        """Fold one output (a streamed chunk, or the whole reply) into `state`; returns the text
        it adds. Raises ProviderError for an error the engine sent, or a chunk it cannot read."""
        ...

    async def model_info(self, fetch: Fetch, base: str) -> ModelInfo:
        """What the front at `base` serves, read the way it offers it."""
        ...

    async def weight_version(self, fetch: Fetch, base: str) -> str | None:
        """The weight version the engine at `base` serves now, asked apart from any reply; None
        where it serves none. A timeout raises EngineTimeout."""
        ...
