"""The policy backend: a neutral ChatRequest in, a stream of neutral events out.

Renders the prompt token ids itself (splicing earlier sampled ids back in), asks SGLang
`/generate` for tokens with logprobs, parses the text into reasoning / text / tool calls as it
streams, and commits the turn to the store before the final event is yielded, so the harness can
never see the end of a reply that is not on disk.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from polar_mitm.backends.chat_mode import chat_body, parse_chat_result
from polar_mitm.backends.engines import Engine, EnginePool
from polar_mitm.backends.large_inputs import pooled
from polar_mitm.backends.parsers import (
    OutputParser,
    check_reasoning_parser,
    check_tool_parser,
    new_call_id,
)
from polar_mitm.backends.render import (
    PrefixCache,
    PromptIds,
    SpliceError,
    conversation_hashes,
    extend_hash,
    generation_opens_reasoning,
    render_continuation,
    render_full,
)
from polar_mitm.backends.sglang import (
    EngineUnreachable,
    GenerateState,
    ModelInfo,
    SGLangClient,
    ids_json,
    sampling_params,
    vllm_params,
)
from polar_mitm.backends.tokenizer import Tokenizer
from polar_mitm.neutral import (
    ChatRequest,
    Completion,
    Done,
    Event,
    Ping,
    ProviderError,
    ReasoningDelta,
    Started,
    TextDelta,
    ToolCallEvent,
    Usage,
    new_turn_id,
)
from polar_mitm.store.db import Store, Turn

log = logging.getLogger("polar_mitm.policy")


class PolicyConfig(BaseModel):
    # One front (an SGLang engine, or SGLang's router), or several engines separated by commas
    # (`--backend` given several times), balanced by rendezvous hashing of the conversation.
    backend_url: str = "http://127.0.0.1:30000"
    # Sent as `Authorization: Bearer` on every call to the engines (their --api-key).
    backend_api_key: str | None = None
    # Which engine's API: sglang (/generate), vllm (/v1/completions with token ids), or auto
    # (SGLang's info endpoints, else vLLM's model card).
    backend_kind: Literal["auto", "sglang", "vllm"] = "auto"
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
    # Tokens of rendered first blocks (system prompt + tools) kept across sessions, so a prompt
    # many sessions share is tokenized once; 0 turns the cache off.
    prefix_cache_tokens: int = 4_000_000
    # The model's context length when no engine reports it (an explicit value wins over theirs).
    context_length: int | None = None
    # Seconds the preflight waits for a router's first worker (503 no_workers) before giving up.
    backend_wait: float = 300.0
    # While a turn waits for its first token the engine's liveness is probed every
    # `engine_probe_interval` seconds (SGLang: /health_generate); failing for `engine_dead_after`
    # seconds fails the turn with a retryable error (and with several engines moves the
    # conversation). 0 turns the probing off.
    engine_dead_after: float = 30.0
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


def _join_ids(a: bytes, b: bytes) -> bytes:
    """Two `ids_json` texts as one (either may be empty)."""
    return a + b"," + b if a and b else a or b


def _aborted(fr: Any) -> bool:
    return isinstance(fr, dict) and fr.get("type") == "abort"


def abort_error(fr: dict[str, Any], backend_url: str) -> ProviderError:
    """What the harness is told when the engine aborted its generation (SGLang's finish_reason
    `{"type": "abort"}`: a weight update, a scheduler restart, an operator's /abort_request).

    The reply is incomplete, so it is an error, never a finished turn: a retryable one in the
    style's own shape, unless the engine says the request itself was at fault."""
    detail = fr.get("message") or "aborted"
    if fr.get("status_code") in (400, 422):
        return ProviderError("invalid_request", f"policy backend aborted the request: {detail}", 400)
    return ProviderError(
        "overloaded",
        f"policy backend {backend_url} aborted the generation ({detail}); retry the request",
        529,
    )


def _chat_abort(data: Any) -> dict[str, Any] | None:
    """SGLang's abort finish reason in a chat completion (the choice's, or its meta_info's)."""
    try:
        choice = data["choices"][0]
    except (KeyError, IndexError, TypeError):
        return None
    fr = (choice.get("meta_info") or {}).get("finish_reason")
    if _aborted(fr):
        return fr
    return {"type": "abort"} if choice.get("finish_reason") == "abort" else None


def _finish(chunk: GenerateState | None, has_tool_calls: bool) -> tuple[str, str | None]:
    fr = (chunk.finish_reason if chunk else None) or {}
    kind = fr.get("type")
    if kind == "length":
        return "length", None
    matched = fr.get("matched")
    stop_seq = matched if isinstance(matched, str) else None
    return ("tool_calls" if has_tool_calls else "stop"), stop_seq


def reasoning_token_count(tok: Tokenizer, output_ids: list[int], has_reasoning: bool) -> int:
    """How many sampled tokens belong to the reasoning block (through its closing tag)."""
    if not has_reasoning:
        return 0
    end = tok.token_id("</think>")
    if end is not None and end in output_ids:
        return output_ids.index(end) + 1
    return len(output_ids)


def turn_record(
    turn_id: str,
    req: ChatRequest,
    ctx: TurnContext,
    *,
    status: str,
    completion: Completion | None,
    prompt_ids: list[int],
    ref: str | None,
    ref_len: int,
    output_ids: list[int],
    output_logprobs: list[float],
    weight_version: str | None,
    msg_hash: str,
    error: str | None,
    started: float,
    finish_reason: str | None = None,
) -> Turn:
    """The stored form of one generation; post_hash lets a later echo of the reply find it.

    Built without validation: every value is ours or already checked (a 30k-token prompt would
    otherwise be validated id by id on every turn)."""
    return Turn.model_construct(
        id=turn_id,
        session_id=ctx.session_id,
        style=req.style,
        host=ctx.host,
        path=ctx.path,
        model=req.model,
        tag=ctx.tag,
        status=status,
        finish_reason=finish_reason or (completion.finish_reason if completion else status),
        prompt_ids=prompt_ids,
        prompt_ref=ref,
        prompt_ref_len=ref_len,
        output_ids=output_ids,
        output_logprobs=output_logprobs,
        weight_version=None if weight_version is None else str(weight_version),
        msg_hash=msg_hash,
        post_hash=extend_hash(msg_hash, completion.as_message()) if completion else None,
        request=ctx.raw_request,
        request_headers=ctx.headers,
        response=completion.model_dump_json() if completion else None,
        error=error,
        latency_ms=(time.perf_counter() - started) * 1000,
    )


class Policy:
    def __init__(self, config: PolicyConfig, store: Store):
        self.config = config
        self.store = store
        # Info requests (/model_info …) are small: the idle limit bounds them too.
        urls = config.backend_urls or [config.backend_url]
        self.client = SGLangClient(
            urls[0], timeout=config.idle_timeout, api_key=config.backend_api_key, kind=config.backend_kind
        )
        self.engines = EnginePool(
            urls,
            self.client.alive,
            kind="vllm" if config.backend_kind == "vllm" else "sglang",
            interval=config.engine_probe_interval or 5.0,
        )
        # Routing keys of recent turns, so a turn that echoes one keeps its conversation's key
        # even when its first messages were rewritten (a tool set changed, a prompt compacted).
        self._keys: OrderedDict[str, str] = OrderedDict()
        self._tok: Tokenizer | None = None
        self._info: ModelInfo | None = None
        self._reasoning_open: dict[str, bool] = {}
        # Weight sync: while the gate is closed no generation starts (harnesses get keep-alive
        # pings instead); `generating` counts the generations under way, to drain them.
        self.gate = asyncio.Event()
        self.gate.set()
        self.generating = 0
        self._at_gate = 0
        # The serialized ids (`ids_json`) of recent turns' full sequences, so a spliced prompt is
        # sent as that text plus its new ids instead of re-serializing the whole conversation.
        self._sent_ids: OrderedDict[str, tuple[int, bytes]] = OrderedDict()
        self._sent_bytes = 0
        self.prefixes = PrefixCache(config.prefix_cache_tokens)

    def pause(self) -> None:
        """Start no new generation until `resume` (those under way finish)."""
        self.gate.clear()

    def resume(self) -> None:
        self.gate.set()

    @property
    def at_gate(self) -> int:
        """How many turns are waiting at the closed gate now (read-only: a paused service, or a
        test, sees that a call arrived and is held rather than guessing from elapsed time)."""
        return self._at_gate

    async def _through_gate(self, turn_id: str, prompt_tokens: int) -> AsyncIterator[Event]:
        """While paused: the turn starts for the harness and keeps it alive with pings."""
        if self.gate.is_set():
            return
        self._at_gate += 1
        try:
            yield Started(turn_id=turn_id, prompt_tokens=prompt_tokens)
            while not self.gate.is_set():
                try:
                    await asyncio.wait_for(self.gate.wait(), self.config.ping_interval)
                except TimeoutError:
                    yield Ping()
        finally:
            self._at_gate -= 1

    async def close(self) -> None:
        await self.engines.close()
        await self.client.close()

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

    # Routing keys kept for turns that echo them (a few hundred bytes each).
    ROUTING_KEYS_MAX = 100_000

    def routing_key(self, req: ChatRequest, session_id: str, hashes: list[str], ref: str | None) -> str:
        """The conversation's routing key: the same for every turn of one conversation and for
        the retries of a turn, different across sessions (the samples of a group spread over the
        engines) and for a subagent or side call (its own first messages).

        A turn that echoes an earlier one (`ref`) keeps that turn's key; otherwise the key is the
        hash of the session and the conversation up to its first user message (system prompt,
        tools, task), which every later turn of it repeats."""
        if ref is not None and (kept := self._keys.get(ref)) is not None:
            return kept
        first = next((i for i, m in enumerate(req.messages) if m.role != "system"), len(req.messages))
        anchor = hashes[min(first + 1, len(hashes) - 1)]
        return hashlib.sha256(f"{session_id}\0{anchor}".encode()).hexdigest()[:32]

    def _keep_key(self, turn_id: str, key: str) -> None:
        self._keys[turn_id] = key
        while len(self._keys) > self.ROUTING_KEYS_MAX:
            self._keys.popitem(last=False)

    async def _first_token_watch(self, engine: Engine) -> asyncio.Task | None:
        """A task that ends when `engine` has failed its liveness probes for engine_dead_after
        seconds (None when probing is off)."""
        if not self.config.engine_dead_after or not self.config.engine_probe_interval:
            return None
        return asyncio.ensure_future(self.engines.watch(engine, self.config.engine_dead_after))

    def engine_dead(self, engine: Engine) -> ProviderError:
        """The retryable error for a turn whose engine stopped passing its liveness check."""
        self.engines.mark_dead(engine, "failed its health check")
        return ProviderError(
            "overloaded",
            f"policy backend {engine.url} failed its health check ({self.engines.health_path}) for "
            f"{self.config.engine_dead_after:g} s (--engine-dead-after); retry the request",
            529,
        )

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

    # New messages up to this size are rendered on the event loop (about a millisecond).
    INLINE_RENDER_CHARS = 16_000

    # Serialized sequences kept for splicing (bytes, ~6 per token): a few sessions' worth each.
    SENT_IDS_MAX_BYTES = 64 * 1024 * 1024

    def serialized_prompt(self, prompt_ids: list[int], ref: str | None, ref_len: int) -> bytes:
        """`ids_json(prompt_ids)`, built from the referenced turn's serialized sequence when it is
        kept (that sequence is prompt_ids[:ref_len] by construction)."""
        kept = self._sent_ids.get(ref) if ref is not None else None
        if kept is None or kept[0] != ref_len:
            return prompt_ids.serialized() if isinstance(prompt_ids, PromptIds) else ids_json(prompt_ids)
        return _join_ids(kept[1], ids_json(prompt_ids[ref_len:]))

    def _keep_sent(self, turn_id: str, ref: str | None, tokens: int, serialized: bytes) -> None:
        if ref is not None and (old := self._sent_ids.pop(ref, None)) is not None:
            self._sent_bytes -= len(old[1])  # its successor covers it
        self._sent_ids[turn_id] = (tokens, serialized)
        self._sent_bytes += len(serialized)
        while self._sent_bytes > self.SENT_IDS_MAX_BYTES and len(self._sent_ids) > 1:
            _, (_, old_bytes) = self._sent_ids.popitem(last=False)
            self._sent_bytes -= len(old_bytes)

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

    def silence(self, first_token: bool, url: str | None = None) -> ProviderError:
        """The retryable error for a backend that went quiet for longer than it may."""
        if first_token:
            what, limit, option = "sent no token", self.config.first_token_timeout, "--first-token-timeout"
        else:
            what, limit, option = "stopped sending tokens", self.config.idle_timeout, "--idle-timeout"
        return ProviderError(
            "overloaded",
            f"policy backend {url or self.config.backend_url} {what} for {limit:g} s ({option}); "
            "retry the request",
            529,
        )

    # -- prompt -------------------------------------------------------------------------------

    def template_kwargs(self, req: ChatRequest) -> dict[str, Any]:
        return {} if req.thinking is None else {"enable_thinking": req.thinking}

    async def echoed_turn(
        self, req: ChatRequest, session_id: str
    ) -> tuple[list[str], tuple[str, int] | None]:
        """The conversation's hashes, and the newest turn whose prompt + reply the request repeats
        (its id and how many of the request's messages that covers), if any."""
        msgs = req.messages
        hashes = conversation_hashes(msgs, req.tools)
        candidates = [hashes[i] for i in range(len(msgs) - 1, 0, -1) if msgs[i - 1].role == "assistant"]
        hit = await self.store.find_by_post_hash(session_id, candidates) if candidates else None
        return hashes, (hit[0], hashes.index(hit[1])) if hit is not None else None

    async def extends(self, prompt_ids: list[int], turn_id: str) -> tuple[str | None, int]:
        """(turn_id, its sequence length) when that sequence is a token prefix of prompt_ids."""
        seq, _ = await self.store.sequence(turn_id)
        return (turn_id, len(seq)) if prompt_ids[: len(seq)] == seq else (None, 0)

    async def prompt(self, req: ChatRequest, session_id: str) -> tuple[list[int], str | None, int, list[str]]:
        """(prompt ids, referenced turn, tokens reused from it, conversation hashes)."""
        tok = await self.tokenizer()
        kw = self.template_kwargs(req)
        hashes, echo = await self.echoed_turn(req, session_id)
        if echo is not None and self.config.history == "splice":
            turn_id, k = echo
            seq, plen = await self.store.sequence(turn_id)
            try:
                new = req.messages[k:]
                args = (tok, new, seq[plen:], kw)
                # A few new messages render faster than a hop to a worker thread and back.
                small = sum(len(m.content) for m in new) < self.INLINE_RENDER_CHARS
                cont = (
                    render_continuation(*args)
                    if small
                    else await asyncio.to_thread(render_continuation, *args)
                )
                return seq + cont, turn_id, len(seq), hashes
            except SpliceError as e:
                log.warning("splice failed (%s); rendering the whole conversation", e)
        full = await asyncio.to_thread(render_full, tok, req.messages, req.tools, kw, self.prefixes)
        ref, ref_len = await self.extends(full, echo[0]) if echo is not None else (None, 0)
        return full, ref, ref_len, hashes

    async def count_tokens(self, req: ChatRequest) -> int:
        tok = await self.tokenizer()
        return len(
            await asyncio.to_thread(
                render_full, tok, req.messages, req.tools, self.template_kwargs(req), self.prefixes
            )
        )

    # -- generation ---------------------------------------------------------------------------

    async def stream(self, req: ChatRequest, ctx: TurnContext) -> AsyncIterator[Event]:
        if self.config.backend_mode == "chat":
            async for ev in self._stream_chat(req, ctx):
                yield ev
            return
        t0 = time.perf_counter()
        tok = await self.tokenizer()
        prompt_ids, ref, ref_len, hashes = await self.prompt(req, ctx.session_id)
        tool_parser, reasoning_parser = await self.parsers()
        kw = self.template_kwargs(req)
        key = repr(sorted(kw.items()))
        if key not in self._reasoning_open:
            self._reasoning_open[key] = bool(reasoning_parser) and generation_opens_reasoning(tok, kw)
        parser = OutputParser(
            tool_parser if req.tools else None,
            reasoning_parser,
            in_reasoning=self._reasoning_open[key],
            id_prefix=ctx.id_prefix,
            tools=req.tools,  # formats with text values (qwen3_coder, glm45) type them by the schema
        )
        max_tokens = req.sampling.max_tokens or self.config.default_max_tokens
        if self.config.max_tokens_cap and max_tokens > self.config.max_tokens_cap:
            max_tokens = self.config.max_tokens_cap
        context = await self.context_length()
        if context:
            if len(prompt_ids) >= context:
                raise ProviderError(
                    "invalid_request",
                    f"prompt is too long: {len(prompt_ids)} tokens > {context - 1} maximum of the policy",
                    400,
                )
            # Harnesses ask for their provider's limits (Claude Code: 32k-64k); fit the policy's.
            max_tokens = min(max_tokens, context - len(prompt_ids))
        vllm = await self.engine_kind() == "vllm"
        params = (vllm_params if vllm else sampling_params)(
            req.sampling.model_copy(update={"max_tokens": max_tokens}),
            default_max_tokens=self.config.default_max_tokens,
        )
        turn_id = new_turn_id()
        committed = False
        error: str | None = None
        streamed, cumulative = await self.backend_streaming()
        sent_ids = self.serialized_prompt(prompt_ids, ref, ref_len)
        if isinstance(prompt_ids, PromptIds):
            prompt_ids = prompt_ids[:]  # a plain list: array() and others take their fast path
        key = self.routing_key(req, ctx.session_id, hashes, ref)
        engine = self.engines.pick(key)
        if vllm:
            gen = self.client.complete_ids(sent_ids, params, stream=streamed, url=engine.url, routing_key=key)
        else:
            gen = self.client.generate(
                sent_ids, params, stream=streamed, cumulative=cumulative, url=engine.url, routing_key=key
            )
        state = gen.state

        def record(status: str, completion: Completion | None, finish_reason: str | None = None) -> Turn:
            return turn_record(
                turn_id,
                req,
                ctx,
                status=status,
                completion=completion,
                prompt_ids=prompt_ids,
                ref=ref,
                ref_len=ref_len,
                output_ids=state.output_ids,
                output_logprobs=state.output_logprobs,
                weight_version=state.weight_version,
                msg_hash=hashes[-1],
                error=error,
                started=t0,
                finish_reason=finish_reason,
            )

        loop = asyncio.get_running_loop()
        started = False
        counted = False
        watch: asyncio.Task | None = None
        try:
            async for ev in self._through_gate(turn_id, len(prompt_ids)):
                started = True
                yield ev
            self.generating += 1
            counted = True
            heard = loop.time()  # when the request went out, then when the last chunk came
            watch = await self._first_token_watch(engine)
            while True:
                # Until a first chunk (in whole mode: until the reply), the first-token limit.
                limit = self.config.first_token_timeout if not state.chunks else self.config.idle_timeout
                left = heard + limit - loop.time() if limit else None
                last_wait = left is not None and left <= self.config.ping_interval
                delta = await gen.next(
                    max(left, 0.0) if last_wait else self.config.ping_interval, self.config.chunk_interval
                )
                if delta is None:
                    if last_wait:
                        raise self.silence(first_token=not state.chunks, url=engine.url)
                    if watch is not None and watch.done() and not state.chunks:
                        raise self.engine_dead(engine)
                    if not started:
                        started = True
                        yield Started(turn_id=turn_id, prompt_tokens=len(prompt_ids))
                    yield Ping()
                    continue
                heard = loop.time()
                if watch is not None:
                    watch.cancel()
                    watch = None
                if not state.chunks:
                    break  # the stream ended without a chunk
                if _aborted(state.finish_reason):
                    break  # before Started: an abort on the first chunk sends the harness nothing
                if not started:
                    started = True
                    yield Started(turn_id=turn_id, prompt_tokens=len(prompt_ids))
                for ev in parser.feed(delta):
                    yield ev
                if state.finish_reason is not None or gen.finished:
                    break
            if _aborted(state.finish_reason):
                aborted = abort_error(state.finish_reason, engine.url)
                error = aborted.message
                # Recorded once, here, before the harness hears of it: the sampled tokens are kept.
                await asyncio.shield(self.store.insert_turn(record("aborted", None, finish_reason="abort")))
                committed = True
                raise aborted
            for ev in parser.finish():
                yield ev
            finish, stop_seq = _finish(state if state.chunks else None, bool(parser.tool_calls))
            completion = Completion(
                turn_id=turn_id,
                model=req.model,
                text=parser.text,
                reasoning=parser.reasoning,
                tool_calls=parser.tool_calls,
                finish_reason=finish,
                stop_sequence=stop_seq,
                usage=Usage(
                    prompt_tokens=len(prompt_ids),
                    completion_tokens=len(state.output_ids),
                    cached_tokens=state.cached_tokens or 0,
                    reasoning_tokens=reasoning_token_count(tok, state.output_ids, bool(parser.reasoning)),
                ),
            )
            await asyncio.shield(self.store.insert_turn(record("ok", completion)))
            committed = True
            self._keep_key(turn_id, key)
            self._keep_sent(
                turn_id,
                ref,
                len(prompt_ids) + len(state.output_ids),
                _join_ids(sent_ids, ids_json(state.output_ids)),
            )
            yield Done(completion=completion)
        except ProviderError as e:
            error = e.message
            if isinstance(e, EngineUnreachable):
                self.engines.mark_dead(engine, e.message)
            raise
        finally:
            if watch is not None:
                watch.cancel()
            if counted:
                self.generating -= 1
            await gen.aclose()
            if not committed and state.chunks:
                status = "error" if error else "aborted"
                try:
                    await asyncio.shield(self.store.insert_turn(record(status, None)))
                except Exception:  # never mask the original failure
                    log.exception("could not record %s turn %s", status, turn_id)

    async def _stream_chat(self, req: ChatRequest, ctx: TurnContext) -> AsyncIterator[Event]:
        t0 = time.perf_counter()
        turn_id = new_turn_id()
        max_tokens = req.sampling.max_tokens or self.config.default_max_tokens
        if self.config.max_tokens_cap:
            max_tokens = min(max_tokens, self.config.max_tokens_cap)
        gated = False
        async for ev in self._through_gate(turn_id, 0):
            gated = True
            yield ev
        hashes, echo = await self.echoed_turn(req, ctx.session_id)
        key = self.routing_key(req, ctx.session_id, hashes, echo[0] if echo is not None else None)
        engine = self.engines.pick(key)
        task = asyncio.ensure_future(
            self.client.chat(chat_body(req, max_tokens), url=engine.url, routing_key=key)
        )
        watch = await self._first_token_watch(engine)  # the reply comes whole: watched throughout
        self.generating += 1
        task.add_done_callback(lambda _: setattr(self, "generating", self.generating - 1))
        loop = asyncio.get_running_loop()
        limit = self.config.first_token_timeout  # the reply arrives whole: no tokens to time
        deadline = loop.time() + limit if limit else None
        try:
            if not gated:
                yield Started(turn_id=turn_id, prompt_tokens=0)
            while not task.done():
                left = deadline - loop.time() if deadline is not None else None
                last_wait = left is not None and left <= self.config.ping_interval
                done, _ = await asyncio.wait(
                    {task}, timeout=max(left, 0.0) if last_wait else self.config.ping_interval
                )
                if not done:
                    if last_wait:
                        raise self.silence(first_token=True, url=engine.url)
                    if watch is not None and watch.done():
                        raise self.engine_dead(engine)
                    yield Ping()
            try:
                data = task.result()
            except EngineUnreachable as e:
                self.engines.mark_dead(engine, e.message)
                raise
            result = parse_chat_result(data)
        finally:
            if watch is not None:
                watch.cancel()
            if not task.done():
                task.cancel()
                await asyncio.wait({task})
        abort = _chat_abort(data)
        aborted = abort_error(abort, engine.url) if abort is not None else None
        ref, ref_len = await self.extends(result.prompt_ids, echo[0]) if echo is not None else (None, 0)
        calls = [c.model_copy(update={"id": new_call_id(ctx.id_prefix)}) for c in result.tool_calls]
        completion = Completion(
            turn_id=turn_id,
            model=req.model,
            text=result.text,
            reasoning=result.reasoning,
            tool_calls=calls,
            finish_reason="tool_calls" if calls and result.finish_reason == "stop" else result.finish_reason,
            stop_sequence=result.stop_sequence,
            usage=Usage(
                prompt_tokens=len(result.prompt_ids),
                completion_tokens=len(result.output_ids),
                cached_tokens=result.cached_tokens,
            ),
        )
        rec = turn_record(
            turn_id,
            req,
            ctx,
            status="aborted" if aborted else "ok",
            completion=None if aborted else completion,
            prompt_ids=result.prompt_ids,
            ref=ref,
            ref_len=ref_len,
            output_ids=result.output_ids,
            output_logprobs=result.output_logprobs,
            weight_version=result.weight_version,
            msg_hash=hashes[-1],
            error=aborted.message if aborted else None,
            started=t0,
            finish_reason="abort" if aborted else None,
        )
        await asyncio.shield(self.store.insert_turn(rec))
        if aborted is not None:
            raise aborted
        self._keep_key(turn_id, key)  # an incomplete reply: the harness retries, the sampled tokens are kept
        if completion.reasoning:
            yield ReasoningDelta(text=completion.reasoning)
        if completion.text:
            yield TextDelta(text=completion.text)
        for c in calls:
            yield ToolCallEvent(call=c)
        yield Done(completion=completion)

    async def complete(self, req: ChatRequest, ctx: TurnContext) -> Completion:
        async for ev in self.stream(req, ctx):
            if isinstance(ev, Done):
                return ev.completion
        raise ProviderError("api_error", "generation ended without a result", 500)


__all__ = ["Policy", "PolicyConfig", "TurnContext", "ReasoningDelta", "TextDelta", "ToolCallEvent", "Ping"]
