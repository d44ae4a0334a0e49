"""OpenAI Chat Completions: native request → ChatRequest, Completion/events → native JSON or SSE.

Serves `POST …/chat/completions` under any prefix, so OpenAI's `/v1/chat/completions` and the
OpenAI-compatible modes of other providers (DashScope's `/compatible-mode/v1/chat/completions`,
which Qwen Code calls by default) are one style. On api.openai.com, paths that are not ours
(`/v1/responses`) are left to the Responses module.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Collection
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
from polar_mitm.providers.base import Endpoint, ItemMemo, each, first_of
from polar_mitm.providers.fields import InvalidRequest
from polar_mitm.sse import JsonEvent

NAME = "openai-chat"
ID_PREFIX = "call_"
HOSTS = [
    "api.openai.com",
    # DashScope (Alibaba Model Studio) OpenAI-compatible regions, and Qwen Code's coding plan.
    "dashscope.aliyuncs.com",
    "dashscope-intl.aliyuncs.com",
    "dashscope-us.aliyuncs.com",
    "cn-hongkong.dashscope.aliyuncs.com",
    "coding.dashscope.aliyuncs.com",
    "coding-intl.dashscope.aliyuncs.com",
]
# Chat Completions request fields: those read, then those that change neither the prompt nor what
# the policy may answer (accounting, caching, sampling knobs the policy's own settings decide).
KNOWN_FIELDS = frozenset(
    {"model", "messages", "tools", "tool_choice", "functions", "function_call", "max_tokens"}
    | {"max_completion_tokens", "temperature", "top_p", "top_k", "n", "stop", "stream", "stream_options"}
    | {"response_format", "reasoning_effort", "chat_template_kwargs", "enable_thinking"}
    # Read as the thinking switch: Moonshot's `thinking` (Kimi Code) and OpenRouter's `reasoning`.
    | {"thinking", "reasoning"}
    | {"user", "metadata", "store", "parallel_tool_calls", "seed", "frequency_penalty"}
    | {"presence_penalty", "logit_bias", "logprobs", "top_logprobs", "service_tier", "prompt_cache_key"}
    | {"safety_identifier", "verbosity"}
    # Ignored, each for its reason:
    # - preserve_thinking (DashScope, Qwen Code): keep earlier replies' reasoning in the prompt,
    #   which splicing does anyway (an earlier reply is rendered as the ids sampled, reasoning and
    #   all); under --history template the template decides, as for every other history.
    # - session_id (OpenRouter): groups requests for the provider's accounting.
    # - search_parameters (xAI live search, Grok CLI): the policy has no search; it answers from the
    #   messages sent, and the stored prompt is what it saw.
    | {"preserve_thinking", "session_id", "search_parameters"}
)


def unknown_fields(body: Any) -> list[str]:
    return base.unknown_fields(body, KNOWN_FIELDS)


# neutral kind -> (OpenAI error type, code, status override). OpenAI's node SDK retries 408,
# 409, 429 and every 5xx, so an overloaded or unreachable policy backend is a 503 (not
# Anthropic's 529, which some OpenAI-compatible clients do not know) and the harness retries.
ERROR_SHAPES: dict[str, tuple[str, str | None, int | None]] = {
    "invalid_request": ("invalid_request_error", None, None),
    "authentication": ("authentication_error", "invalid_api_key", 401),
    "permission": ("permission_error", None, 403),
    "not_found": ("invalid_request_error", "not_found", 404),
    "rate_limit": ("rate_limit_error", "rate_limit_exceeded", 429),
    "request_too_large": ("invalid_request_error", "request_too_large", 413),
    "overloaded": ("server_error", "overloaded", 503),
    "timeout": ("server_error", "timeout", 504),
    "api_error": ("server_error", None, None),
}


def endpoint(method: str, path: str) -> Endpoint | None:
    """Which Chat Completions endpoint a request is for, or None when it is not ours."""
    p = path.split("?", 1)[0].rstrip("/")
    if method == "POST" and p.endswith("/chat/completions"):
        return "generate"
    if method == "GET" and p.endswith("/models"):
        return "models"
    return None


class ChatCompletionsRequest(ChatRequest):
    """A ChatRequest that remembers what the Chat Completions stream must include.

    `stream_options.include_usage` shapes only this style's SSE, so it rides on a subclass the
    gateway hands back to `render_stream`, not on the neutral model.
    """

    include_usage: bool = False
    custom_tools: list[str] = []  # names of the offered `custom` (freeform) tools, sorted


# ---- request -----------------------------------------------------------------------------------


def _bad(msg: str, param: str | None = None) -> ProviderError:
    return InvalidRequest(msg, param)


_PART_PLACEHOLDERS = {
    "image_url": "[image]",
    "input_image": "[image]",
    "input_audio": "[audio]",
    "file": "[file]",
    "video_url": "[video]",
}


def _text_of(content: Any, where: str) -> str:
    """A message's content (a string, null, or a list of content parts) as text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}: must be a string or a list of content parts", where)
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            parts.append(part)
            continue
        if not isinstance(part, dict):
            raise _bad(f"{where}.{j}: content parts must be objects", f"{where}.{j}")
        kind = fields.type_tag(part, f"{where}.{j}")
        if kind in ("text", "input_text", "output_text"):
            parts.append(fields.opt_str(part, "text", f"{where}.{j}"))
        elif kind == "refusal":
            parts.append(fields.opt_str(part, "refusal", f"{where}.{j}"))
        elif kind in _PART_PLACEHOLDERS:
            parts.append(_PART_PLACEHOLDERS[kind])
        else:
            raise _bad(f"{where}.{j}.type: unsupported content part type {kind!r}", f"{where}.{j}.type")
    # Text parts are concatenated as written: DashScope-style clients split one system prompt
    # into parts only to attach cache_control markers, and those must not change the text.
    return "".join(parts)


