"""Google Gemini API (generativelanguage): native request → ChatRequest, Completion/events → native
JSON or SSE (that reply half is `gemini_render`; this module, the style, takes its names).

Serves `POST /{v1,v1beta,v1alpha}/models/{model}:generateContent`, `:streamGenerateContent`
and `:countTokens`, and `GET …/models`. The model and the stream flag live in the URL, which
`parse_request` reads from its `path`. Streams are always SSE, as `?alt=sse` asks (every
Google SDK sends it); the JSON-array stream Google sends without it is not produced.

Gemini function calls carry no ids of their own: ids are given to every call we render (Gemini
CLI echoes them back, prefixed with the tool name) and made up deterministically for history
calls that arrive without one. Splicing never depends on them: the conversation hash ignores ids.
`thought: true` text parts are reasoning; Gemini CLI drops them from the history it echoes, which
the hash ignores as well. API keys (`x-goog-api-key`, `?key=`) are never read here; the gateway
redacts both before anything is stored.
"""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import unquote

from polar_mitm.neutral import (
    ChatRequest,
    FinishReason,
    Message,
    ProviderError,
    Sampling,
    Tool,
    ToolCall,
)
from polar_mitm.providers import base, fields
from polar_mitm.providers.base import Endpoint, ItemMemo, each, first_of

# The reply half (native JSON and SSE, errors) is its own module; the style is this one.
from polar_mitm.providers.gemini_render import KEEPALIVE as KEEPALIVE
from polar_mitm.providers.gemini_render import assemble as assemble
from polar_mitm.providers.gemini_render import render_count as render_count
from polar_mitm.providers.gemini_render import render_error as render_error
from polar_mitm.providers.gemini_render import render_models as render_models
from polar_mitm.providers.gemini_render import render_response as render_response
from polar_mitm.providers.gemini_render import render_stream as render_stream
from polar_mitm.providers.gemini_render import render_stream_error as render_stream_error

NAME = "gemini"
ID_PREFIX = "call_"
HOSTS = ["generativelanguage.googleapis.com"]

# …/models/{model}:{method}; Vertex-style prefixes (projects/…/publishers/google/) are accepted too.
_MODEL_PATH = re.compile(
    r"^/(?:v1|v1beta|v1alpha)/(?:[^?]*/)?models/([^/:?]+):(generateContent|streamGenerateContent|countTokens)$"
)
_MODELS_LIST = re.compile(r"^/(?:v1|v1beta|v1alpha)/models$")


def endpoint(method: str, path: str) -> Endpoint | None:
    """Which Gemini API endpoint a request is for, or None for a side endpoint."""
    p = unquote(path.split("?", 1)[0]).rstrip("/")
    m = _MODEL_PATH.match(p)
    if method == "POST" and m:
        return "count_tokens" if m.group(2) == "countTokens" else "generate"
    if method == "GET" and _MODELS_LIST.match(p):
        return "models"
    return None


def model_and_stream(path: str) -> tuple[str, bool]:
    """The model name and whether the reply streams, both taken from the request path."""
    m = _MODEL_PATH.match(unquote(path.split("?", 1)[0]).rstrip("/"))
    if m is None:
        raise _bad(
            f"{path.split('?', 1)[0]} is not a generateContent, streamGenerateContent or countTokens path"
        )
    return m.group(1), m.group(2) == "streamGenerateContent"


# ---- request -----------------------------------------------------------------------------------

