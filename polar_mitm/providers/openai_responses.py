"""OpenAI Responses API: native request → ChatRequest, Completion/events → native JSON or SSE.

Spoken by Codex CLI, Pi, OpenCode and OpenClaw. Most requests are stateless: the whole
conversation arrives as `input` items each time. A stateful client sends only what is new, with
`previous_response_id` naming our last response: the proxy hands `parse_request` the `history`
that response continues (its request's items and its output items, as a stateless client would
have echoed them, see `proxy/continuations.py`), so the prompt splices exactly as for a stateless
client. An id we never gave, or gave another session, is refused in the provider's own shape
(`previous_not_found`); a `conversation` object is refused. Input items are grouped back into neutral
messages: the reasoning, message and function-call items of one model reply become one
assistant message, in the order we render them, so an echoed reply hashes like the turn that
sampled it. Reasoning we render carries its text in `encrypted_content` (a recognizable
`polar-r1:` token) as well as in `summary`, so the echo maps back to the same reasoning even when
a harness drops the summary.

The reply half (the response object, the SSE stream with the full event sequence real clients
require, errors) is `openai_responses_render`; this module, the style, takes its names.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

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
from polar_mitm.providers.base import Endpoint, ItemMemo

# The reply half (native JSON and SSE, errors) is its own module; the style is this one.
from polar_mitm.providers.openai_responses_render import COMPACTION_TOKEN_PREFIX as COMPACTION_TOKEN_PREFIX
from polar_mitm.providers.openai_responses_render import REASONING_TOKEN_PREFIX as REASONING_TOKEN_PREFIX
from polar_mitm.providers.openai_responses_render import ResponsesRequest as ResponsesRequest
from polar_mitm.providers.openai_responses_render import assemble as assemble
from polar_mitm.providers.openai_responses_render import reasoning_token as reasoning_token
from polar_mitm.providers.openai_responses_render import render_count as render_count
from polar_mitm.providers.openai_responses_render import render_error as render_error
from polar_mitm.providers.openai_responses_render import render_models as render_models
from polar_mitm.providers.openai_responses_render import render_response as render_response
from polar_mitm.providers.openai_responses_render import render_stream as render_stream
from polar_mitm.providers.openai_responses_render import render_stream_error as render_stream_error

NAME = "openai-responses"
ID_PREFIX = "call_"
HOSTS = ["api.openai.com"]
# Responses request fields: those read (or refused: conversation, background), then those that change neither the prompt nor what the policy may answer.
KNOWN_FIELDS = frozenset(
    {"model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature"}
    | {"top_p", "reasoning", "text", "stream", "background", "previous_response_id", "conversation"}
    | {"store", "metadata", "user", "parallel_tool_calls", "include", "service_tier", "truncation"}
    | {"prompt_cache_key", "safety_identifier", "stream_options", "top_logprobs", "client_metadata"}
)


def unknown_fields(body: Any) -> list[str]:
    unknown = base.unknown_fields(body, KNOWN_FIELDS)
    # OpenClaw's server-side compaction (`[{"type": "compaction", "compact_threshold": N}]`): past
    # N tokens OpenAI's server would compact the context itself. The policy is given the whole
    # context (past its window the harness is told the prompt is too long, and compacts): said
    # only in another form.
    cm = body.get("context_management") if isinstance(body, dict) else None
    if (
        "context_management" in unknown
        and isinstance(cm, list)
        and all(isinstance(e, dict) and e.get("type") == "compaction" for e in cm)
    ):
        unknown.remove("context_management")
    return unknown


# Codex's "responses_compaction_v2" ends its input with a `compaction_trigger` item and expects
# exactly one `compaction` output item back; the policy writes the summary (a turn tagged
# "compaction"), which comes back in later requests as that item's encrypted_content.
COMPACTION_PROMPT = (
    "Context checkpoint: summarize the conversation so far (the task, what has been done, the "
    "current state and what remains) so that the work can continue from this summary alone."
)
COMPACTION_HEADER = "Summary of the earlier conversation:\n"

# Tool types that are not functions but that a local policy can still be offered as one.
# local_shell: Codex's built-in shell, called with an argv array.
LOCAL_SHELL_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "command": {"type": "array", "items": {"type": "string"}, "description": "argv of the command"},
        "workdir": {"type": "string", "description": "working directory"},
        "timeout_ms": {"type": "integer", "description": "timeout in milliseconds"},
    },
    "required": ["command"],
}


def endpoint(method: str, path: str) -> Endpoint | None:
    """Which Responses endpoint a request is for, or None (for Chat Completions, side calls…).

    The API lives at `/v1/responses`, and under other prefixes too (Codex with a ChatGPT login
    uses `/backend-api/codex/responses`, Azure `/openai/responses`): the suffix decides.
    """
    p = path.split("?", 1)[0].rstrip("/")
    if method == "POST" and p.endswith("/responses"):
        return "generate"
    if method == "POST" and p.endswith("/responses/input_tokens"):
        return "count_tokens"
    return None


# ---- request -----------------------------------------------------------------------------------


def previous_not_found(resp_id: str, why: str) -> ProviderError:
    """The Responses API's refusal of a `previous_response_id` it cannot continue from."""
    e = ProviderError("not_found", f"Previous response with id {resp_id[:100]!r} not found: {why}.", 404)
    e.param, e.code = "previous_response_id", "previous_response_not_found"  # type: ignore[attr-defined]
    return e


