"""Harvest mode's pure logic: a real provider exchange → one stored text turn.

In harvest mode the harness talks to the real provider (or an `--upstream` mapped in its place);
the proxy only watches. What it stores per model exchange is built here, without mitmproxy:

- `assemble(style, body, content_type)`: the upstream's reply, SSE or JSON, as one reply in the
  style's own JSON shape (an SSE stream becomes the message the non-streaming API would have
  returned, usage included). One function per style NAME in `ASSEMBLERS`; a style without one is
  kept as neutral JSON (`{"events": [...]}`).
- `reply_message(style, reply)`: that reply as a neutral assistant `Message` and finish reason,
  for exports. One function per style NAME in `REPLY_PARSERS`.
- `Exchange`: one request and its reply, turned into a `TurnRecord` with every credential removed
  (headers and query parameters through `polar_mitm.redact`, and any secret value that shows up
  in a body replaced as well), so nothing secret reaches the store.
- `parse_upstream`: `--upstream HOST=URL`.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from polar_mitm import redact
from polar_mitm.backends.policy import new_turn_id
from polar_mitm.neutral import ChatRequest, Message, ProviderError, ToolCall
from polar_mitm.providers import openai_responses
from polar_mitm.store.db import TurnRecord

# ---- server-sent events -------------------------------------------------------------------------


@dataclass(frozen=True)
class SSEEvent:
    event: str | None
    data: str


def parse_sse(text: str) -> list[SSEEvent]:
    """The events of an SSE body (fields `event` and `data`; comments and `id`/`retry` ignored)."""
    out: list[SSEEvent] = []
    name: str | None = None
    data: list[str] = []
    for line in re.split(r"\r\n|\r|\n", text) + [""]:
        if not line:
            if data:
                out.append(SSEEvent(name, "\n".join(data)))
            name, data = None, []
            continue
        if line.startswith(":"):
            continue
        key, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if key == "event":
            name = value
        elif key == "data":
            data.append(value)
    return out


def _json_events(events: Iterable[SSEEvent]) -> list[tuple[str | None, dict[str, Any]]]:
    out = []
    for ev in events:
        if ev.data.strip() == "[DONE]":
            continue
        try:
            data = json.loads(ev.data)
        except ValueError:
            continue
        if isinstance(data, dict):
            out.append((ev.event, data))
    return out


# ---- assembly: a streamed reply → the style's JSON reply ---------------------------------------

Assembler = Callable[[list[tuple[str | None, dict[str, Any]]]], dict[str, Any]]


def _assemble_anthropic(events: list[tuple[str | None, dict[str, Any]]]) -> dict[str, Any]:
    """Anthropic Messages SSE → the Message object the non-streaming API returns."""
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
            blocks[i]["input_raw"] = raw  # the model's invalid JSON, kept for the record

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


def _assemble_openai_chat(events: list[tuple[str | None, dict[str, Any]]]) -> dict[str, Any]:
    """Chat Completions chunks → the chat.completion object the non-streaming API returns."""
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


def _assemble_openai_responses(events: list[tuple[str | None, dict[str, Any]]]) -> dict[str, Any]:
    """Responses API events → the final response object (what `response.completed` carries)."""
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
    if final is None:  # the stream ended early: what was finished so far
        final = {**started, "status": "incomplete", "output": [items[i] for i in sorted(items)]}
    elif not final.get("output") and items:
        final["output"] = [items[i] for i in sorted(items)]
    if error is not None:
        final["error"] = error
    return final


def _assemble_gemini(events: list[tuple[str | None, dict[str, Any]]]) -> dict[str, Any]:
    """streamGenerateContent chunks → one GenerateContentResponse with the parts merged."""
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


ASSEMBLERS: dict[str, Assembler] = {
    "anthropic": _assemble_anthropic,
    "openai-chat": _assemble_openai_chat,
    "openai-responses": _assemble_openai_responses,
    "gemini": _assemble_gemini,
}


def is_sse(content_type: str | None) -> bool:
    return bool(content_type) and "text/event-stream" in content_type.lower()


def assemble(style: str, body: bytes, content_type: str | None) -> dict[str, Any]:
    """The upstream's reply as one JSON object in the style's own shape.

    An SSE body is assembled by the style's function in `ASSEMBLERS` (a style without one keeps
    its events as `{"events": [...]}`); a JSON body is the reply already, except a JSON array of
    chunks (Gemini's streamGenerateContent without alt=sse), which is assembled like a stream.
    Anything else is kept as `{"text": ...}`.
    """
    text = body.decode("utf-8", "replace")
    if is_sse(content_type):
        events = parse_sse(text)
        fn = ASSEMBLERS.get(style)
        if fn is None:
            return {"events": [{"event": e.event, "data": e.data} for e in events]}
        return fn(_json_events(events))
    try:
        data = json.loads(text) if text.strip() else {}
    except ValueError:
        return {"text": text}
    if isinstance(data, list):
        fn = ASSEMBLERS.get(style)
        chunks = [(None, d) for d in data if isinstance(d, dict)]
        return fn(chunks) if fn is not None else {"chunks": data}
    return data if isinstance(data, dict) else {"value": data}


def error_of(reply: dict[str, Any]) -> str | None:
    """The error a provider reported inside its reply (every style nests it under "error")."""
    err = reply.get("error")
    if not err:
        return None
    if isinstance(err, dict):
        return str(err.get("message") or err.get("type") or json.dumps(err, ensure_ascii=False))
    return str(err)


# ---- a reply → a neutral assistant message -------------------------------------------------------

ReplyParser = Callable[[dict[str, Any]], tuple[list[Message], str]]


def _arguments(raw: Any) -> tuple[dict[str, Any], str | None]:
    """Tool-call arguments as a dict, or ({}, raw text) when the model's JSON is invalid."""
    if isinstance(raw, dict):
        return raw, None
    if not isinstance(raw, str) or not raw.strip():
        return {}, None
    try:
        value = json.loads(raw)
    except ValueError:
        return {}, raw
    return (value, None) if isinstance(value, dict) else ({}, raw)


_ANTHROPIC_FINISH = {
    "tool_use": "tool_calls",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
}


def _anthropic_reply(reply: dict[str, Any]) -> tuple[list[Message], str]:
    texts, reasoning, calls = [], [], []
    for b in reply.get("content") or []:
        if not isinstance(b, dict):
            continue
        kind = b.get("type")
        if kind == "text":
            texts.append(str(b.get("text", "")))
        elif kind == "thinking":
            reasoning.append(str(b.get("thinking", "")))
        elif kind in ("tool_use", "server_tool_use"):
            args, raw = _arguments(b.get("input_raw") if "input_raw" in b else b.get("input"))
            calls.append(
                ToolCall(id=str(b.get("id", "")), name=str(b.get("name", "")), arguments=args, raw=raw)
            )
    msg = Message(
        role="assistant", content="".join(texts), reasoning="".join(reasoning) or None, tool_calls=calls
    )
    return [msg], _ANTHROPIC_FINISH.get(str(reply.get("stop_reason")), "stop")


_OPENAI_FINISH = {"tool_calls": "tool_calls", "function_call": "tool_calls", "length": "length"}


def _openai_chat_reply(reply: dict[str, Any]) -> tuple[list[Message], str]:
    choices = reply.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    m = choice.get("message") or {}
    content = m.get("content")
    if isinstance(content, list):  # content parts
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    reasoning = m.get("reasoning_content") or m.get("reasoning")
    calls = []
    for i, c in enumerate(m.get("tool_calls") or []):
        fn = c.get("function") or {}
        args, raw = _arguments(fn.get("arguments"))
        calls.append(
            ToolCall(
                id=str(c.get("id") or f"call_{i}"), name=str(fn.get("name", "")), arguments=args, raw=raw
            )
        )
    msg = Message(
        role="assistant",
        content=str(content or ""),
        reasoning=reasoning if isinstance(reasoning, str) and reasoning else None,
        tool_calls=calls,
    )
    finish = _OPENAI_FINISH.get(str(choice.get("finish_reason")), "stop")
    return [msg], "tool_calls" if calls and finish == "stop" else finish


def _gemini_reply(reply: dict[str, Any]) -> tuple[list[Message], str]:
    cands = reply.get("candidates") or [{}]
    cand = cands[0] if isinstance(cands[0], dict) else {}
    texts, reasoning, calls = [], [], []
    for p in (cand.get("content") or {}).get("parts") or []:
        if not isinstance(p, dict):
            continue
        if isinstance(p.get("text"), str):
            (reasoning if p.get("thought") else texts).append(p["text"])
        elif isinstance(p.get("functionCall"), dict):
            fc = p["functionCall"]
            args = fc.get("args") if isinstance(fc.get("args"), dict) else {}
            calls.append(
                ToolCall(
                    id=str(fc.get("id") or f"call_{len(calls)}"), name=str(fc.get("name", "")), arguments=args
                )
            )
    msg = Message(
        role="assistant", content="".join(texts), reasoning="".join(reasoning) or None, tool_calls=calls
    )
    if cand.get("finishReason") == "MAX_TOKENS":
        return [msg], "length"
    return [msg], "tool_calls" if calls else "stop"


REPLY_PARSERS: dict[str, ReplyParser] = {
    "anthropic": _anthropic_reply,
    "openai-chat": _openai_chat_reply,
    "openai-responses": lambda reply: openai_responses.parse_reply(reply, lenient=True),
    "gemini": _gemini_reply,
}


def reply_message(style: str, reply: dict[str, Any]) -> tuple[list[Message], str]:
    """An assembled reply as neutral assistant messages and its neutral finish reason."""
    fn = REPLY_PARSERS.get(style)
    if fn is None:
        raise KeyError(f"no reply parser for style {style!r}; known: {', '.join(sorted(REPLY_PARSERS))}")
    return fn(reply)


def parse_request(module: ModuleType, body: Any, path: str) -> ChatRequest:
    """A harvested request as the neutral model, the way the gateway parses one it answers."""
    kwargs: dict[str, Any] = {}
    if getattr(module, "PARSE_NEEDS_PATH", False):
        kwargs["path"] = path
    return module.parse_request(body, **kwargs)


# ---- credentials -------------------------------------------------------------------------------

# Shorter values (a "1", a "true") would blank out ordinary text; credentials are never that short.
MIN_SECRET_LEN = 8


def secret_values(headers: Iterable[tuple[str, str]], url: str) -> set[str]:
    """Every credential a request carries: secret header values (and the token inside
    `Bearer …` / `Basic …`, and cookie values) and secret query parameters."""
    found: set[str] = set()
    for k, v in headers:
        lk = k.lower()
        if not (lk in redact.SECRET_HEADERS or "secret" in lk or "token" in lk):
            continue
        found.add(v.strip())
        scheme, _, token = v.strip().partition(" ")
        if token:
            found.add(token.strip())
            if scheme.lower() == "basic":
                try:
                    found.update(base64.b64decode(token.strip()).decode().split(":", 1))
                except (binascii.Error, UnicodeDecodeError):
                    pass
        if lk in ("cookie", "set-cookie"):
            for part in v.split(";"):
                found.add(part.partition("=")[2].strip())
    for k, v in parse_qsl(urlsplit(url).query, keep_blank_values=False):
        if k.lower() in redact.SECRET_PARAMS:
            found.add(v)
    return {s for s in found if len(s) >= MIN_SECRET_LEN}


def scrub(text: str | None, secrets: Iterable[str]) -> str | None:
    """`text` with every secret value replaced by the redaction marker."""
    if text is None:
        return None
    for s in sorted(secrets, key=len, reverse=True):
        text = text.replace(s, redact.REDACTED)
    return text


# ---- one exchange → one stored turn ----------------------------------------------------------------

Tagger = Callable[[ChatRequest, str], str | None]
_MODEL_IN_PATH = re.compile(r"/models/([^/:?]+)")


@dataclass
class Exchange:
    """A model request the proxy forwarded, and (as it streams back) its reply."""

    session_id: str
    style: ModuleType
    host: str
    method: str
    path: str
    request_headers: list[tuple[str, str]]
    request_body: bytes
    started: float = field(default_factory=time.time)
    # The reply's bytes as they pass to the harness (decoded of any content-encoding at the end).
    reply: bytearray = field(default_factory=bytearray)
    max_reply_bytes: int = 64 * 1024 * 1024
    truncated: bool = False

    def tee(self, chunk: bytes) -> bytes:
        """mitmproxy's `response.stream` callable: keep a copy, pass the chunk on unchanged."""
        if len(self.reply) + len(chunk) <= self.max_reply_bytes:
            self.reply += chunk
        elif chunk:
            self.truncated = True
        return chunk

    def record(
        self,
        *,
        status_code: int | None,
        content_type: str | None,
        reply_body: bytes | None,
        ended: float | None = None,
        failure: str | None = None,
        tagger: Tagger | None = None,
    ) -> TurnRecord:
        """The exchange as a text turn: raw request and assembled reply, no token ids, no secrets.

        `failure` is set when the exchange did not complete (upstream unreachable, a side hung
        up mid-stream); the turn is then stored as aborted, with whatever reply had arrived.
        """
        secrets = secret_values(self.request_headers, self.path)
        request_text = self.request_body.decode("utf-8", "replace")
        try:
            body: Any = json.loads(request_text)
        except ValueError:
            body = None
        model = body.get("model") if isinstance(body, dict) else None
        if not model and (m := _MODEL_IN_PATH.search(self.path)):
            model = m.group(1)
        tag = None
        if tagger is not None and body is not None:
            try:
                tag = tagger(parse_request(self.style, body, self.path), self.path)
            except (ProviderError, ValueError, TypeError, KeyError):
                tag = None
        reply: dict[str, Any] | None = None
        finish: str | None = None
        error = failure
        if reply_body is not None and (reply_body or status_code is not None):
            reply = assemble(self.style.NAME, reply_body, content_type)
            if self.truncated:
                reply["polar_truncated"] = True
            error = error or error_of(reply)
            if status_code is not None and status_code >= 400:
                error = error or f"HTTP {status_code}"
            elif self.style.NAME in REPLY_PARSERS and error is None:
                try:
                    finish = reply_message(self.style.NAME, reply)[1]
                except (ValueError, TypeError, KeyError, AttributeError):
                    finish = None
        status = "aborted" if failure else ("error" if error else "ok")
        ended = ended if ended is not None else time.time()
        return TurnRecord(
            id=new_turn_id(),
            session_id=self.session_id,
            created_at=self.started,
            style=self.style.NAME,
            host=self.host,
            path=scrub(redact.url(self.path), secrets),
            model=str(model) if model else None,
            tag=tag,
            status=status,
            finish_reason=finish or ("abort" if failure else ("error" if error else None)),
            request=scrub(request_text, secrets),
            request_headers={
                k: scrub(v, secrets) or "" for k, v in redact.headers(self.request_headers).items()
            },
            response=scrub(json.dumps(reply, ensure_ascii=False), secrets) if reply is not None else None,
            error=scrub(error, secrets),
            latency_ms=max(0.0, (ended - self.started) * 1000),
        )


# ---- --upstream HOST=URL -------------------------------------------------------------------------


@dataclass(frozen=True)
class Upstream:
    """Where requests for one provider host go instead of the host itself."""

    scheme: str
    host: str
    port: int
    path_prefix: str = ""

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}{self.path_prefix}"


def parse_upstream(spec: str) -> tuple[str, Upstream]:
    """`api.anthropic.com=https://127.0.0.1:8443[/prefix]` → (host, Upstream)."""
    host, sep, url = spec.partition("=")
    host = host.strip().lower()
    if not sep or not host or not url:
        raise ValueError(
            f"--upstream {spec!r}: expected HOST=URL, e.g. api.anthropic.com=https://10.0.0.5:8443"
        )
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--upstream {spec!r}: the URL must be http(s)://HOST[:PORT][/PREFIX]")
    if parts.username or parts.password:
        raise ValueError(f"--upstream {spec!r}: credentials in the URL would be stored; leave them out")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as e:
        raise ValueError(f"--upstream {spec!r}: {e}") from None
    return host, Upstream(parts.scheme, parts.hostname, port, parts.path.rstrip("/"))