# The Gemini API reads a body as protobuf JSON, which accepts each field by its proto name
# (`system_instruction`, `function_call`) as well as by its JSON name (`systemInstruction`);
# litellm and other clients send the proto names. Bodies are read in the JSON names, so every key
# of a message type is spelled that way first. Only the keys of proto messages are renamed, never
# those of the free-form values inside them (a call's `args`, a function's `response`, a
# `parametersJsonSchema`, the property names of a schema's `properties`): those are data.
#
# message type -> {field (JSON name): the type of its value}; a type is a message type's name,
# _FREE (a google.protobuf.Value/Struct: left as it is), _SCALAR, or _SCHEMA_MAP (a map of names
# to Schema). A field a type does not list is renamed too, and its value left as it is.
_FREE = "free"
_SCALAR = "scalar"
_SCHEMA_MAP = "schema map"
_MESSAGES: dict[str, dict[str, str]] = {
    "GenerateContentRequest": {
        "model": _SCALAR,
        "contents": "Content",
        "systemInstruction": "Content",
        "tools": "Tool",
        "toolConfig": "ToolConfig",
        "generationConfig": "GenerationConfig",
        "generateContentRequest": "GenerateContentRequest",
        "safetySettings": "SafetySetting",
        "cachedContent": _SCALAR,
        "labels": _FREE,
    },
    "Content": {"role": _SCALAR, "parts": "Part"},
    "Part": {
        "text": _SCALAR,
        "thought": _SCALAR,
        "thoughtSignature": _SCALAR,
        "inlineData": "Blob",
        "fileData": "FileData",
        "functionCall": "FunctionCall",
        "functionResponse": "FunctionResponse",
        "executableCode": "ExecutableCode",
        "codeExecutionResult": "CodeExecutionResult",
        "videoMetadata": "VideoMetadata",
        "partMetadata": _FREE,
    },
    "Blob": {"mimeType": _SCALAR, "data": _SCALAR, "displayName": _SCALAR},
    "FileData": {"mimeType": _SCALAR, "fileUri": _SCALAR, "displayName": _SCALAR},
    "FunctionCall": {"id": _SCALAR, "name": _SCALAR, "args": _FREE},
    "FunctionResponse": {
        "id": _SCALAR,
        "name": _SCALAR,
        "response": _FREE,
        "parts": "Part",
        "willContinue": _SCALAR,
        "scheduling": _SCALAR,
    },
    "ExecutableCode": {"language": _SCALAR, "code": _SCALAR},
    "CodeExecutionResult": {"outcome": _SCALAR, "output": _SCALAR},
    "VideoMetadata": {"startOffset": _SCALAR, "endOffset": _SCALAR, "fps": _SCALAR},
    "SafetySetting": {"category": _SCALAR, "threshold": _SCALAR},
    "Tool": {
        "functionDeclarations": "FunctionDeclaration",
        "googleSearchRetrieval": _FREE,
        "codeExecution": _FREE,
        "googleSearch": _FREE,
        "urlContext": _FREE,
        "computerUse": _FREE,
    },
    "FunctionDeclaration": {
        "name": _SCALAR,
        "description": _SCALAR,
        "behavior": _SCALAR,
        "parameters": "Schema",
        "parametersJsonSchema": _FREE,
        "response": "Schema",
        "responseJsonSchema": _FREE,
    },
    "Schema": {
        "type": _SCALAR,
        "format": _SCALAR,
        "title": _SCALAR,
        "description": _SCALAR,
        "nullable": _SCALAR,
        "enum": _SCALAR,
        "maxItems": _SCALAR,
        "minItems": _SCALAR,
        "properties": _SCHEMA_MAP,
        "required": _SCALAR,
        "minProperties": _SCALAR,
        "maxProperties": _SCALAR,
        "minLength": _SCALAR,
        "maxLength": _SCALAR,
        "pattern": _SCALAR,
        "example": _FREE,
        "anyOf": "Schema",
        "propertyOrdering": _SCALAR,
        "default": _FREE,
        "items": "Schema",
        "minimum": _SCALAR,
        "maximum": _SCALAR,
    },
    "ToolConfig": {"functionCallingConfig": "FunctionCallingConfig", "retrievalConfig": _FREE},
    "FunctionCallingConfig": {"mode": _SCALAR, "allowedFunctionNames": _SCALAR},
    "GenerationConfig": {
        "stopSequences": _SCALAR,
        "responseMimeType": _SCALAR,
        "responseSchema": "Schema",
        "responseJsonSchema": _FREE,
        "responseModalities": _SCALAR,
        "candidateCount": _SCALAR,
        "maxOutputTokens": _SCALAR,
        "temperature": _SCALAR,
        "topP": _SCALAR,
        "topK": _SCALAR,
        "seed": _SCALAR,
        "presencePenalty": _SCALAR,
        "frequencyPenalty": _SCALAR,
        "responseLogprobs": _SCALAR,
        "logprobs": _SCALAR,
        "enableEnhancedCivicAnswers": _SCALAR,
        "speechConfig": _FREE,
        "thinkingConfig": "ThinkingConfig",
        "mediaResolution": _SCALAR,
    },
    "ThinkingConfig": {"includeThoughts": _SCALAR, "thinkingBudget": _SCALAR, "thinkingLevel": _SCALAR},
}
# Fields the Gemini API accepts on a request but the policy has no use for (safety, caching,
# labels): their absence from a prompt is not a misreading.
IGNORED_FIELDS = frozenset({"model", "safetySettings", "cachedContent", "labels"})
KNOWN_FIELDS = frozenset(_MESSAGES["GenerateContentRequest"])