def _parse_arguments(raw: Any, where: str) -> ToolCall:
    """Tool-call arguments arrive as a JSON string; keep the text when it is not a JSON object."""
    if isinstance(raw, dict):
        return ToolCall(id="", name="", arguments=raw)
    if raw is None or raw == "":
        return ToolCall(id="", name="", arguments={})
    if not isinstance(raw, str):
        raise _bad(f"{where}: must be a JSON string", where)
    try:
        parsed = json.loads(raw)
    except ValueError:
        return ToolCall(id="", name="", raw=raw)
    if isinstance(parsed, dict):
        return ToolCall(id="", name="", arguments=parsed)
    return ToolCall(id="", name="", raw=raw)


def _parse_tool_call(where: str, c: Any) -> ToolCall:
    if not isinstance(c, dict):
        raise _bad(f"{where}: must be an object", where)
    if c.get("type") == "custom":  # a freeform tool's call: one string, as its tool was offered
        custom = fields.obj(c.get("custom"), f"{where}.custom")
        return ToolCall(
            id=str(c.get("id") or ""),
            name=fields.string(custom, "name", f"{where}.custom"),
            arguments={"input": fields.opt_str(custom, "input", f"{where}.custom")},
        )
    fn = c.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise _bad(f"{where}.function.name: required", f"{where}.function.name")
    call = _parse_arguments(fn.get("arguments"), f"{where}.function.arguments")
    return call.model_copy(update={"id": str(c.get("id") or ""), "name": fn["name"]})


def _parse_tool_calls(calls: Any, where: str, *, lenient: bool = False) -> list[ToolCall]:
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise _bad(f"{where}: must be a list", where)
    return each(calls, lambda j, c: _parse_tool_call(f"{where}.{j}", c), lenient=lenient)


def _assistant(m: dict[str, Any], where: str, *, lenient: bool = False) -> Message:
    """An assistant message (in a request's history, or a reply's choice) as neutral."""
    try:
        content = _text_of(m.get("content"), f"{where}.content")
    except ProviderError:
        if not lenient:
            raise
        content = ""
    calls = _parse_tool_calls(m.get("tool_calls"), f"{where}.tool_calls", lenient=lenient)
    legacy = m.get("function_call")
    if isinstance(legacy, dict) and isinstance(legacy.get("name"), str):
        call = _parse_arguments(legacy.get("arguments"), f"{where}.function_call.arguments")
        calls.append(call.model_copy(update={"id": "", "name": legacy["name"]}))
    reasoning = m.get("reasoning_content")
    if reasoning is None:
        reasoning = m.get("reasoning")
    return Message(
        role="assistant",
        content=content,
        reasoning=reasoning if isinstance(reasoning, str) and reasoning else None,
        tool_calls=calls,
    )


def _parse_message(i: int, m: Any) -> Message:
    where = f"messages.{i}"
    if not isinstance(m, dict):
        raise _bad(f"{where}: must be an object", where)
    role = m.get("role")
    if role == "assistant":
        return _assistant(m, where)
    content = _text_of(m.get("content"), f"{where}.content")
    if role in ("system", "developer"):
        return Message(role="system", content=base.without_billing_line(content))
    if role == "user":
        return Message(role="user", content=content)
    if role == "tool":
        return Message(role="tool", content=content, tool_call_id=fields.opt_str(m, "tool_call_id", where))
    if role == "function":  # the pre-tools form of a tool result
        return Message(role="tool", content=content, name=fields.opt_str(m, "name", where) or None)
    raise _bad(
        f"{where}.role: unexpected value {role!r}; expected system, developer, user, assistant or tool",
        f"{where}.role",
    )


