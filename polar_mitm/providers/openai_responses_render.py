"""OpenAI Responses API, its reply half: a Completion or the policy's events as the native JSON
response object or SSE stream, a recorded stream assembled, and errors (`openai_responses` is
the style, and parses requests).

Streaming follows the full event sequence real clients require: `response.created`,
`response.in_progress`, per output item `response.output_item.added` … `response.output_item.done`
with the part/delta/done events of its kind, then `response.completed` (or `response.incomplete`
when the token limit cut the reply) carrying the whole response object. Reasoning we render
carries its text in `encrypted_content` (a recognizable `polar-r1:` token, `reasoning_token`)
as well as in `summary`, so the echo maps back to the same reasoning even when a harness drops
the summary.
"""

from __future__ import annotations

import base64
import time
from collections.abc import AsyncIterator
from typing import Any

from pydantic import Field

from polar_mitm import sse
from polar_mitm.neutral import (
    ChatRequest,
    Completion,
    Done,
    Event,
    Ping,
    ProviderError,
    ReasoningDelta,
    Sampling,
    Started,
    TextDelta,
    ToolCall,
    ToolCallEvent,
)
from polar_mitm.providers import base, openai_chat
from polar_mitm.sse import JsonEvent

REASONING_TOKEN_PREFIX = "polar-r1:"
COMPACTION_TOKEN_PREFIX = "polar-c1:"

# Neutral error kind -> (OpenAI error type, code).
ERROR_TYPES: dict[str, tuple[str, str | None]] = {
    "invalid_request": ("invalid_request_error", None),
    "authentication": ("invalid_request_error", "invalid_api_key"),
    "permission": ("invalid_request_error", "permission_denied"),
    "not_found": ("invalid_request_error", "not_found"),
    # Not "server_is_overloaded": Codex takes that code as "model at capacity" and gives up, while
    # a backend that is down or broke mid-stream is worth the harness's retries.
    "overloaded": ("server_error", "server_error"),
    "rate_limit": ("requests", "rate_limit_exceeded"),
    "request_too_large": ("invalid_request_error", "request_too_large"),
    "api_error": ("server_error", "server_error"),
    "timeout": ("server_error", "timeout"),
}


class ResponsesRequest(ChatRequest):
    """A ChatRequest that remembers how each non-function tool's calls must be rendered."""

    tool_kinds: dict[str, str] = Field(default_factory=dict)  # tool name -> "custom" | "local_shell"
    compaction: bool = False  # the reply must be one `compaction` item (Codex compaction v2)
    previous_response_id: str | None = None  # echoed in the response object
    store: bool = False  # likewise (a response we give can always be continued)


def reasoning_token(text: str) -> str:
    """The `encrypted_content` we give our reasoning: the text itself, recognizable on echo."""
    return REASONING_TOKEN_PREFIX + base64.b64encode(text.encode()).decode()


def compaction_token(summary: str) -> str:
    """The `encrypted_content` of a compaction item we produce: the summary, recognizable later."""
    return COMPACTION_TOKEN_PREFIX + base64.b64encode(summary.encode()).decode()


# ---- response ----------------------------------------------------------------------------------


def response_id(turn_id: str) -> str:
    return "resp_" + turn_id.removeprefix("turn_")


def _suffix(turn_id: str) -> str:
    return turn_id.removeprefix("turn_")


def _usage(c: Completion) -> dict[str, Any]:
    return {
        "input_tokens": c.usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": c.usage.cached_tokens},
        "output_tokens": c.usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": c.usage.reasoning_tokens},
        "total_tokens": c.usage.prompt_tokens + c.usage.completion_tokens,
    }


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [{"type": "summary_text", "text": text}],
        "encrypted_content": reasoning_token(text),
    }


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content if status == "completed" else [],
    }