def unknown_fields(body: Any) -> list[str]:
    return base.unknown_fields(body, KNOWN_FIELDS, json_name)


def json_name(key: str) -> str:
    """A proto field name's JSON name (`max_output_tokens` -> `maxOutputTokens`); JSON names, and
    keys without an underscore, are their own."""
    if "_" not in key:
        return key
    head, *rest = key.split("_")
    return head + "".join(w[:1].upper() + w[1:] for w in rest)


def json_names(value: Any, kind: str = "GenerateContentRequest", where: str = "") -> Any:
    """`value`, a `kind` message (or a list of them) as protobuf JSON, with every key of a proto
    message spelled by its JSON name. The same object comes back when nothing is renamed. A field
    given in both spellings is refused, as the API refuses it."""
    if isinstance(value, list):
        out = [json_names(v, kind, f"{where}.{i}") for i, v in enumerate(value)]
        return value if all(a is b for a, b in zip(out, value, strict=True)) else out
    if not isinstance(value, dict) or kind in (_FREE, _SCALAR):
        return value
    if kind == _SCHEMA_MAP:
        named = {k: json_names(v, "Schema", f"{where}.{k}") for k, v in value.items()}
        return value if all(named[k] is v for k, v in value.items()) else named
    fields_of = _MESSAGES[kind]
    renamed: dict[str, Any] = {}
    changed = False
    for key, v in value.items():
        name = json_name(key)
        at = f"{where}.{name}".lstrip(".")
        if name in renamed:
            raise fields.bad(at, "given twice (by its JSON name and by its proto name)")
        child = json_names(v, fields_of.get(name, _FREE), at)
        changed = changed or name != key or child is not v
        renamed[name] = child
    return renamed if changed else value


def _bad(msg: str) -> ProviderError:
    return fields.InvalidRequest(msg)