def _tool_item(j: int, t: Any) -> Tool:
    where = f"tools.{j}"
    t = fields.obj(t, where)
    kind = fields.type_tag(t, where) or "function"
    if kind == "custom":
        return _custom_tool(t.get("custom"), f"{where}.custom")
    if kind != "function":
        raise _bad(f"{where}.type: unsupported tool type {kind!r}; expected 'function' or 'custom'", where)
    return _tool(t.get("function"), f"{where}.function")


def _custom_tool(c: Any, where: str) -> Tool:
    """A `custom` tool (`{"name", "description", "format": {"type": "text"} or {"type":
    "grammar", "grammar": {"definition", "syntax"}}}`) as the freeform tool Responses reads too."""
    c = fields.obj(c, where)
    fmt = fields.opt_obj(c, "format", where) or {}
    grammar = None
    if fmt.get("type") == "grammar":
        g = fields.obj(fmt.get("grammar"), f"{where}.format.grammar")
        syntax = fields.opt_str(g, "syntax", f"{where}.format.grammar", default="grammar")
        grammar = (syntax, fields.string(g, "definition", f"{where}.format.grammar"))
    return base.freeform_tool(
        fields.string(c, "name", where), fields.opt_str(c, "description", where), grammar
    )


def _custom_names(body: dict[str, Any]) -> list[str]:
    tools = body.get("tools")
    if not isinstance(tools, list):
        return []
    return sorted(
        t["custom"]["name"]
        for t in tools
        if isinstance(t, dict)
        and t.get("type") == "custom"
        and isinstance(t.get("custom"), dict)
        and isinstance(t["custom"].get("name"), str)
    )


def _parse_tools(body: dict[str, Any], memo: ItemMemo | None = None) -> list[Tool]:
    listed = fields.opt_list(body, "tools", "")
    tools = memo.read(listed, _tool_item) if memo else [_tool_item(j, t) for j, t in enumerate(listed)]
    for j, fn in enumerate(fields.opt_list(body, "functions", "")):  # the pre-tools form
        tools.append(_tool(fn, f"functions.{j}"))
    return tools


def _tool(fn: Any, where: str) -> Tool:
    fn = fields.obj(fn, where)
    return Tool(
        name=fields.string(fn, "name", where),
        description=fields.opt_str(fn, "description", where),
        parameters=fields.schema(fn, "parameters", where),
    )


def _tool_choice(tc: Any) -> str | dict[str, Any] | None:
    if tc is None or isinstance(tc, str):
        return tc
    if isinstance(tc, dict):
        fn = tc.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return {"name": fn["name"]}
        if isinstance(tc.get("name"), str):  # the pre-tools function_call form
            return {"name": tc["name"]}
    raise _bad("tool_choice: expected 'none', 'auto', 'required' or a named function", "tool_choice")


def _json_schema(rf: Any) -> dict[str, Any] | None:
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise _bad("response_format: must be an object", "response_format")
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise _bad("response_format.json_schema.schema: required (an object)", "response_format")
        return schema
    raise _bad(f"response_format.type: unsupported value {kind!r}", "response_format.type")


def _effort_thinks(effort: Any) -> bool | None:
    return effort not in ("none", "minimal") if isinstance(effort, str) else None


def _thinking(body: dict[str, Any]) -> bool | None:
    """Qwen-style switches (`enable_thinking`, `chat_template_kwargs`), Moonshot's `thinking`
    (`{"type": "enabled" | "disabled"}`; its `keep` of earlier reasoning is what splicing does),
    OpenRouter's `reasoning` (`enabled`, or an `effort`), or OpenAI's reasoning_effort."""
    if isinstance(body.get("enable_thinking"), bool):
        return body["enable_thinking"]
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and isinstance(kwargs.get("enable_thinking"), bool):
        return kwargs["enable_thinking"]
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "disabled"):
        return thinking["type"] == "enabled"
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict):
        if isinstance(reasoning.get("enabled"), bool):
            return reasoning["enabled"]
        if (effort := _effort_thinks(reasoning.get("effort"))) is not None:
            return effort
    return _effort_thinks(body.get("reasoning_effort"))