def previous_response(body: Any) -> str | None:
    """The `previous_response_id` a request continues from, if any."""
    prev = body.get("previous_response_id") if isinstance(body, dict) else None
    if prev is not None and not isinstance(prev, str):
        raise _bad("previous_response_id: must be a string (the id of an earlier response)")
    return prev or None


def turn_of(resp_id: str) -> str | None:
    """The turn whose response `resp_id` is (`response_id`'s inverse), or None for an id of
    another form (one we never gave)."""
    rest = resp_id.removeprefix("resp_")
    return "turn_" + rest if rest != resp_id and rest.isalnum() else None


def input_items(body: dict[str, Any]) -> list[Any]:
    """A request's own `input` as a list of items (a string is one user message)."""
    raw = body.get("input")
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    return list(raw) if isinstance(raw, list) else []


def _bad(msg: str) -> ProviderError:
    return fields.InvalidRequest(msg)


def reasoning_from_token(token: Any, prefix: str = REASONING_TOKEN_PREFIX) -> str | None:
    if not isinstance(token, str) or not token.startswith(prefix):
        return None
    try:
        return base64.b64decode(token[len(prefix) :], validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None


def _parts_text(content: Any, where: str) -> str:
    """The text of a message's content: a string or a list of content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}: must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise _bad(f"{where}.{j}: content parts must be objects")
        kind = fields.type_tag(part, f"{where}.{j}")
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            texts.append(fields.opt_str(part, "text", f"{where}.{j}"))
        elif kind == "refusal":
            texts.append(fields.opt_str(part, "refusal", f"{where}.{j}"))
        elif kind in ("input_image", "input_file", "input_audio"):
            texts.append(f"[{kind.removeprefix('input_')}]")
    return "".join(texts)


def _arguments(raw: Any, name: str, call_id: str) -> ToolCall:
    if isinstance(raw, dict):
        return ToolCall(id=call_id, name=name, arguments=raw)
    text = raw if isinstance(raw, str) else ""
    try:
        parsed = json.loads(text) if text.strip() else {}
    except ValueError:
        return ToolCall(id=call_id, name=name, raw=text)
    if isinstance(parsed, dict):
        return ToolCall(id=call_id, name=name, arguments=parsed)
    return ToolCall(id=call_id, name=name, raw=text)


def _reasoning_text(item: dict[str, Any]) -> str:
    own = reasoning_from_token(item.get("encrypted_content"))
    if own is not None:
        return own
    for key in ("content", "summary"):
        text = _parts_text(item.get(key), "reasoning")
        if text:
            return text
    return ""


def _tool_call(item: dict[str, Any], where: str) -> ToolCall:
    kind = item.get("type")
    call_id = fields.opt_str(item, "call_id", where) or fields.opt_str(item, "id", where)
    if kind == "local_shell_call":
        given = item.get("action")
        action = given if isinstance(given, dict) else {}
        args: dict[str, Any] = {"command": action.get("command") or []}
        if action.get("working_directory"):
            args["workdir"] = action["working_directory"]
        if action.get("timeout_ms") is not None:
            args["timeout_ms"] = action["timeout_ms"]
        return ToolCall(id=call_id, name="local_shell", arguments=args)
    name = fields.string(item, "name", where)
    if kind == "custom_tool_call":
        return ToolCall(id=call_id, name=name, arguments={"input": fields.opt_str(item, "input", where)})
    return _arguments(item.get("arguments"), name, call_id)


def _output_text(output: Any, where: str) -> str:
    if isinstance(output, dict):  # some clients send {"content": …} or {"output": …}
        output = output.get("content", output.get("output", json.dumps(output)))
    return _parts_text(output, where)


def _convert_tool(t: Any, where: str) -> Tool | None:
    """A Responses tool as a neutral function tool; None for hosted tools a policy cannot run."""
    t = fields.obj(t, where)
    kind = fields.type_tag(t, where) or "function"
    if kind == "function":
        if isinstance(t.get("function"), dict):  # tolerate Chat's nesting
            t, where = t["function"], f"{where}.function"
        return Tool(
            name=fields.string(t, "name", where),
            description=fields.opt_str(t, "description", where),
            parameters=fields.schema(t, "parameters", where) or fields.no_arguments(),
        )
    if kind == "custom":  # freeform tools (Codex's apply_patch) take one string
        name = fields.string(t, "name", where)
        fmt = fields.opt_obj(t, "format", where) or {}
        grammar = None
        if fmt.get("type") == "grammar" and fmt.get("definition"):
            syntax = fields.opt_str(fmt, "syntax", f"{where}.format", default="grammar")
            grammar = (syntax, fields.string(fmt, "definition", f"{where}.format"))
        return base.freeform_tool(name, fields.opt_str(t, "description", where), grammar)
    if kind == "local_shell":
        return Tool(
            name="local_shell", description="Runs a shell command.", parameters=LOCAL_SHELL_PARAMETERS
        )
    return None  # web_search, file_search, image_generation, mcp, …: hosted, not offered


def _tools(raw: Any, where: str, kinds: dict[str, str]) -> list[Tool]:
    """The offered tools; `kinds` learns which of them are not plain functions."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise _bad(f"{where}: must be a list of tools")
    out = []
    for j, t in enumerate(raw):
        if isinstance(t, dict) and fields.type_tag(t, f"{where}.{j}") == "namespace":
            # Codex groups tools in namespaces ("functions", "clock", …); calls name the tool alone.
            out.extend(_tools(t.get("tools"), f"{where}.{j}.tools", kinds))
            continue
        tool = _convert_tool(t, f"{where}.{j}")
        if tool is not None:
            out.append(tool)
            if t.get("type") in ("custom", "local_shell"):
                kinds[tool.name] = t["type"]
    return out


class _Conversation:
    """Folds Responses input items into neutral messages, one assistant message per model reply."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.tools: list[Tool] = []
        self.tool_kinds: dict[str, str] = {}
        self.reply: Message | None = None
        self.compaction = False

    def flush(self) -> None:
        if self.reply is not None:
            self.messages.append(self.reply)
            self.reply = None

    def assistant(self) -> Message:
        if self.reply is None:
            self.reply = Message(role="assistant")
        return self.reply

    def add(self, where: str, item: Any) -> None:
        if not isinstance(item, dict):
            raise _bad(f"{where}: each input item must be an object")
        kind = fields.type_tag(item, where) or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            text = _parts_text(item.get("content"), f"{where}.content")
            if role == "assistant":
                # A reply's text precedes its tool calls: text after text or calls is a new reply.
                if self.reply is not None and (self.reply.content or self.reply.tool_calls):
                    self.flush()
                self.assistant().content = text
                return
            if role not in ("user", "system", "developer"):
                raise _bad(
                    f"{where}.role: unexpected value {role!r}; expected user, system, developer or assistant"
                )
            self.flush()
            if role != "user":
                text = base.without_billing_line(text)
            self.messages.append(Message(role="user" if role == "user" else "system", content=text))
        elif kind == "reasoning":
            # Reasoning opens a reply; a second one after text or calls opens the next reply.
            r = self.reply
            if r is not None and (r.content or r.tool_calls):
                self.flush()
            reply = self.assistant()
            text = _reasoning_text(item)
            reply.reasoning = (reply.reasoning or "") + text if text else reply.reasoning
        elif kind in ("function_call", "custom_tool_call", "local_shell_call"):
            self.assistant().tool_calls.append(_tool_call(item, where))
        elif kind in ("function_call_output", "custom_tool_call_output", "local_shell_call_output"):
            self.flush()
            self.messages.append(
                Message(
                    role="tool",
                    content=_output_text(item.get("output"), f"{where}.output"),
                    tool_call_id=fields.opt_str(item, "call_id", where),
                )
            )
        elif kind == "additional_tools":
            # Codex's "responses-lite" shape: the tool list travels as an input item.
            self.tools.extend(_tools(item.get("tools"), f"{where}.tools", self.tool_kinds))
        elif kind == "compaction_trigger":
            self.flush()
            self.compaction = True
            self.messages.append(Message(role="user", content=COMPACTION_PROMPT))
        elif kind == "compaction":
            self.flush()
            summary = reasoning_from_token(item.get("encrypted_content"), COMPACTION_TOKEN_PREFIX)
            # A compaction made elsewhere is opaque to a local policy: say that history was cut.
            text = COMPACTION_HEADER + summary if summary is not None else "[earlier conversation compacted]"
            self.messages.append(Message(role="user", content=text))
        elif kind == "item_reference":
            raise _bad(
                f"{where}: item_reference is not supported: send the full items in `input`, or only "
                "the new ones with previous_response_id"
            )
        # Other items (web_search_call, image_generation_call, compaction markers…) carry nothing
        # a local policy can render; they are skipped rather than refused.


def _json_schema(text: Any) -> dict[str, Any] | None:
    if not isinstance(text, dict) or not isinstance(text.get("format"), dict):
        return None
    fmt = text["format"]
    if fmt.get("type") == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise _bad("text.format.schema: required for json_schema (an object)")
        return schema
    if fmt.get("type") == "json_object":
        return {"type": "object"}
    return None


def _tool_choice(tc: Any) -> str | dict[str, Any] | None:
    if isinstance(tc, str):
        return tc if tc in ("auto", "none", "required") else None
    if isinstance(tc, dict):
        kind = fields.type_tag(tc, "tool_choice")
        if kind in ("function", "custom"):
            return {"name": fields.string(tc, "name", "tool_choice")}
        if kind == "allowed_tools":
            return tc.get("mode") if tc.get("mode") in ("auto", "required") else "auto"
    return None


def parse_request(
    body: Any,
    *,
    path: str = "",
    require_max_tokens: bool = False,
    memo: ItemMemo | None = None,
    history: list[Any] | None = None,
) -> ChatRequest:
    """`history`: the input items that the response named by `previous_response_id` continues
    (required with one), read before the request's own `input`; instructions are the request's
    own, as the API does not carry them over."""
    # Everything is in the body; max_output_tokens is optional. Input items fold into the
    # messages around them (a function call joins the assistant message before it), so they do
    # not read alone (no memo).
    del path, require_max_tokens, memo
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    prev = previous_response(body)
    if prev is not None and history is None:
        raise previous_not_found(prev, "only the polar-mitm proxy that gave a response can continue it")
    if body.get("conversation"):
        raise _bad(
            "conversation is not supported: polar-mitm keeps no conversation objects. Send the whole "
            "conversation in `input`, or continue a response with previous_response_id."
        )
    if body.get("background"):
        raise _bad("background responses are not supported by polar-mitm; send stream or wait for the reply")
    conv = _Conversation()
    instructions = body.get("instructions")
    if instructions is not None:
        text = base.without_billing_line(_parts_text(instructions, "instructions"))
        if text:
            conv.messages.append(Message(role="system", content=text))
    raw_input = body.get("input")
    if raw_input is None:
        raise _bad("input: field required (a string or a list of input items)")
    if not isinstance(raw_input, str | list):
        raise _bad("input: must be a string or a list of input items")
    for i, item in enumerate(history or []):
        conv.add(f"(the conversation of {prev}).{i}", item)
    if isinstance(raw_input, str):
        conv.flush()
        conv.messages.append(Message(role="user", content=raw_input))
    else:
        for i, item in enumerate(raw_input):
            conv.add(f"input.{i}", item)
    conv.flush()
    tools = _tools(body.get("tools"), "tools", conv.tool_kinds) + conv.tools
    max_tokens = body.get("max_output_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)):
        raise _bad("max_output_tokens: must be an integer")
    reasoning = body.get("reasoning")
    thinking: bool | None = None
    if isinstance(reasoning, dict) and reasoning.get("effort"):
        thinking = reasoning["effort"] != "none"
    try:
        sampling = Sampling(
            max_tokens=max_tokens,
            temperature=body.get("temperature"),
            top_p=body.get("top_p"),
            json_schema=_json_schema(body.get("text")),
        )
    except ValueError as e:
        raise _bad(f"invalid sampling parameter: {e}") from e
    return ResponsesRequest(
        style=NAME,
        model=fields.opt_str(body, "model", ""),
        messages=conv.messages,
        tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice")),
        sampling=sampling,
        stream=bool(body.get("stream", False)),
        thinking=thinking,
        tool_kinds=conv.tool_kinds,
        compaction=conv.compaction,
        previous_response_id=prev,
        store=body.get("store") is True,
    )


# Output item types that carry the model's reply (the rest, e.g. web_search_call, carry nothing a
# local policy can be trained on).
REPLY_ITEMS = ("reasoning", "message", "function_call", "custom_tool_call", "local_shell_call")


def parse_reply(reply: Any, *, lenient: bool = False) -> tuple[list[Message], FinishReason]:
    """A response object's output items as assistant messages and the neutral finish reason.

    The items are folded exactly as the same items echoed in a later request's `input` are, so a
    recorded reply and its echo are the same messages. `lenient` skips items that do not parse
    (an upstream's reply is not ours to refuse) instead of raising."""
    if not isinstance(reply, dict):
        raise _bad("reply must be a JSON object")
    conv = _Conversation()
    for i, item in enumerate(reply.get("output") or []):
        kind = item.get("type") if isinstance(item, dict) else None
        try:
            if kind is None:
                raise _bad(f"output.{i}: each output item must be an object with a type")
            if kind in REPLY_ITEMS:
                conv.add(f"output.{i}", {**item, "role": "assistant"} if kind == "message" else item)
        except ProviderError:
            if not lenient:
                raise
    conv.flush()
    messages = conv.messages or [Message(role="assistant")]
    if reply.get("status") == "incomplete":
        return messages, "length"
    return messages, "tool_calls" if any(m.tool_calls for m in messages) else "stop"
