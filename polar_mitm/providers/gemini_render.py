"""Google Gemini API, its reply half: a Completion or the policy's events as the native JSON or
SSE (`alt=sse`), a recorded stream assembled, and errors in Google's shape (`gemini` is the
style, and parses requests).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from polar_mitm import sse
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
    ToolCall,
    ToolCallEvent,
)
from polar_mitm.sse import JsonEvent

# neutral kind -> (HTTP status, google.rpc.Code name). Gemini CLI retries 429 and 5xx, so an
# unreachable policy backend is 503 UNAVAILABLE (Google's own code for it), never Anthropic's 529.
ERROR_CODES: dict[str, tuple[int, str]] = {
    "invalid_request": (400, "INVALID_ARGUMENT"),
    "authentication": (401, "UNAUTHENTICATED"),
    "permission": (403, "PERMISSION_DENIED"),
    "not_found": (404, "NOT_FOUND"),
    "rate_limit": (429, "RESOURCE_EXHAUSTED"),
    "request_too_large": (413, "INVALID_ARGUMENT"),
    "overloaded": (503, "UNAVAILABLE"),
    "timeout": (504, "DEADLINE_EXCEEDED"),
    "api_error": (500, "INTERNAL"),
}


# ---- response ----------------------------------------------------------------------------------

_FINISH = {"stop": "STOP", "tool_calls": "STOP", "length": "MAX_TOKENS", "abort": "OTHER", "error": "OTHER"}


def _finish_reason(c: Completion) -> str:
    # A call whose arguments are not a JSON object cannot be a Gemini functionCall.
    if any(call.raw is not None for call in c.tool_calls):
        return "MALFORMED_FUNCTION_CALL"
    return _FINISH.get(c.finish_reason, "STOP")


def response_id(turn_id: str) -> str:
    return turn_id.removeprefix("turn_")


def _usage(c: Completion) -> dict[str, int]:
    # Gemini counts thoughts apart from candidates.
    out = {
        "promptTokenCount": c.usage.prompt_tokens,
        "candidatesTokenCount": c.usage.completion_tokens - c.usage.reasoning_tokens,
        "totalTokenCount": c.usage.prompt_tokens + c.usage.completion_tokens,
    }
    if c.usage.reasoning_tokens:
        out["thoughtsTokenCount"] = c.usage.reasoning_tokens
    if c.usage.cached_tokens:
        out["cachedContentTokenCount"] = c.usage.cached_tokens
    return out


def _function_call(call: ToolCall) -> dict[str, Any]:
    return {"functionCall": {"id": call.id, "name": call.name, "args": call.arguments}}


def render_response(c: Completion, req: ChatRequest | None = None) -> dict[str, Any]:
    del req  # the reply does not depend on how the request was made
    parts: list[dict[str, Any]] = []
    if c.reasoning:
        parts.append({"text": c.reasoning, "thought": True})
    if c.text:
        parts.append({"text": c.text})
    parts.extend(_function_call(call) for call in c.tool_calls if call.raw is None)
    return {
        "candidates": [
            {"content": {"role": "model", "parts": parts}, "finishReason": _finish_reason(c), "index": 0}
        ],
        "usageMetadata": _usage(c),
        "modelVersion": c.model,
        "responseId": response_id(c.turn_id),
    }


def _sse(data: dict[str, Any]) -> bytes:
    # Google terminates events with CRLF CRLF; the data line must stay one line.
    return sse.encode(data, eol="\r\n")


# Keep-alive: a bare line break. An SSE comment (": ping") would wedge the google-genai JS parser,
# which only accepts `data:` lines, optionally preceded by whitespace.
KEEPALIVE = b"\r\n"


async def render_stream(events: AsyncIterator[Event], req: ChatRequest) -> AsyncIterator[bytes]:
    """One GenerateContentResponse chunk per delta, then a last chunk with finishReason and
    usageMetadata, sent only after the turn is committed."""
    rid = ""

    def chunk(parts: list[dict[str, Any]], **candidate: Any) -> bytes:
        body: dict[str, Any] = {
            "candidates": [{"content": {"role": "model", "parts": parts}, "index": 0, **candidate}],
            "modelVersion": req.model,
            "responseId": rid,
        }
        return _sse(body)

    async for ev in events:
        if isinstance(ev, Started):
            rid = response_id(ev.turn_id)
        elif isinstance(ev, Ping):
            yield KEEPALIVE
        elif isinstance(ev, ReasoningDelta):
            yield chunk([{"text": ev.text, "thought": True}])
        elif isinstance(ev, TextDelta):
            yield chunk([{"text": ev.text}])
        elif isinstance(ev, ToolCallEvent):
            if ev.call.raw is None:
                yield chunk([_function_call(ev.call)])
        elif isinstance(ev, Done):
            c = ev.completion
            rid = response_id(c.turn_id)
            # Empty model parts are valid for Gemini CLI; an empty text part is not.
            yield _sse(
                {
                    "candidates": [
                        {
                            "content": {"role": "model", "parts": []},
                            "finishReason": _finish_reason(c),
                            "index": 0,
                        }
                    ],
                    "usageMetadata": _usage(c),
                    "modelVersion": req.model,
                    "responseId": rid,
                }
            )


def assemble(events: list[JsonEvent]) -> dict[str, Any]:
    """Recorded streamGenerateContent chunks (SSE, or the JSON array sent without alt=sse) as
    one GenerateContentResponse, consecutive text parts of one kind merged."""
    out: dict[str, Any] = {}
    parts: list[dict[str, Any]] = []
    candidate: dict[str, Any] = {"index": 0}
    for _, d in events:
        if "error" in d:
            out["error"] = d["error"]
            continue
        for k in ("usageMetadata", "modelVersion", "responseId", "promptFeedback"):
            if d.get(k) is not None:
                out[k] = d[k]
        for cand in (d.get("candidates") or [])[:1]:
            for p in (cand.get("content") or {}).get("parts") or []:
                last = parts[-1] if parts else None
                if (
                    last is not None
                    and isinstance(p.get("text"), str)
                    and isinstance(last.get("text"), str)
                    and bool(last.get("thought")) == bool(p.get("thought"))
                ):
                    last["text"] += p["text"]
                    if p.get("thoughtSignature"):
                        last["thoughtSignature"] = p["thoughtSignature"]
                else:
                    parts.append(dict(p))
            for k, v in cand.items():
                if k not in ("content", "index"):
                    candidate[k] = v
    out["candidates"] = [{"content": {"role": "model", "parts": parts}, **candidate}]
    return out


def render_error(e: ProviderError) -> tuple[int, dict[str, Any]]:
    status, code = ERROR_CODES.get(e.kind, (e.status, "UNKNOWN"))
    return status, {"error": {"code": status, "message": e.message, "status": code}}


def render_stream_error(e: ProviderError) -> bytes:
    # Google ends a broken stream with a bare JSON error object (no `data:` line); the genai SDK
    # recognizes it and raises an ApiError with its code, which Gemini CLI retries when 429/5xx.
    return json.dumps(render_error(e)[1], ensure_ascii=False).encode()


def render_count(n: int) -> dict[str, Any]:
    return {"totalTokens": n}


def render_models(names: list[str]) -> dict[str, Any]:
    return {
        "models": [
            {
                "name": f"models/{n}",
                "baseModelId": n,
                "version": "polar",
                "displayName": n,
                "supportedGenerationMethods": ["generateContent", "streamGenerateContent", "countTokens"],
            }
            for n in names
        ]
    }
