"""Anthropic Messages API: native request → ChatRequest, Completion/events → native JSON or SSE.

Claude Code's volatile request noise is normalized here, where it is parsed: the per-request
`x-anthropic-billing-header … cch=` system line is dropped (`base.without_billing_line`, as in
every style) and `cache_control` markers are never read, so the same conversation always maps to the same neutral messages.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import time
from collections.abc import AsyncIterator
from typing import Any

from polar_mitm import sse
from polar_mitm.neutral import (
    ChatRequest,
    Completion,
    Done,
    Event,
    FinishReason,
    Message,
    Ping,
    ProviderError,
    ReasoningDelta,
    Sampling,
    Started,
    TextDelta,
    Tool,
    ToolCall,
    ToolCallEvent,
)
from polar_mitm.providers import base, fields
from polar_mitm.providers.base import Endpoint, ItemMemo, each
from polar_mitm.sse import JsonEvent

NAME = "anthropic"
ID_PREFIX = "toolu_"
HOSTS = ["api.anthropic.com"]
# The Messages API's request fields: those read, then those the policy has no use for (billing,
# routing, server-side tools it cannot run). Anything else is said once per session.
KNOWN_FIELDS = frozenset(
    {"model", "messages", "max_tokens", "system", "tools", "tool_choice", "temperature", "top_p"}
    | {"top_k", "stop_sequences", "stream", "thinking", "output_format"}
    | {"metadata", "service_tier", "container", "mcp_servers"}
    # Claude Code 2.1.33x: models the server may fall back to when one is overloaded, and the
    # context of the server's own screening of tool calls (auto mode); neither is prompt.
    | {"fallbacks", "safeguards"}
)


def unknown_fields(body: Any) -> list[str]:
    unknown = base.unknown_fields(body, KNOWN_FIELDS)
    # Claude Code sends these every turn in forms the policy reads or that change nothing it sees:
    # an effort hint, a structured output format (read as the JSON schema), and clearing thinking
    # from history (which the policy's template decides); OpenClaw asks for server-side compaction
    # past a threshold (the policy is given the whole context; past its window the harness is told
    # the prompt is too long, and compacts). Other forms (clearing tool results server-side) would
    # change what the policy sees: said.
    if "output_config" in unknown and _keys_within(body.get("output_config"), {"effort", "format"}):
        unknown.remove("output_config")
    if "context_management" in unknown and _only_clears_thinking(body.get("context_management")):
        unknown.remove("context_management")
    # Claude Code 2.1.33x names the previous reply it received (`{"previous_message_id": ...}`):
    # client diagnostics, not prompt.
    if "diagnostics" in unknown and _keys_within(body.get("diagnostics"), {"previous_message_id"}):
        unknown.remove("diagnostics")
    return unknown


def _json_schema(body: dict[str, Any]) -> dict[str, Any] | None:
    """Structured outputs: `output_config.format` (or the beta's `output_format`) of type
    `json_schema` asks for a reply matching `schema` (Claude Code's title call does), which the
    engine's constrained decoding enforces."""
    config = fields.opt_obj(body, "output_config", "")
    where = "output_config.format"
    fmt = config.get("format") if config is not None else None
    if fmt is None:
        fmt, where = body.get("output_format"), "output_format"
    if fmt is None:
        return None
    fmt = fields.obj(fmt, where)
    if fields.type_tag(fmt, where) != "json_schema":
        raise _bad(f"{where}.type: only 'json_schema' is supported")
    return fields.schema(fmt, "schema", where)


def _keys_within(value: Any, allowed: set[str]) -> bool:
    return isinstance(value, dict) and set(value) <= allowed


def _only_clears_thinking(value: Any) -> bool:
    edits = value.get("edits") if isinstance(value, dict) else None
    return (
        _keys_within(value, {"edits"})
        and isinstance(edits, list)
        and all(
            isinstance(e, dict) and str(e.get("type", "")).startswith(("clear_thinking", "compact_"))
            for e in edits
        )
    )


ERROR_TYPES = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "overloaded": "overloaded_error",
    "rate_limit": "rate_limit_error",
    "request_too_large": "request_too_large",
    "api_error": "api_error",
    "timeout": "api_error",
}


def endpoint(method: str, path: str) -> Endpoint | None:
    """Which Messages API endpoint a request is for, or None for a side endpoint."""
    p = path.split("?", 1)[0].rstrip("/")
    if method == "POST" and p == "/v1/messages":
        return "generate"
    if method == "POST" and p == "/v1/messages/count_tokens":
        return "count_tokens"
    if method == "GET" and (p == "/v1/models" or p.startswith("/v1/models/")):
        return "models"
    return None


# ---- request -----------------------------------------------------------------------------------


def _bad(msg: str) -> ProviderError:
    return fields.InvalidRequest(msg)


def signature_for(thinking: str) -> str:
    """A synthetic signature derived from the thinking text, so an echo can be recognized."""
    digest = hashlib.sha256(b"polar-mitm/thinking\x00" + thinking.encode()).digest()
    return "polar:" + base64.b64encode(digest).decode()


def _text_of(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}: content must be a string or a list of content blocks")
    parts = []
    for j, b in enumerate(content):
        if not isinstance(b, dict):
            raise _bad(f"{where}.{j}: content blocks must be objects")
        t = fields.type_tag(b, f"{where}.{j}")
        if t == "text":
            parts.append(fields.opt_str(b, "text", f"{where}.{j}"))
        elif t in ("image", "document"):
            parts.append(f"[{t}]")
    return "\n\n".join(parts)


def _system_text(system: Any) -> str:
    text = base.without_billing_line(_text_of(system, "system"))
    return re.sub(r"^(\s*\n)+", "", text).strip("\n") if text.strip() else ""


def _block(where: str, b: Any) -> tuple[str, str | ToolCall] | None:
    """One block of an assistant's content: ("text" | "thinking", text) or ("call", ToolCall)."""
    if not isinstance(b, dict):
        raise _bad(f"{where}: must be an object")
    t = fields.type_tag(b, where)
    if t == "text":
        return "text", fields.opt_str(b, "text", where)
    if t == "thinking":
        return "thinking", fields.opt_str(b, "thinking", where)
    if t in ("tool_use", "server_tool_use"):
        name = fields.string(b, "name", where)
        call_id = fields.opt_str(b, "id", where)
        if isinstance(b.get("input_raw"), str):  # invalid JSON from the model, kept by `assemble`
            return "call", ToolCall(id=call_id, name=name, raw=b["input_raw"])
        inp = b.get("input", {})
        return "call", ToolCall(id=call_id, name=name, arguments=inp if isinstance(inp, dict) else {})
    return None  # redacted_thinking, citations' blocks …: nothing a policy renders


def _assistant(content: list[Any], where: str, *, lenient: bool = False) -> Message:
    """An assistant's content blocks (in a request's history or a reply) as one message."""
    blocks = [b for b in each(content, lambda j, b: _block(f"{where}.{j}", b), lenient=lenient) if b]
    # Every value was read and checked above (a conversation echoes each of these every turn).
    return Message.model_construct(
        role="assistant",
        content="".join(v for k, v in blocks if k == "text" and isinstance(v, str)),
        reasoning="".join(v for k, v in blocks if k == "thinking" and isinstance(v, str)) or None,
        tool_calls=[v for k, v in blocks if isinstance(v, ToolCall)],
    )


def _parse_message(i: int, m: Any) -> list[Message]:
    where = f"messages.{i}"
    if not isinstance(m, dict):
        raise _bad(f"{where}: must be an object")
    role = m.get("role")
    content = m.get("content")
    if role == "system":
        return [Message(role="system", content=_system_text(content))]
    if role not in ("user", "assistant"):
        raise _bad(f"{where}.role: unexpected value {role!r}; expected 'user' or 'assistant'")
    if isinstance(content, str):
        return [Message(role=role, content=content)]
    if not isinstance(content, list):
        raise _bad(f"{where}.content: must be a string or a list of content blocks")
    if role == "assistant":
        return [_assistant(content, f"{where}.content")]
    out: list[Message] = []
    texts = []
    for j, b in enumerate(content):
        if not isinstance(b, dict):
            raise _bad(f"{where}.content.{j}: must be an object")
        t = fields.type_tag(b, f"{where}.content.{j}")
        if t == "tool_result":
            body = _text_of(b.get("content"), f"{where}.content.{j}.content")
            if b.get("is_error"):
                body = f"Error: {body}"
            call_id = fields.opt_str(b, "tool_use_id", f"{where}.content.{j}")
            out.append(Message(role="tool", content=body, tool_call_id=call_id))
        elif t == "text":
            texts.append(fields.opt_str(b, "text", f"{where}.content.{j}"))
        elif t in ("image", "document"):
            texts.append(f"[{t}]")
    if texts:
        out.append(Message(role="user", content="\n\n".join(texts)))
    return out


def _tool(where: str, t: Any) -> Tool:
    t = fields.obj(t, where)
    return Tool(
        name=fields.string(t, "name", where),
        description=fields.opt_str(t, "description", where),
        parameters=fields.schema(t, "input_schema", where) or fields.no_arguments(),
    )


def _tool_item(j: int, t: Any) -> Tool:
    return _tool(f"tools.{j}", t)


def parse_request(
    body: Any, *, path: str = "", require_max_tokens: bool = True, memo: ItemMemo | None = None
) -> ChatRequest:
    del path  # everything is in the body
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        raise _bad("messages: field required (a list of messages)")
    if require_max_tokens and not isinstance(body.get("max_tokens"), int):
        raise _bad("max_tokens: field required (an integer)")
    messages: list[Message] = []
    system = _system_text(body.get("system"))
    if system:
        messages.append(Message(role="system", content=system))
    for read in memo.read(msgs, _parse_message) if memo else map(_parse_message, range(len(msgs)), msgs):
        messages.extend(read)
    listed = fields.opt_list(body, "tools", "")
    tools = memo.read(listed, _tool_item) if memo else [_tool_item(j, t) for j, t in enumerate(listed)]
    tool_choice: Any = None
    if (tc := fields.opt_obj(body, "tool_choice", "")) is not None:
        kind = fields.type_tag(tc, "tool_choice")
        tool_choice = {"auto": "auto", "any": "required", "none": "none"}.get(kind or "") or (
            {"name": fields.string(tc, "name", "tool_choice")} if kind == "tool" else None
        )
    think: bool | None = None
    if (thinking := fields.opt_obj(body, "thinking", "")) is not None:
        think = fields.type_tag(thinking, "thinking") in ("enabled", "adaptive")
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("stop_sequences: must be a list of strings")
    schema = _json_schema(body)
    if schema is not None:
        # Constrained decoding applies from the first sampled token: no thinking before the JSON.
        think = False
    try:
        sampling = Sampling(
            max_tokens=body.get("max_tokens"),
            temperature=body.get("temperature"),
            top_p=body.get("top_p"),
            top_k=body.get("top_k"),
            stop=stops,
            json_schema=schema,
        )
    except ValueError as e:
        raise _bad(f"invalid sampling parameter: {e}") from e
    return ChatRequest(
        style=NAME,
        model=fields.opt_str(body, "model", ""),
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        sampling=sampling,
        stream=bool(body.get("stream", False)),
        thinking=think,
    )


_REPLY_FINISH: dict[str, FinishReason] = {
    "tool_use": "tool_calls",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
}


def parse_reply(reply: Any, *, lenient: bool = False) -> tuple[list[Message], FinishReason]:
    """A Message object (as the API returns it, or as `assemble` rebuilt it) as one assistant
    message, its blocks read as the same blocks echoed in a later request are."""
    if not isinstance(reply, dict):
        raise _bad("reply must be a JSON object")
    content = reply.get("content") or []
    if not isinstance(content, list):
        raise _bad("content: must be a list of content blocks")
    msg = _assistant(content, "content", lenient=lenient)
    return [msg], _REPLY_FINISH.get(str(reply.get("stop_reason")), "stop")


# ---- response ----------------------------------------------------------------------------------

_STOP = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens", "abort": "end_turn"}


def _stop_reason(c: Completion) -> str:
    if c.stop_sequence:
        return "stop_sequence"
    return _STOP.get(c.finish_reason, "end_turn")


def _usage(c: Completion) -> dict[str, int]:
    return {
        "input_tokens": c.usage.prompt_tokens - c.usage.cached_tokens,
        "cache_read_input_tokens": c.usage.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": c.usage.completion_tokens,
    }


def message_id(turn_id: str) -> str:
    return "msg_" + turn_id.removeprefix("turn_")


def render_response(c: Completion, req: ChatRequest | None = None) -> dict[str, Any]:
    del req  # the reply does not depend on how the request was made
    content: list[dict[str, Any]] = []
    if c.reasoning:
        content.append({"type": "thinking", "thinking": c.reasoning, "signature": signature_for(c.reasoning)})
    if c.text:
        content.append({"type": "text", "text": c.text})
    for call in c.tool_calls:
        content.append({"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments})
    return {
        "id": message_id(c.turn_id),
        "type": "message",
        "role": "assistant",
        "model": c.model,
        "content": content,
        "stop_reason": _stop_reason(c),
        "stop_sequence": c.stop_sequence,
        "usage": _usage(c),
    }


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return sse.encode(data, event=event)


def _message_start(req: ChatRequest, turn_id: str, prompt_tokens: int) -> bytes:
    return _sse(
        "message_start",
        {
            "type": "message_start",
            "message": {
                "id": message_id(turn_id),
                "type": "message",
                "role": "assistant",
                "model": req.model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
            },
        },
    )


class _Blocks:
    """The content blocks of one streamed message: the open one's kind and index, and the
    thinking so far (its signature closes a thinking block)."""

    def __init__(self) -> None:
        self.index = -1
        self.open_kind: str | None = None
        self.reasoning = ""

    def delta(self, delta: dict[str, Any]) -> bytes:
        """A delta of the open block."""
        return _sse(
            "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}
        )

    def close(self) -> bytes:
        out = b""
        if self.open_kind == "thinking":
            out += self.delta({"type": "signature_delta", "signature": signature_for(self.reasoning)})
        if self.open_kind is not None:
            out += _sse("content_block_stop", {"type": "content_block_stop", "index": self.index})
        self.open_kind = None
        return out

    def open(self, kind: str, block: dict[str, Any]) -> bytes:
        """The open block closed, and a block of `kind` started."""
        out = self.close()
        self.index += 1
        self.open_kind = kind
        return out + _sse(
            "content_block_start",
            {"type": "content_block_start", "index": self.index, "content_block": block},
        )

    def end(self, c: Completion) -> bytes:
        """The open block closed, and the message ended with the completion's stop reason and usage."""
        out = self.close()
        out += _sse(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": _stop_reason(c), "stop_sequence": c.stop_sequence},
                "usage": {"output_tokens": c.usage.completion_tokens},
            },
        )
        return out + _sse("message_stop", {"type": "message_stop"})


async def render_stream(events: AsyncIterator[Event], req: ChatRequest) -> AsyncIterator[bytes]:
    """Anthropic SSE, produced as the policy generates. The end arrives only after the commit."""
    blocks = _Blocks()
    started = False
    async for ev in events:
        if isinstance(ev, Started):
            started = True
            yield _message_start(req, ev.turn_id, ev.prompt_tokens)
            continue
        if not started:
            started = True
            yield _message_start(req, "turn_pending", 0)
        if isinstance(ev, Ping):
            yield _sse("ping", {"type": "ping"})
        elif isinstance(ev, ReasoningDelta):
            out = b""
            if blocks.open_kind != "thinking":
                out = blocks.open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            blocks.reasoning += ev.text
            yield out + blocks.delta({"type": "thinking_delta", "thinking": ev.text})
        elif isinstance(ev, TextDelta):
            out = b""
            if blocks.open_kind != "text":
                out = blocks.open("text", {"type": "text", "text": ""})
            yield out + blocks.delta({"type": "text_delta", "text": ev.text})
        elif isinstance(ev, ToolCallEvent):
            call = ev.call
            out = blocks.open("tool_use", {"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
            partial = json.dumps(call.arguments, ensure_ascii=False)
            yield out + blocks.delta({"type": "input_json_delta", "partial_json": partial})
        elif isinstance(ev, Done):
            yield blocks.end(ev.completion)


def assemble(events: list[JsonEvent]) -> dict[str, Any]:
    """A recorded Messages stream as the Message object the non-streaming API returns (tool input
    JSON parsed; JSON the model got wrong kept as `input_raw`)."""
    msg: dict[str, Any] = {"type": "message", "role": "assistant", "content": []}
    blocks: dict[int, dict[str, Any]] = {}
    partial_json: dict[int, str] = {}

    def finish_input(i: int) -> None:
        raw = partial_json.pop(i, None)
        if raw is None or i not in blocks:
            return
        try:
            blocks[i]["input"] = json.loads(raw) if raw.strip() else {}
        except ValueError:
            blocks[i]["input"] = {}
            blocks[i]["input_raw"] = raw

    for name, d in events:
        kind = d.get("type", name)
        if kind == "message_start":
            msg.update({k: v for k, v in (d.get("message") or {}).items() if k != "content"})
        elif kind == "content_block_start":
            blocks[int(d.get("index", len(blocks)))] = dict(d.get("content_block") or {})
        elif kind == "content_block_delta":
            i = int(d.get("index", 0))
            block = blocks.setdefault(i, {})
            delta = d.get("delta") or {}
            dt = delta.get("type")
            if dt == "text_delta":
                block["text"] = block.get("text", "") + str(delta.get("text", ""))
            elif dt == "thinking_delta":
                block["thinking"] = block.get("thinking", "") + str(delta.get("thinking", ""))
            elif dt == "signature_delta":
                block["signature"] = delta.get("signature", "")
            elif dt == "input_json_delta":
                partial_json[i] = partial_json.get(i, "") + str(delta.get("partial_json", ""))
            elif dt == "citations_delta":
                block.setdefault("citations", []).append(delta.get("citation"))
        elif kind == "content_block_stop":
            finish_input(int(d.get("index", 0)))
        elif kind == "message_delta":
            msg.update(d.get("delta") or {})
            if isinstance(d.get("usage"), dict):
                msg["usage"] = {**(msg.get("usage") or {}), **d["usage"]}
        elif kind == "error":
            msg["error"] = d.get("error") or d
    for i in list(partial_json):
        finish_input(i)
    msg["content"] = [blocks[i] for i in sorted(blocks)]
    return msg


def render_error(e: ProviderError) -> tuple[int, dict[str, Any]]:
    return e.status, {
        "type": "error",
        "error": {"type": ERROR_TYPES.get(e.kind, "api_error"), "message": e.message},
    }


def render_stream_error(e: ProviderError) -> bytes:
    return _sse("error", render_error(e)[1])


def render_count(n: int) -> dict[str, Any]:
    return {"input_tokens": n}


def render_models(names: list[str]) -> dict[str, Any]:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    data = [{"type": "model", "id": n, "display_name": n, "created_at": now} for n in names]
    return {
        "data": data,
        "has_more": False,
        "first_id": names[0] if names else None,
        "last_id": names[-1] if names else None,
    }
