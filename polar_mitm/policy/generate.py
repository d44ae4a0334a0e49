"""One generation, from a neutral request to a stream of neutral events, in either backend mode:
render (we render the prompt ids and stream `/generate`, parsing the text as it comes) or chat
(the server renders, and its whole reply comes at once).

Both wait on the engine through one loop (`paced`): keep-alive pings while nothing arrives, the
first-token and idle limits, and the engine's liveness probes until its first token and whenever
the stream goes silent after it (a hung engine fails the turn within `engine_dead_after`, not
`idle_timeout`). Both commit
the turn to the store before the final event is yielded, so the harness never sees the end of a
reply that is not on disk."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeGuard, TypeVar

from polar_mitm.backends import logprobs
from polar_mitm.backends.chat_mode import ChatResult, chat_body, parse_chat_result
from polar_mitm.backends.engine_api import EngineUnreachable, GenerateState, ids_json
from polar_mitm.backends.engine_client import EngineClient, GenerateStream
from polar_mitm.backends.engines import Engine, EnginePool
from polar_mitm.backends.parsers import OutputParser, new_call_id
from polar_mitm.backends.render import PromptIds
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
    new_turn_id,
)
from polar_mitm.policy.admission import Admission
from polar_mitm.policy.config import PolicyConfig, TurnContext
from polar_mitm.policy.discovery import Discovery
from polar_mitm.policy.gate import WeightGate
from polar_mitm.policy.prompt import Prompts, join_ids
from polar_mitm.policy.record import build_completion, reasoning_token_count, turn_record
from polar_mitm.policy.versions import WeightVersions
from polar_mitm.store.turn import Turn
from polar_mitm.store.writer import Store

log = logging.getLogger("polar_mitm.policy")

T = TypeVar("T")


def _aborted(fr: Any) -> TypeGuard[dict[str, Any]]:
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


def _finish(chunk: GenerateState | None) -> tuple[Literal["stop", "length"], str | None]:
    """(the finish, the stop string that matched) of a render-mode reply."""
    fr = (chunk.finish_reason if chunk else None) or {}
    if fr.get("type") == "length":
        return "length", None
    matched = fr.get("matched")
    return "stop", matched if isinstance(matched, str) else None


@dataclass(eq=False)
class _RenderTurn:
    """A render-mode turn once planned: the prompt, how its output is parsed, the engine and its
    call (`gen`, whose state gathers the sampled ids and logprobs), and how it stands."""

    req: ChatRequest
    ctx: TurnContext
    turn_id: str
    t0: float
    tok: Tokenizer
    reasoning_parser: str | None
    parser: OutputParser
    prompt_ids: list[int]
    ref: str | None
    ref_len: int
    hashes: list[str]
    sent_ids: bytes
    key: str
    engine: Engine
    gen: GenerateStream
    logprobs_mode: str | None = None  # what the engine's logprobs are of (backends/logprobs.py)
    # The weight version for this turn, where the engine API's replies name none (vLLM's
    # /v1/completions: `WeightVersions.reading`).
    version: asyncio.Future[str | None] | None = None
    started: bool = False  # the harness was sent Started
    error: str | None = None  # why the turn failed, once it did
    committed: bool = False  # its record is in the store

    @property
    def state(self) -> GenerateState:
        return self.gen.state

    def record(self, status: str, completion: Completion | None, finish_reason: str | None = None) -> Turn:
        state = self.gen.state
        return turn_record(
            self.turn_id,
            self.req,
            self.ctx,
            status=status,
            completion=completion,
            prompt_ids=self.prompt_ids,
            ref=self.ref,
            ref_len=self.ref_len,
            output_ids=state.output_ids,
            output_logprobs=state.output_logprobs,
            weight_version=state.weight_version
            if state.weight_version is not None
            else WeightVersions.value(self.version),
            msg_hash=self.hashes[-1],
            error=self.error,
            started=self.t0,
            finish_reason=finish_reason,
            logprobs_mode=self.logprobs_mode,
            tool_parse=self.parser.parse_status(),
        )


@dataclass(eq=False)
class _ChatTurn:
    """A chat-mode turn once its call is sent: the conversation's hashes and the turn it echoes
    (if any), its routing key and engine, the call (`task`, the whole reply) and the weight
    version's reading, where one was sent."""

    req: ChatRequest
    ctx: TurnContext
    turn_id: str
    t0: float
    logprobs_mode: str | None
    hashes: list[str]
    echo: tuple[str, int] | None
    key: str
    engine: Engine
    task: asyncio.Future[dict[str, Any]]
    version: asyncio.Future[str | None] | None


