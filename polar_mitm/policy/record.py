"""What one finished generation is: the completion it reports (`build_completion`, the one builder of
both backend modes, so their usage cannot drift apart), the counts in it, and its stored form
(`Turn`)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

from polar_mitm.backends.parsers import REASONING_FORMATS
from polar_mitm.backends.render import extend_hash
from polar_mitm.backends.tokenizer import Tokenizer
from polar_mitm.neutral import ChatRequest, Completion, FinishReason, ToolCall, Usage
from polar_mitm.policy.config import TurnContext
from polar_mitm.store.turn import Turn


def build_completion(
    turn_id: str,
    req: ChatRequest,
    *,
    text: str,
    reasoning: str,
    tool_calls: list[ToolCall],
    finish_reason: FinishReason,
    stop_sequence: str | None,
    prompt_tokens: int,
    output_ids: Sequence[int],
    cached_tokens: int,
    reasoning_tokens: int,
) -> Completion:
    """A finished turn's completion, in either mode: its parsed output, its finish (a stop with
    tool calls ends for the tool calls), and its usage with every count."""
    return Completion(
        turn_id=turn_id,
        model=req.model,
        text=text,
        reasoning=reasoning,
        tool_calls=tool_calls,
        finish_reason="tool_calls" if tool_calls and finish_reason == "stop" else finish_reason,
        stop_sequence=stop_sequence,
        usage=Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=len(output_ids),
            cached_tokens=cached_tokens,
            reasoning_tokens=reasoning_tokens,
        ),
    )


def reasoning_token_count(
    tok: Tokenizer, output_ids: Sequence[int], reasoning_parser: str | None, has_reasoning: bool
) -> int:
    """How many sampled tokens belong to the reasoning block (through its closing marker, the
    one `reasoning_parser`'s format closes with: `</think>` for most, `◁/think▷` for kimi's).

    A marker that is one vocabulary entry is found by its id; one the vocabulary spells in
    several tokens, by the shortest run of sampled ids whose text holds it."""
    if not has_reasoning or reasoning_parser is None:
        return 0
    close = REASONING_FORMATS[reasoning_parser].close
    end = tok.token_id(close)
    if end is not None:
        return output_ids.index(end) + 1 if end in output_ids else len(output_ids)
    if close not in tok.decode(output_ids):
        return len(output_ids)
    lo, hi = 1, len(output_ids)  # the text of output_ids[:hi] holds the marker
    while lo < hi:
        mid = (lo + hi) // 2
        if close in tok.decode(output_ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return hi


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
    logprobs_mode: str | None = None,
    tool_parse: dict | None = None,
) -> Turn:
    """The stored form of one generation; post_hash lets a later echo of the reply find it.

    Built without validation: every value is ours or already checked (a 30k-token prompt would
    otherwise be validated id by id on every turn). `created_at` is given rather than left to its
    default factory, whose signature pydantic would inspect on every turn."""
    return Turn.model_construct(
        id=turn_id,
        created_at=time.time(),
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
        logprobs_mode=logprobs_mode,
        tool_parse=None if tool_parse is None else json.dumps(tool_parse, separators=(",", ":")),
        msg_hash=msg_hash,
        post_hash=extend_hash(msg_hash, completion.as_message()) if completion else None,
        request=ctx.raw_request,
        request_headers=ctx.headers,
        response=completion.model_dump_json() if completion else None,
        error=error,
        latency_ms=(time.perf_counter() - started) * 1000,
    )