def parse_request(
    body: Any, *, path: str = "", require_max_tokens: bool = False, memo: ItemMemo | None = None
) -> ChatCompletionsRequest:
    del path, require_max_tokens  # everything is in the body; max_tokens is optional
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages: field required (a non-empty list of messages)", "messages")
    messages = memo.read(msgs, _parse_message) if memo else [_parse_message(i, m) for i, m in enumerate(msgs)]
    n = body.get("n")
    if n not in (None, 1):
        raise _bad("n: only one choice per request is supported", "n")
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = stop
    else:
        raise _bad("stop: must be a string or a list of strings", "stop")
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise _bad("max_tokens: must be a positive integer", "max_tokens")
    try:
        sampling = Sampling(
            max_tokens=max_tokens,
            temperature=body.get("temperature"),
            top_p=body.get("top_p"),
            top_k=body.get("top_k"),
            stop=stops,
            json_schema=_json_schema(body.get("response_format")),
        )
    except ValueError as e:
        raise _bad(f"invalid sampling parameter: {e}") from e
    options = body.get("stream_options")
    return ChatCompletionsRequest(
        style=NAME,
        model=fields.opt_str(body, "model", ""),
        messages=messages,
        tools=_parse_tools(body, memo),
        custom_tools=_custom_names(body),
        tool_choice=_tool_choice(body.get("tool_choice", body.get("function_call"))),
        sampling=sampling,
        stream=bool(body.get("stream", False)),
        thinking=_thinking(body),
        include_usage=isinstance(options, dict) and bool(options.get("include_usage")),
    )


_REPLY_FINISH: dict[str, FinishReason] = {
    "tool_calls": "tool_calls",
    "function_call": "tool_calls",
    "length": "length",
}


def parse_reply(reply: Any, *, lenient: bool = False) -> tuple[list[Message], FinishReason]:
    """A chat.completion's first choice as one assistant message, read as the same message
    echoed in a later request is."""
    choice = first_of(reply, "choices", lenient=lenient)
    message = choice.get("message")
    m = message if isinstance(message, dict) else {}
    msg = _assistant(m, "choices.0.message", lenient=lenient)
    finish = _REPLY_FINISH.get(str(choice.get("finish_reason")), "stop")
    return [msg], "tool_calls" if msg.tool_calls and finish == "stop" else finish


# ---- response ----------------------------------------------------------------------------------

_FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls"}


def completion_id(turn_id: str) -> str:
    return "chatcmpl-" + turn_id.removeprefix("turn_")


def _usage(c: Completion) -> dict[str, Any]:
    return {
        "prompt_tokens": c.usage.prompt_tokens,
        "completion_tokens": c.usage.completion_tokens,
        "total_tokens": c.usage.prompt_tokens + c.usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": c.usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": c.usage.reasoning_tokens},
    }


def _tool_call(call: ToolCall, custom: Collection[str] = ()) -> dict[str, Any]:
    if call.name in custom:
        return {
            "id": call.id,
            "type": "custom",
            "custom": {"name": call.name, "input": base.freeform_input(call)},
        }
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments_json()},
    }


def _custom(req: ChatRequest | None) -> list[str]:
    return req.custom_tools if isinstance(req, ChatCompletionsRequest) else []


def render_response(c: Completion, req: ChatRequest | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        # OpenAI sends null content when the reply is only tool calls.
        "content": c.text if c.text or not c.tool_calls else None,
        "refusal": None,
    }
    if c.reasoning:
        message["reasoning_content"] = c.reasoning
    if c.tool_calls:
        message["tool_calls"] = [_tool_call(call, _custom(req)) for call in c.tool_calls]
    return {
        "id": completion_id(c.turn_id),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": c.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": _FINISH.get(c.finish_reason, "stop"),
            }
        ],
        "usage": _usage(c),
    }


def _sse(data: dict[str, Any] | str) -> bytes:
    return sse.encode(data)