class Generation:
    """Runs turns: the prompt, the engine call, the wait loop, the parse and the stored record."""

    def __init__(
        self,
        config: PolicyConfig,
        store: Store,
        client: EngineClient,
        engines: EnginePool,
        discovery: Discovery,
        prompts: Prompts,
        gate: WeightGate,
        versions: WeightVersions,
        admission: Admission,
    ):
        self.config = config
        self.store = store
        self.client = client
        self.engines = engines
        self.discovery = discovery
        self.prompts = prompts
        self.gate = gate
        self.versions = versions
        self.admission = admission
        self._warned: set[str] = set()  # logprob mismatches already logged

    async def logprobs_mode(self, req: ChatRequest, ask: bool = True) -> str | None:
        """What the engine's logprobs of this turn are of (stored with the turn); says once per
        reason, loudly, when they are not the distribution the turn samples from."""
        mode = await self.discovery.logprobs_mode(ask)
        why = logprobs.mismatch(mode, req.sampling)
        if why is not None and why.split(",")[0] not in self._warned:
            self._warned.add(why.split(",")[0])
            fix = f" (start vLLM with {logprobs.VLLM_FLAG})" if mode == "raw" else ""
            log.warning(
                "stored logprobs (%s) are not those of the distribution the tokens were sampled from: %s%s; "
                "a trainer's importance ratios from them are off",
                mode,
                why,
                fix,
            )
        return mode

    # -- waiting on the engine -------------------------------------------------------------------

    async def paced(
        self,
        receive: Callable[[float], Awaitable[T | None]],
        engine: Engine,
        waiting_first: Callable[[], bool],
    ) -> AsyncGenerator[T | None, None]:
        """What `receive(timeout)` brings, and None each `ping_interval` that brought nothing (the
        caller pings the harness). While `waiting_first()` the first-token limit applies; after, the
        idle limit since the last arrival. The engine's liveness is watched until the first
        arrival, and again from the last one whenever a `ping_interval` brings nothing after it
        (a stream that flows costs no probe). Raises the retryable error when a limit passes or
        the engine fails its probes. Close it (aclosing)."""
        loop = asyncio.get_running_loop()
        heard = loop.time()  # when the request went out, then when the last chunk came
        watch = self._liveness_watch(engine, heard)
        try:
            while True:
                first = waiting_first()
                limit = self.config.first_token_timeout if first else self.config.idle_timeout
                left = heard + limit - loop.time() if limit else None
                last_wait = left is not None and left <= self.config.ping_interval
                got = await receive(
                    max(left, 0.0) if last_wait and left is not None else self.config.ping_interval
                )
                if got is None:
                    if last_wait:
                        raise self.silence(first_token=first, url=engine.url)
                    if watch is not None and watch.done():
                        raise self.engine_dead(engine)
                    if watch is None:  # silent mid-stream: is the engine still there?
                        watch = self._liveness_watch(engine, heard)
                    yield None
                    continue
                heard = loop.time()
                if watch is not None:
                    watch.cancel()
                    watch = None
                yield got
        finally:
            if watch is not None:
                watch.cancel()

    def _liveness_watch(self, engine: Engine, since: float) -> asyncio.Task | None:
        """A task that ends when `engine` has passed no liveness probe for engine_dead_after
        seconds counted from loop time `since` (None when probing is off)."""
        if not self.config.engine_dead_after or not self.config.engine_probe_interval:
            return None
        return asyncio.ensure_future(self.engines.watch(engine, self.config.engine_dead_after, since))

    def engine_dead(self, engine: Engine) -> ProviderError:
        """The retryable error for a turn whose engine stopped passing its liveness check."""
        self.engines.mark_dead(engine, "failed its health check")
        return ProviderError(
            "overloaded",
            f"policy backend {engine.url} failed its health check ({self.engines.health_path}) for "
            f"{self.config.engine_dead_after:g} s (--engine-dead-after): the engine is hung or down; "
            "retry the request",
            529,
        )

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

    # -- render mode -----------------------------------------------------------------------------

    async def stream(self, req: ChatRequest, ctx: TurnContext) -> AsyncGenerator[Event, None]:
        """A render-mode turn: admitted by its text (`Admission.text`), planned (`_plan`), run
        through the gate and the engine's stream (`_run`), committed to the store before its last
        event (`_commit`). Whatever ends it early, the tokens the engine sent are recorded (as an
        error or an aborted turn)."""
        await self.admission.text(req)
        turn = await self._plan(req, ctx)
        stopped: str | None = None  # why the turn's stream was ended from outside, if it was
        try:
            async for ev in self.gate.through(turn.turn_id, len(turn.prompt_ids)):
                turn.started = True
                yield ev
            api = turn.gen.api
            # Past the gate: read beside the generation, where it may have changed.
            if not api.VERSION_IN_REPLY:
                turn.version = self.versions.reading(api, turn.engine.url, ctx.session_id)
            with self.gate.generation():
                async with contextlib.aclosing(self._run(turn)) as events:
                    async for ev in events:
                        yield ev
                completion = await self._commit(turn)
                yield Done(completion=completion)
        except ProviderError as e:
            turn.error = e.message
            if isinstance(e, EngineUnreachable):
                self.engines.mark_dead(turn.engine, e.message)
            raise
        except (GeneratorExit, asyncio.CancelledError) as e:  # the reader went away, or shutdown
            stopped = "closed" if isinstance(e, GeneratorExit) else "cancelled"
            raise
        finally:
            await turn.gen.aclose()
            if not turn.committed and turn.state.chunks:
                status = "error" if turn.error else "aborted"
                try:
                    await asyncio.shield(self.store.insert_turn(turn.record(status, None)))
                except Exception:  # never mask the original failure
                    log.exception("could not record %s turn %s", status, turn.turn_id)
            elif not turn.committed and stopped:
                log.info("turn %s %s before the engine sent a token: nothing to store", turn.turn_id, stopped)

    async def _plan(self, req: ChatRequest, ctx: TurnContext) -> _RenderTurn:
        """The prompt ids (spliced), the parsers, the token budget within the policy's context
        (`Admission.budget`), the engine for the conversation and its call, opened last (nothing
        is sent before it is read). Raises the harness's error for a prompt the policy cannot take."""
        t0 = time.perf_counter()
        tok = await self.discovery.tokenizer()
        prompt_ids, ref, ref_len, hashes = await self.prompts.prompt(req, ctx.session_id)
        tool_parser, reasoning_parser = await self.discovery.parsers()
        parser = OutputParser(
            tool_parser if req.tools else None,
            reasoning_parser,
            in_reasoning=await self.prompts.reasoning_open(req, reasoning_parser),
            id_prefix=ctx.id_prefix,
            tools=req.tools,  # formats with text values (qwen3_coder, glm45) type them by the schema
        )
        max_tokens = await self.admission.budget(req, len(prompt_ids))
        api = await self.discovery.engine_api()
        lp_mode = await self.logprobs_mode(req)
        params = api.sampling_params(
            req.sampling.model_copy(update={"max_tokens": max_tokens}),
            default_max_tokens=self.config.default_max_tokens,
        )
        streamed, cumulative = await self.discovery.backend_streaming()
        sent_ids = self.prompts.serialized(prompt_ids, ref, ref_len)
        if isinstance(prompt_ids, PromptIds):
            prompt_ids = prompt_ids[:]  # a plain list: array() and others take their fast path
        key = self.prompts.routing_key(req, ctx.session_id, hashes, ref)
        engine = self.engines.pick(key)
        gen = self.client.generate(
            api, sent_ids, params, stream=streamed, cumulative=cumulative, url=engine.url, routing_key=key
        )
        return _RenderTurn(
            req=req,
            ctx=ctx,
            turn_id=new_turn_id(),
            t0=t0,
            tok=tok,
            reasoning_parser=reasoning_parser,
            parser=parser,
            prompt_ids=prompt_ids,
            ref=ref,
            ref_len=ref_len,
            hashes=hashes,
            sent_ids=sent_ids,
            key=key,
            engine=engine,
            gen=gen,
            logprobs_mode=lp_mode,
        )

    async def _run(self, turn: _RenderTurn) -> AsyncGenerator[Event, None]:
        """The engine's stream, parsed as it comes, with pings while it is silent; an abort is
        recorded (the sampled tokens kept) before the harness hears of it."""
        state, parser, gen = turn.state, turn.parser, turn.gen

        async def receive(timeout: float) -> str | None:
            return await gen.next(timeout, self.config.chunk_interval)

        # Until a first chunk (in whole mode: until the reply), the first-token limit.
        async with contextlib.aclosing(self.paced(receive, turn.engine, lambda: not state.chunks)) as deltas:
            async for delta in deltas:
                if delta is None:
                    if not turn.started:
                        turn.started = True
                        yield Started(turn_id=turn.turn_id, prompt_tokens=len(turn.prompt_ids))
                    yield Ping()
                    continue
                if not state.chunks:
                    break  # the stream ended without a chunk
                if _aborted(state.finish_reason):
                    break  # before Started: an abort on the first chunk sends the harness nothing
                if not turn.started:
                    turn.started = True
                    yield Started(turn_id=turn.turn_id, prompt_tokens=len(turn.prompt_ids))
                for ev in parser.feed(delta, tokens=len(state.output_ids)):
                    yield ev
                if state.finish_reason is not None or gen.finished:
                    break
        if _aborted(state.finish_reason):
            aborted = abort_error(state.finish_reason, turn.engine.url)
            turn.error = aborted.message
            await WeightVersions.settle(turn.version)
            # Recorded once, here, before the harness hears of it: the sampled tokens are kept.
            await asyncio.shield(self.store.insert_turn(turn.record("aborted", None, finish_reason="abort")))
            turn.committed = True
            raise aborted
        for ev in parser.finish():
            yield ev

    async def _commit(self, turn: _RenderTurn) -> Completion:
        """The finished turn's completion, stored; the conversation's routing key and sent ids
        kept for its next turn."""
        state, parser = turn.state, turn.parser
        finish, stop_seq = _finish(state if state.chunks else None)
        completion = build_completion(
            turn.turn_id,
            turn.req,
            text=parser.text,
            reasoning=parser.reasoning,
            tool_calls=parser.tool_calls,
            finish_reason=finish,
            stop_sequence=stop_seq,
            prompt_tokens=len(turn.prompt_ids),
            output_ids=state.output_ids,
            cached_tokens=state.cached_tokens or 0,
            reasoning_tokens=reasoning_token_count(
                turn.tok, state.output_ids, turn.reasoning_parser, bool(parser.reasoning)
            ),
        )
        await WeightVersions.settle(turn.version)
        await asyncio.shield(self.store.insert_turn(turn.record("ok", completion)))
        turn.committed = True
        self.prompts.keep_key(turn.turn_id, turn.key)
        self.prompts.keep_sent(
            turn.turn_id,
            turn.ref,
            len(turn.prompt_ids) + len(state.output_ids),
            join_ids(turn.sent_ids, ids_json(state.output_ids)),
        )
        return completion

    # -- chat mode -------------------------------------------------------------------------------

    async def stream_chat(self, req: ChatRequest, ctx: TurnContext) -> AsyncGenerator[Event, None]:
        """A chat-mode turn: through the gate, the engine's call (`_plan_chat`), its whole reply
        waited for with pings (`_wait_chat`), the turn stored (`_commit_chat`; an abort is stored
        and raised), then the reply told to the harness in one piece."""
        t0 = time.perf_counter()
        turn_id = new_turn_id()
        lp_mode = await self.logprobs_mode(req, ask=False)
        gated = False
        async for ev in self.gate.through(turn_id, 0):
            gated = True
            yield ev
        turn = await self._plan_chat(req, ctx, turn_id, t0, lp_mode)
        with self.gate.generation():  # from the call until its task is done
            try:
                if not gated:
                    yield Started(turn_id=turn_id, prompt_tokens=0)
                async with contextlib.aclosing(self._wait_chat(turn)) as waits:
                    async for ev in waits:
                        yield ev
                data = self._chat_reply(turn)
                result = parse_chat_result(data)
            finally:
                if not turn.task.done():
                    turn.task.cancel()
                    await asyncio.wait({turn.task})
        completion = await self._commit_chat(turn, data, result)
        if completion.reasoning:
            yield ReasoningDelta(text=completion.reasoning)
        if completion.text:
            yield TextDelta(text=completion.text)
        for c in completion.tool_calls:
            yield ToolCallEvent(call=c)
        yield Done(completion=completion)

    async def _plan_chat(
        self, req: ChatRequest, ctx: TurnContext, turn_id: str, t0: float, lp_mode: str | None
    ) -> _ChatTurn:
        """The conversation's routing key and engine, and the engine's call, sent (with the weight
        version's reading beside it where the engine's chat replies name none)."""
        hashes, echo = await self.prompts.echoed_turn(req, ctx.session_id)
        key = self.prompts.routing_key(req, ctx.session_id, hashes, echo[0] if echo is not None else None)
        engine = self.engines.pick(key)
        api = self.discovery.known_api()
        version = (
            None if api.VERSION_IN_CHAT_REPLY else self.versions.reading(api, engine.url, ctx.session_id)
        )
        body = chat_body(req, self.admission.max_tokens(req))
        task = asyncio.ensure_future(self.client.chat(body, url=engine.url, routing_key=key))
        return _ChatTurn(req, ctx, turn_id, t0, lp_mode, hashes, echo, key, engine, task, version)

    async def _wait_chat(self, turn: _ChatTurn) -> AsyncGenerator[Event, None]:
        """Pings until the engine's call is done. The reply arrives whole: the first-token limit
        bounds it, the engine is watched throughout."""
        task = turn.task

        async def receive(timeout: float) -> asyncio.Future | None:
            done, _ = await asyncio.wait({task}, timeout=timeout)
            return task if done else None

        async with contextlib.aclosing(self.paced(receive, turn.engine, lambda: True)) as waits:
            async for done in waits:
                if done is not None:
                    break
                yield Ping()

    def _chat_reply(self, turn: _ChatTurn) -> dict[str, Any]:
        """The engine's reply; an engine that did not answer is marked dead."""
        try:
            return turn.task.result()
        except EngineUnreachable as e:
            self.engines.mark_dead(turn.engine, e.message)
            raise

    async def _commit_chat(self, turn: _ChatTurn, data: Any, result: ChatResult) -> Completion:
        """The finished turn's completion, stored; an aborted one is stored and its error raised
        (an incomplete reply: the harness retries, the sampled tokens are kept)."""
        req, ctx, echo = turn.req, turn.ctx, turn.echo
        abort = _chat_abort(data)
        aborted = abort_error(abort, turn.engine.url) if abort is not None else None
        ref, ref_len = (
            await self.prompts.extends(result.prompt_ids, echo[0]) if echo is not None else (None, 0)
        )
        calls = [c.model_copy(update={"id": new_call_id(ctx.id_prefix)}) for c in result.tool_calls]
        await WeightVersions.settle(turn.version)
        completion = build_completion(
            turn.turn_id,
            req,
            text=result.text,
            reasoning=result.reasoning,
            tool_calls=calls,
            finish_reason=result.finish_reason,
            stop_sequence=result.stop_sequence,
            prompt_tokens=len(result.prompt_ids),
            output_ids=result.output_ids,
            cached_tokens=result.cached_tokens,
            reasoning_tokens=result.reasoning_tokens,
        )
        rec = turn_record(
            turn.turn_id,
            req,
            ctx,
            status="aborted" if aborted else "ok",
            completion=None if aborted else completion,
            prompt_ids=result.prompt_ids,
            ref=ref,
            ref_len=ref_len,
            output_ids=result.output_ids,
            output_logprobs=result.output_logprobs,
            weight_version=result.weight_version
            if result.weight_version is not None
            else WeightVersions.value(turn.version),
            msg_hash=turn.hashes[-1],
            error=aborted.message if aborted else None,
            started=turn.t0,
            finish_reason="abort" if aborted else None,
            logprobs_mode=turn.logprobs_mode,
        )
        await asyncio.shield(self.store.insert_turn(rec))
        if aborted is not None:
            raise aborted
        self.prompts.keep_key(turn.turn_id, turn.key)
        return completion