def _call_item(item_id: str, call: ToolCall, kind: str, status: str = "completed") -> dict[str, Any]:
    done = status == "completed"
    if kind == "custom":
        value = base.freeform_input(call)
        return {
            "type": "custom_tool_call",
            "id": item_id,
            "call_id": call.id,
            "name": call.name,
            "input": value if done else "",
            "status": status,
        }
    if kind == "local_shell":
        cmd = call.arguments.get("command")
        if isinstance(cmd, str):
            cmd = ["bash", "-lc", cmd]
        action: dict[str, Any] = {"type": "exec", "command": cmd or [], "env": {}}
        if call.arguments.get("workdir"):
            action["working_directory"] = call.arguments["workdir"]
        if call.arguments.get("timeout_ms") is not None:
            action["timeout_ms"] = call.arguments["timeout_ms"]
        return {
            "type": "local_shell_call",
            "id": item_id,
            "call_id": call.id,
            "status": status,
            "action": action,
        }
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments_json() if done else "",
        "status": status,
    }


def _status(c: Completion) -> tuple[str, dict[str, str] | None]:
    if c.finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def _response_object(
    resp_id: str,
    model: str,
    created: int,
    status: str,
    output: list[dict[str, Any]],
    *,
    usage: dict[str, Any] | None = None,
    incomplete: dict[str, str] | None = None,
    error: dict[str, Any] | None = None,
    req: ChatRequest | None = None,
) -> dict[str, Any]:
    s = req.sampling if req is not None else Sampling()
    return {
        "id": resp_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": error,
        "incomplete_details": incomplete,
        "instructions": None,
        "max_output_tokens": s.max_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": req.previous_response_id if isinstance(req, ResponsesRequest) else None,
        "reasoning": {"effort": None, "summary": None},
        "store": req.store if isinstance(req, ResponsesRequest) else False,
        "temperature": s.temperature,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": s.top_p,
        "truncation": "disabled",
        "usage": usage,
        "metadata": {},
    }


def _compaction_item(item_id: str, summary: str) -> dict[str, Any]:
    return {"type": "compaction", "id": item_id, "encrypted_content": compaction_token(summary)}


def _is_compaction(req: ChatRequest | None) -> bool:
    return isinstance(req, ResponsesRequest) and req.compaction


def render_response(c: Completion, req: ChatRequest | None = None) -> dict[str, Any]:
    sfx = _suffix(c.turn_id)
    kinds = req.tool_kinds if isinstance(req, ResponsesRequest) else {}
    output: list[dict[str, Any]] = []  # item ids as the stream names them: kind, turn, index
    if _is_compaction(req):
        output.append(_compaction_item(f"cmp_{sfx}_0", c.text))
    elif c.reasoning:
        output.append(_reasoning_item(f"rs_{sfx}_{len(output)}", c.reasoning))
    if c.text and not _is_compaction(req):
        output.append(_message_item(f"msg_{sfx}_{len(output)}", c.text))
    for call in c.tool_calls if not _is_compaction(req) else []:
        output.append(_call_item(f"fc_{sfx}_{len(output)}", call, kinds.get(call.name, "function")))
    status, incomplete = _status(c)
    return _response_object(
        response_id(c.turn_id),
        c.model,
        int(time.time()),
        status,
        output,
        usage=_usage(c),
        incomplete=incomplete,
        req=req,
    )


def _sse(data: dict[str, Any]) -> bytes:
    return sse.encode(data, event=data["type"])


def _error_body(e: ProviderError) -> dict[str, Any]:
    kind, code = ERROR_TYPES.get(e.kind, ("server_error", "server_error"))
    code = getattr(e, "code", None) or code
    if e.kind == "invalid_request" and "too long" in e.message:
        code = "context_length_exceeded"  # harnesses compact or stop instead of retrying
    return {"message": e.message, "type": kind, "param": getattr(e, "param", None), "code": code}