async def render_stream(events: AsyncIterator[Event], req: ChatRequest) -> AsyncIterator[bytes]:
    """Chat Completions SSE, produced as the policy generates. `[DONE]` comes only after the commit."""
    include_usage = isinstance(req, ChatCompletionsRequest) and req.include_usage
    chunk_id = completion_id("turn_pending")
    created = int(time.time())
    started = False
    tool_index = -1

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        data: dict[str, Any] = {
            "id": chunk_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": req.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if include_usage:
            data["usage"] = None
        return _sse(data)

    def first() -> bytes:
        return chunk({"role": "assistant", "content": ""})

    async for ev in events:
        if isinstance(ev, Started):
            chunk_id = completion_id(ev.turn_id)
            started = True
            yield first()
            continue
        if not started:
            started = True
            yield first()
        if isinstance(ev, Ping):
            yield sse.comment("ping")
        elif isinstance(ev, ReasoningDelta):
            yield chunk({"reasoning_content": ev.text})
        elif isinstance(ev, TextDelta):
            yield chunk({"content": ev.text})
        elif isinstance(ev, ToolCallEvent):
            tool_index += 1
            # Each call whole, in one chunk: id, name and arguments together. OpenAI itself sends
            # the arguments in later chunks without the name, which Mistral's SDK (Mistral Vibe)
            # refuses (it requires `function.name` in every tool-call chunk); every client that
            # accumulates OpenAI's deltas reads one whole chunk too.
            yield chunk({"tool_calls": [{"index": tool_index, **_tool_call(ev.call, _custom(req))}]})
        elif isinstance(ev, Done):
            c = ev.completion
            out = chunk({}, _FINISH.get(c.finish_reason, "stop"))
            if include_usage:
                out += _sse(
                    {
                        "id": chunk_id,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": req.model,
                        "choices": [],
                        "usage": _usage(c),
                    }
                )
            yield out + _sse("[DONE]")


def assemble(events: list[JsonEvent]) -> dict[str, Any]:
    """Recorded Chat Completions chunks as the chat.completion object the non-streaming API
    returns (content, reasoning and each tool call's arguments joined)."""
    out: dict[str, Any] = {"object": "chat.completion"}
    choices: dict[int, dict[str, Any]] = {}
    calls: dict[int, dict[int, dict[str, Any]]] = {}
    for _, d in events:
        if "error" in d:
            out["error"] = d["error"]
            continue
        for k in ("id", "created", "model", "system_fingerprint", "service_tier"):
            if d.get(k) is not None:
                out[k] = d[k]
        if d.get("usage"):
            out["usage"] = d["usage"]
        for ch in d.get("choices") or []:
            i = int(ch.get("index", 0))
            choice = choices.setdefault(
                i, {"index": i, "message": {"role": "assistant", "content": None}, "finish_reason": None}
            )
            m = choice["message"]
            delta = ch.get("delta") or {}
            if delta.get("role"):
                m["role"] = delta["role"]
            for key in ("content", "reasoning_content", "reasoning", "refusal"):
                if isinstance(delta.get(key), str):
                    m[key] = (m.get(key) or "") + delta[key]
            for tc in delta.get("tool_calls") or []:
                j = int(tc.get("index", len(calls.get(i, {}))))
                call = calls.setdefault(i, {}).setdefault(
                    j, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                )
                if tc.get("id"):
                    call["id"] = tc["id"]
                if tc.get("type"):
                    call["type"] = tc["type"]
                if isinstance(tc.get("custom"), dict):  # a freeform call: its name and input
                    custom = call.setdefault("custom", {"name": "", "input": ""})
                    call.pop("function", None)
                    custom["name"] += tc["custom"].get("name") or ""
                    custom["input"] += tc["custom"].get("input") or ""
                    continue
                fn = tc.get("function") or {}
                if fn.get("name"):
                    call["function"]["name"] += fn["name"]
                if fn.get("arguments"):
                    call["function"]["arguments"] += fn["arguments"]
            if ch.get("finish_reason"):
                choice["finish_reason"] = ch["finish_reason"]
    for i, by_index in calls.items():
        choices[i]["message"]["tool_calls"] = [by_index[j] for j in sorted(by_index)]
    out["choices"] = [choices[i] for i in sorted(choices)]
    return out


def render_error(e: ProviderError) -> tuple[int, dict[str, Any]]:
    kind, code, status = ERROR_SHAPES.get(e.kind, ("server_error", None, None))
    return status or e.status, {
        "error": {
            "message": e.message,
            "type": kind,
            "param": e.param if isinstance(e, InvalidRequest) else None,
            "code": code,
        }
    }


def render_stream_error(e: ProviderError) -> bytes:
    # OpenAI's SDKs raise an APIError for a data chunk that carries `error`.
    return _sse(render_error(e)[1])


def render_count(n: int) -> dict[str, Any]:
    return {"object": "token_count", "prompt_tokens": n}


def render_models(names: list[str]) -> dict[str, Any]:
    now = int(time.time())
    return {
        "object": "list",
        "data": [{"id": n, "object": "model", "created": now, "owned_by": "polar-mitm"} for n in names],
    }