def openapi_to_json_schema(schema: Any) -> Any:
    """Gemini's OpenAPI-subset `Schema` (`type: "OBJECT"`, `nullable`) as standard JSON Schema, so
    SGLang's constrained decoding and chat templates can read it. Standard schemas pass unchanged.

    Gemini CLI writes upper-case types even in `responseJsonSchema` (its router schema), which
    Google accepts and a JSON Schema validator does not, so every schema goes through here."""
    if isinstance(schema, list):
        return [openapi_to_json_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k == "type" and isinstance(v, str):
            out[k] = v.lower()
        elif k == "type" and isinstance(v, list):
            out[k] = [t.lower() if isinstance(t, str) else t for t in v]
        elif k in ("properties", "$defs", "definitions", "patternProperties") and isinstance(v, dict):
            out[k] = {name: openapi_to_json_schema(s) for name, s in v.items()}
        elif k in ("items", "prefixItems", "anyOf", "oneOf", "allOf", "not", "additionalProperties"):
            out[k] = openapi_to_json_schema(v)
        elif k in ("nullable", "propertyOrdering"):
            continue  # handled below / presentation only
        else:
            out[k] = v
    if schema.get("nullable") is True and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


def _call_id(i: int, j: int) -> str:
    # Stable across requests, so the same history always renders the same ids.
    return f"{ID_PREFIX}h{i}_{j}"


def _tool_response_text(resp: Any) -> str:
    """A functionResponse's `response` as the tool message content. Gemini CLI sends
    `{"output": text}` or `{"error": text}`; anything else is kept as JSON."""
    if isinstance(resp, dict) and len(resp) == 1:
        ((key, value),) = resp.items()
        if key == "output" and isinstance(value, str):
            return value
        if key == "error" and isinstance(value, str):
            return f"Error: {value}"
    if isinstance(resp, str):
        return resp
    return json.dumps(resp, ensure_ascii=False)


def _placeholder(part: dict[str, Any]) -> str | None:
    if isinstance(part.get("inlineData"), dict):
        return f"[inline data: {part['inlineData'].get('mimeType', 'application/octet-stream')}]"
    if isinstance(part.get("fileData"), dict):
        fd = part["fileData"]
        return f"[file: {fd.get('fileUri', '')} ({fd.get('mimeType', 'application/octet-stream')})]"
    if isinstance(part.get("executableCode"), dict):
        return str(part["executableCode"].get("code", ""))
    if isinstance(part.get("codeExecutionResult"), dict):
        return str(part["codeExecutionResult"].get("output", ""))
    return None


def _parts(content: dict[str, Any], where: str) -> list[dict[str, Any]]:
    parts = content.get("parts", [])
    if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
        raise _bad(f"{where}.parts: must be a list of Part objects")
    return parts


def _model_part(i: int, j: int, p: Any, where: str) -> tuple[str, str | ToolCall] | None:
    """One part of a model content: ("text" | "thought", text) or ("call", ToolCall)."""
    if not isinstance(p, dict):
        raise _bad(f"{where}.parts[{j}]: must be a Part object")
    if isinstance(p.get("functionCall"), dict):
        fc = p["functionCall"]
        at = f"{where}.parts[{j}].functionCall"
        args = fc.get("args", {})
        return "call", ToolCall(
            id=fields.opt_str(fc, "id", at) or _call_id(i, j),
            name=fields.string(fc, "name", at),
            arguments=args if isinstance(args, dict) else {},
        )
    if (text := _text(p, f"{where}.parts[{j}]")) is not None:
        return ("thought" if p.get("thought") is True else "text"), text
    placeholder = _placeholder(p)
    return ("text", placeholder) if placeholder is not None else None


def _parse_model(i: int, content: dict[str, Any], *, lenient: bool = False) -> Message:
    """A model content (in a request's history, or a reply's candidate) as one assistant message."""
    where = f"contents[{i}]"
    raw = content.get("parts", [])
    if not isinstance(raw, list):
        if not lenient:
            raise _bad(f"{where}.parts: must be a list of Part objects")
        raw = []
    parts = [p for p in each(raw, lambda j, p: _model_part(i, j, p, where), lenient=lenient) if p]
    # Gemini CLI joins streamed text parts without a separator; so do we.
    return Message(
        role="assistant",
        content="".join(v for k, v in parts if k == "text" and isinstance(v, str)),
        reasoning="".join(v for k, v in parts if k == "thought" and isinstance(v, str)) or None,
        tool_calls=[v for _, v in parts if isinstance(v, ToolCall)],
    )


def _parse_user(i: int, content: dict[str, Any], pending: list[ToolCall]) -> list[Message]:
    """A user content: function responses become tool messages (first), other parts one user
    message. A response without an id takes the id of the earliest unanswered call of its name."""
    where = f"contents[{i}]"
    out: list[Message] = []
    texts: list[str] = []
    for j, p in enumerate(_parts(content, where)):
        if isinstance(p.get("functionResponse"), dict):
            fr = p["functionResponse"]
            name = fields.string(fr, "name", f"{where}.parts[{j}].functionResponse")
            call_id = fields.opt_str(fr, "id", f"{where}.parts[{j}].functionResponse")
            match = next((c for c in pending if (c.id == call_id if call_id else c.name == name)), None)
            if match is not None:
                pending.remove(match)
            out.append(
                Message(
                    role="tool",
                    content=_tool_response_text(fr.get("response")),
                    tool_call_id=str(call_id or (match.id if match else _call_id(i, j))),
                    name=name,
                )
            )
        elif (text := _text(p, f"{where}.parts[{j}]")) is not None:
            if p.get("thought") is not True:
                texts.append(text)
        else:
            placeholder = _placeholder(p)
            if placeholder is not None:
                texts.append(placeholder)
    if texts:
        out.append(Message(role="user", content="\n".join(texts)))
    return out


def _text(part: dict[str, Any], where: str) -> str | None:
    """A part's `text`, if it has one (a string)."""
    if part.get("text") is None:
        return None
    return fields.opt_str(part, "text", where)


def _system_text(si: Any) -> str:
    if si is None:
        return ""
    if isinstance(si, str):
        return si
    if isinstance(si, dict):
        parts = _parts(si, "systemInstruction")
        texts = (_text(p, f"systemInstruction.parts[{j}]") for j, p in enumerate(parts))
        return "\n".join(t for t in texts if t is not None)
    raise _bad("systemInstruction: must be a Content object")


def _parse_tools(tools: Any) -> list[Tool]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _bad("tools: must be a list of Tool objects")
    out: list[Tool] = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise _bad(f"tools[{i}]: must be an object")
        # googleSearch, codeExecution, urlContext …: server-side tools the policy cannot run.
        decls = t.get("functionDeclarations") or []
        if not isinstance(decls, list):
            raise _bad(f"tools[{i}].functionDeclarations: must be a list")
        for j, d in enumerate(decls):
            where = f"tools[{i}].functionDeclarations[{j}]"
            d = fields.obj(d, where)
            key = "parametersJsonSchema" if d.get("parametersJsonSchema") is not None else "parameters"
            out.append(
                Tool(
                    name=fields.string(d, "name", where),
                    description=fields.opt_str(d, "description", where),
                    parameters=openapi_to_json_schema(fields.schema(d, key, where)),
                )
            )
    return out


def _tool_choice(tc: Any) -> str | dict[str, Any] | None:
    if not isinstance(tc, dict) or not isinstance(tc.get("functionCallingConfig"), dict):
        return None
    fcc = tc["functionCallingConfig"]
    where = "toolConfig.functionCallingConfig"
    mode = fields.opt_str(fcc, "mode", where, default="AUTO").upper()
    allowed = fields.opt_list(fcc, "allowedFunctionNames", where)
    if not all(isinstance(n, str) for n in allowed):
        raise fields.bad(f"{where}.allowedFunctionNames", "must be a list of strings")
    if mode in ("ANY", "VALIDATED") and len(allowed) == 1:
        return {"name": allowed[0]}
    return {"AUTO": "auto", "ANY": "required", "NONE": "none", "VALIDATED": "auto"}.get(mode)


def _json_schema(gc: dict[str, Any]) -> dict[str, Any] | None:
    if gc.get("responseJsonSchema") is not None:
        return openapi_to_json_schema(gc["responseJsonSchema"])
    if gc.get("responseSchema") is not None:
        return openapi_to_json_schema(gc["responseSchema"])
    if gc.get("responseMimeType") == "application/json":
        return {}  # JSON mode without a schema: any JSON value
    return None


def _thinking(gc: dict[str, Any]) -> bool | None:
    tc = gc.get("thinkingConfig")
    if not isinstance(tc, dict):
        return None
    budget = tc.get("thinkingBudget")
    if isinstance(budget, int) and not isinstance(budget, bool):
        return budget != 0  # -1 is "dynamic"
    level = tc.get("thinkingLevel")
    if isinstance(level, str):
        return level.upper() not in ("MINIMAL", "THINKING_LEVEL_UNSPECIFIED")
    return None


def _sampling(gc: Any) -> Sampling:
    if gc is None:
        return Sampling()
    if not isinstance(gc, dict):
        raise _bad("generationConfig: must be an object")
    stops = gc.get("stopSequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("generationConfig.stopSequences: must be a list of strings")
    try:
        return Sampling(
            max_tokens=gc.get("maxOutputTokens"),
            temperature=gc.get("temperature"),
            top_p=gc.get("topP"),
            top_k=gc.get("topK"),
            stop=stops,
            json_schema=_json_schema(gc),
        )
    except ValueError as e:
        raise _bad(f"generationConfig: invalid sampling parameter: {e}") from e


def parse_request(
    body: Any, *, path: str, require_max_tokens: bool = False, memo: ItemMemo | None = None
) -> ChatRequest:
    """A generateContent / streamGenerateContent / countTokens body (model and stream from `path`)."""
    # Gemini never requires maxOutputTokens; a function response is read with the calls of the
    # content before it, so contents do not read alone (no memo).
    del require_max_tokens, memo
    model, stream = model_and_stream(path)
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    body = json_names(body)
    # countTokens accepts a whole GenerateContentRequest in place of bare contents.
    if isinstance(body.get("generateContentRequest"), dict):
        body = body["generateContentRequest"]
    contents = body.get("contents")
    if not isinstance(contents, list):
        raise _bad("contents: field required (a list of Content objects)")
    messages: list[Message] = []
    system = base.without_billing_line(_system_text(body.get("systemInstruction")))
    if system:
        messages.append(Message(role="system", content=system))
    pending: list[ToolCall] = []
    for i, c in enumerate(contents):
        if not isinstance(c, dict):
            raise _bad(f"contents[{i}]: must be a Content object")
        role = c.get("role") or "user"
        if role == "model":
            msg = _parse_model(i, c)
            pending = list(msg.tool_calls)
            messages.append(msg)
        elif role in ("user", "function"):
            messages.extend(_parse_user(i, c, pending))
        else:
            raise _bad(f"contents[{i}].role: unexpected value {role!r}; expected 'user' or 'model'")
    sampling = _sampling(body.get("generationConfig"))
    thinking = _thinking(body.get("generationConfig") or {})
    if sampling.json_schema is not None:
        # Constrained decoding applies from the first sampled token, so the policy cannot think
        # before its JSON (Gemini CLI's router asks for both): render the prompt without thinking.
        thinking = False
    return ChatRequest(
        style=NAME,
        model=model,
        messages=messages,
        tools=_parse_tools(body.get("tools")),
        tool_choice=_tool_choice(body.get("toolConfig")),
        sampling=sampling,
        stream=stream,
        thinking=thinking,
    )


def parse_reply(reply: Any, *, lenient: bool = False) -> tuple[list[Message], FinishReason]:
    """A GenerateContentResponse's first candidate as one assistant message, read as the same
    content echoed in a later request is."""
    cand = first_of(reply, "candidates", lenient=lenient)
    given = cand.get("content")
    content = given if isinstance(given, dict) else {}
    msg = _parse_model(0, content, lenient=lenient)
    if cand.get("finishReason") == "MAX_TOKENS":
        return [msg], "length"
    return [msg], "tool_calls" if msg.tool_calls else "stop"
