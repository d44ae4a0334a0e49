"""What the policy is told: its options (`PolicyConfig`, which the CLI builds its flags from) and
where one request came from (`TurnContext`, for the stored turn)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class PolicyConfig(BaseModel):
    """How the policy reaches its engines, renders, samples and times a turn."""

    # One front (an SGLang engine, or SGLang's router), or several engines separated by commas
    # (`--backend` given several times), balanced by rendezvous hashing of the conversation.
    backend_url: str = "http://127.0.0.1:30000"
    # Sent as `Authorization: Bearer` on every call to the engines (their --api-key).
    backend_api_key: str | None = None
    # Which engine's API: sglang (/generate), vllm (/v1/completions with token ids), vllm-generate
    # (vLLM's /inference/v1/generate, --enable-scale-out), or auto (SGLang's info endpoints, else
    # vLLM's model card: vllm).
    backend_kind: Literal["auto", "sglang", "vllm", "vllm-generate"] = "auto"
    tokenizer: str | None = None  # None: the server's /model_info tokenizer_path
    tool_parser: str | None = None  # None: the server's, else qwen25
    reasoning_parser: str | None = None  # None: the server's, else qwen3
    history: Literal["splice", "template"] = "splice"
    # render: we render prompt ids and call /generate; chat: the server renders (/v1/chat/completions)
    backend_mode: Literal["render", "chat"] = "render"
    default_max_tokens: int = 4096
    max_tokens_cap: int | None = None  # clamp what harnesses ask for (Claude Code asks for 32k)
    # Bodies larger than this are refused unread (413 in the provider's shape); Anthropic's own limit.
    max_request_bytes: int = 32 * 1024 * 1024
    # Request body bytes one session may have in the proxy's memory at once, over all its
    # connections (`proxy/inflight.py`): a request that would pass it gets a 413 naming it, unread.
    max_session_bytes_in_flight: int = Field(64 * 1024 * 1024, ge=1)
    ping_interval: float = 5.0
    # Seconds the backend may stay silent before the turn fails (the harness is told to retry;
    # tokens sampled so far are kept as an 'error' turn); None or 0 waits forever. The first token
    # may take long: a long prompt on a busy engine. Chat mode gets its whole reply at once, so
    # there the first-token limit bounds the whole reply.
    first_token_timeout: float | None = 600.0
    idle_timeout: float | None = 120.0  # between streamed chunks
    # How replies come from the backend. stream: as SGLang streams them; whole: in one piece
    # (stream=false), the harness kept alive with pings meanwhile and the reply streamed to it once
    # complete. auto: stream when the server streams incrementally (--incremental-streaming-output),
    # else whole: SGLang's default cumulative chunks each repeat the whole reply so far, so
    # streaming n tokens costs O(n^2) bytes to serialize, send and parse on both sides. In whole
    # mode the first-token timeout bounds the whole reply (no token arrives before the last).
    backend_stream: Literal["auto", "stream", "whole"] = "auto"
    # Seconds between the reply events a harness gets while a reply streams from the backend:
    # chunks arriving meanwhile go out together (fewer, larger events cost the proxy and the
    # harness less per token; the last chunk goes out at once). 0: each chunk as it arrives.
    chunk_interval: float = 0.05
    # Tokens of rendered prompt prefixes (system prompt + tools; a first turn through its last
    # end-of-turn token) kept across sessions, so what many share is tokenized once; 0: off.
    prefix_cache_tokens: int = 4_000_000
    # The model's context length when no engine reports it (an explicit value wins over theirs).
    context_length: int | None = None
    # Seconds the preflight waits for a router's first worker (503 no_workers) before giving up.
    backend_wait: float = 300.0
    # While a turn waits on its engine (for the first token, or silent mid-stream) the engine's
    # liveness is probed every `engine_probe_interval` seconds (SGLang: /health_generate);
    # failing for `engine_dead_after` seconds fails the turn with a retryable error (and with
    # several engines moves the conversation). It also bounds each ask for the model info.
    # 0 turns the probing off. 20 s (SGLang's own /health_generate gives up after 20 s): with a
    # ping interval of granularity a hung engine fails a turn within 30 s.
    engine_dead_after: float = 20.0
    engine_probe_interval: float = 5.0

    @property
    def backend_urls(self) -> list[str]:
        """The engines' URLs (one unless several were given)."""
        return [u.strip().rstrip("/") for u in self.backend_url.split(",") if u.strip()]


class TurnContext(BaseModel):
    """Where a request came from, for the stored turn."""

    session_id: str
    host: str | None = None
    path: str | None = None
    headers: dict[str, str] = Field(default_factory=dict)  # already redacted
    raw_request: str | None = None  # already redacted
    tag: str | None = None
    id_prefix: str = "call_"