class _StreamWriter:
    """The state of one SSE response: sequence numbers, the open output item, finished items."""

    def __init__(self, req: ChatRequest, kinds: dict[str, str]):
        self.req = req
        self.kinds = kinds
        self.seq = 0
        self.resp_id = "resp_pending"
        self.sfx = "pending"
        self.created = int(time.time())
        self.started = False
        self.items: list[dict[str, Any]] = []
        self.open: str | None = None  # "reasoning" | "message"
        self.buf = ""

    def ev(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return _sse(data)

    def obj(self, status: str, **kw: Any) -> dict[str, Any]:
        return _response_object(
            self.resp_id, self.req.model, self.created, status, list(self.items), req=self.req, **kw
        )

    def start(self, turn_id: str) -> bytes:
        self.started = True
        self.resp_id, self.sfx = response_id(turn_id), _suffix(turn_id)
        return self.ev("response.created", response=self.obj("in_progress")) + self.ev(
            "response.in_progress", response=self.obj("in_progress")
        )

    @property
    def index(self) -> int:
        return len(self.items)

    def item_id(self) -> str:
        return {"reasoning": "rs_", "message": "msg_"}[self.open or "message"] + f"{self.sfx}_{self.index}"

    def open_item(self, kind: str) -> bytes:
        out = self.close()
        self.open, self.buf = kind, ""
        iid = self.item_id()
        if kind == "reasoning":
            item = {"type": "reasoning", "id": iid, "summary": []}
            part: dict[str, Any] = {"type": "summary_text", "text": ""}
            return (
                out
                + self.ev("response.output_item.added", output_index=self.index, item=item)
                + self.ev(
                    "response.reasoning_summary_part.added",
                    item_id=iid,
                    output_index=self.index,
                    summary_index=0,
                    part=part,
                )
            )
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return (
            out
            + self.ev(
                "response.output_item.added",
                output_index=self.index,
                item=_message_item(iid, "", "in_progress"),
            )
            + self.ev(
                "response.content_part.added",
                item_id=iid,
                output_index=self.index,
                content_index=0,
                part=part,
            )
        )

    def delta(self, text: str) -> bytes:
        self.buf += text
        iid = self.item_id()
        if self.open == "reasoning":
            return self.ev(
                "response.reasoning_summary_text.delta",
                item_id=iid,
                output_index=self.index,
                summary_index=0,
                delta=text,
            )
        return self.ev(
            "response.output_text.delta",
            item_id=iid,
            output_index=self.index,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def close(self) -> bytes:
        if self.open is None:
            return b""
        iid, i, text = self.item_id(), self.index, self.buf
        if self.open == "reasoning":
            item = _reasoning_item(iid, text)
            out = self.ev(
                "response.reasoning_summary_text.done",
                item_id=iid,
                output_index=i,
                summary_index=0,
                text=text,
            ) + self.ev(
                "response.reasoning_summary_part.done",
                item_id=iid,
                output_index=i,
                summary_index=0,
                part={"type": "summary_text", "text": text},
            )
        else:
            item = _message_item(iid, text)
            out = self.ev(
                "response.output_text.done",
                item_id=iid,
                output_index=i,
                content_index=0,
                text=text,
                logprobs=[],
            ) + self.ev(
                "response.content_part.done",
                item_id=iid,
                output_index=i,
                content_index=0,
                part=item["content"][0],
            )
        self.open = None
        self.items.append(item)
        return out + self.ev("response.output_item.done", output_index=i, item=item)

    def call(self, call: ToolCall) -> bytes:
        out = self.close()
        kind = self.kinds.get(call.name, "function")
        i = self.index
        iid = f"fc_{self.sfx}_{i}"
        item = _call_item(iid, call, kind)
        out += self.ev(
            "response.output_item.added", output_index=i, item=_call_item(iid, call, kind, "in_progress")
        )
        if kind == "custom":
            out += self.ev(
                "response.custom_tool_call_input.delta", item_id=iid, output_index=i, delta=item["input"]
            )
            out += self.ev(
                "response.custom_tool_call_input.done", item_id=iid, output_index=i, input=item["input"]
            )
        elif kind == "function":
            args = item["arguments"]
            out += self.ev("response.function_call_arguments.delta", item_id=iid, output_index=i, delta=args)
            out += self.ev(
                "response.function_call_arguments.done",
                item_id=iid,
                output_index=i,
                name=call.name,
                arguments=args,
            )
        self.items.append(item)
        return out + self.ev("response.output_item.done", output_index=i, item=item)

    def compaction(self, summary: str) -> bytes:
        i = self.index
        item = _compaction_item(f"cmp_{self.sfx}_{i}", summary)
        self.items.append(item)
        return self.ev("response.output_item.added", output_index=i, item=item) + self.ev(
            "response.output_item.done", output_index=i, item=item
        )

    def done(self, c: Completion) -> bytes:
        out = self.close()
        status, incomplete = _status(c)
        final = self.obj(status, usage=_usage(c), incomplete=incomplete)
        return out + self.ev(
            "response.completed" if status == "completed" else "response.incomplete", response=final
        )

    def failed(self, e: ProviderError) -> bytes:
        err = _error_body(e)
        out = b"" if self.started else self.start("turn_failed")
        return (
            out
            + self.ev("error", code=err["code"], message=err["message"], param=None)
            + self.ev(
                "response.failed",
                response=self.obj("failed", error={"code": err["code"], "message": e.message}),
            )
        )


async def render_stream(events: AsyncIterator[Event], req: ChatRequest) -> AsyncIterator[bytes]:
    """Responses SSE, produced as the policy generates. The end arrives only after the commit.

    A ProviderError from the policy mid-stream becomes `error` + `response.failed` events here,
    where the sequence numbers are known.
    """
    w = _StreamWriter(req, req.tool_kinds if isinstance(req, ResponsesRequest) else {})
    compaction = _is_compaction(req)
    try:
        async for ev in events:
            if isinstance(ev, Started):
                yield w.start(ev.turn_id)
                continue
            if not w.started:
                yield w.start("turn_pending")
            if compaction and not isinstance(ev, Done | Ping):
                continue  # the summary goes out whole, as one compaction item, at the end
            if compaction and isinstance(ev, Done):
                yield w.compaction(ev.completion.text) + w.done(ev.completion)
            elif isinstance(ev, Ping):
                yield sse.comment("keep-alive")  # the API has no ping event
            elif isinstance(ev, ReasoningDelta):
                yield (w.open_item("reasoning") if w.open != "reasoning" else b"") + w.delta(ev.text)
            elif isinstance(ev, TextDelta):
                yield (w.open_item("message") if w.open != "message" else b"") + w.delta(ev.text)
            elif isinstance(ev, ToolCallEvent):
                yield w.call(ev.call)
            elif isinstance(ev, Done):
                yield w.done(ev.completion)
    except ProviderError as e:
        yield w.failed(e)


def assemble(events: list[JsonEvent]) -> dict[str, Any]:
    """A recorded Responses stream as the final response object (what `response.completed`
    carries); a stream that ended early keeps the items finished so far, as `incomplete`."""
    final: dict[str, Any] | None = None
    started: dict[str, Any] = {}
    items: dict[int, dict[str, Any]] = {}
    error: Any = None
    for name, d in events:
        kind = d.get("type", name)
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            final = dict(d.get("response") or {})
        elif kind in ("response.created", "response.in_progress"):
            started = dict(d.get("response") or {})
        elif kind == "response.output_item.done":
            items[int(d.get("output_index", len(items)))] = d.get("item") or {}
        elif kind == "error":
            error = d.get("error") or {k: v for k, v in d.items() if k != "type"}
    if final is None:
        final = {**started, "status": "incomplete", "output": [items[i] for i in sorted(items)]}
    elif not final.get("output") and items:
        final["output"] = [items[i] for i in sorted(items)]
    if error is not None:
        final["error"] = error
    return final


def render_error(e: ProviderError) -> tuple[int, dict[str, Any]]:
    return e.status, {"error": _error_body(e)}


def render_stream_error(e: ProviderError) -> bytes:
    """An error after the stream began, when no stream state is at hand."""
    err = _error_body(e)
    failed = _response_object(
        "resp_failed", "", int(time.time()), "failed", [], error={"code": err["code"], "message": e.message}
    )
    return _sse(
        {"type": "error", "sequence_number": 0, "code": err["code"], "message": e.message, "param": None}
    ) + _sse({"type": "response.failed", "sequence_number": 1, "response": failed})


def render_count(n: int) -> dict[str, Any]:
    return {"object": "response.input_tokens", "input_tokens": n}


# GET /v1/models is one OpenAI endpoint, whichever generation API a client speaks.
render_models = openai_chat.render_models
