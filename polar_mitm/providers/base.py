"""What every API style implements: the `Style` protocol, and the small helpers they share.

A style is one module (`anthropic`, `openai_chat`, `openai_responses`, `gemini`); the module
itself is the object that implements `Style`, and the type checker holds each one to it (see the
registry in `polar_mitm.providers`). Both directions of the API live in that one file: a request
and an assistant reply are parsed by the same code whether the policy answers them or harvest
mode records a real provider's, so an echoed reply always reads like the reply it echoes. A
long style's reply half (rendering JSON and SSE, errors) may sit in a module beside it
(`openai_responses_render`, `gemini_render`), whose names the style module takes.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Literal, Protocol

import orjson

from polar_mitm.neutral import (
    ChatRequest,
    Completion,
    Event,
    FinishReason,
    Message,
    ProviderError,
    Tool,
    ToolCall,
)
from polar_mitm.sse import JsonEvent

Endpoint = Literal["generate", "count_tokens", "models"]

# Claude Code's per-request system line (`x-anthropic-billing-header: cc_version=…; cch=…;`), whose
# hash changes every request: kept, every turn would look like a new conversation. It reaches
# every style: claude-code-router keeps it in the system prompt it sends on.
_BILLING_LINE = re.compile(r"^\s*x-anthropic-billing-header:.*$", re.MULTILINE)


def without_billing_line(system: str) -> str:
    """A system prompt without Claude Code's billing line (and the blank lines it leaves at the
    start); a prompt without one is returned as it came."""
    if "x-anthropic-billing-header:" not in system:  # the regex alone scans a 100 KB prompt for ms
        return system
    return re.sub(r"^(\s*\n)+", "", _BILLING_LINE.sub("", system))


class Style(Protocol):
    """One provider API style: its hosts and paths, both halves of its wire format, its errors."""

    NAME: str  # stored as turns.style
    ID_PREFIX: str  # of the tool-call ids we make up
    HOSTS: list[str]  # the provider hosts it answers by default

    def endpoint(self, method: str, path: str) -> Endpoint | None:
        """Which model endpoint (method, path) is, or None for anything else (side calls)."""
        ...

    def parse_request(
        self, body: Any, *, path: str, require_max_tokens: bool = ..., memo: ItemMemo | None = ...
    ) -> ChatRequest:
        """A native request body (and its path, where the model or stream flag live) as neutral.
        `memo`, what the conversation's last requests were read as, spares reading repeated
        messages and tools again (styles whose items each read alone use it)."""
        ...

    def parse_reply(self, reply: Any, *, lenient: bool = ...) -> tuple[list[Message], FinishReason]:
        """A native (assembled) reply as assistant messages, parsed like the same reply echoed in
        a later request; `lenient` leaves out what does not parse instead of raising."""
        ...

    def render_response(self, c: Completion, req: ChatRequest) -> dict[str, Any]:
        """A completion as the native JSON reply to `req`."""
        ...

    def render_stream(self, events: AsyncIterator[Event], req: ChatRequest) -> AsyncIterator[bytes]:
        """The policy's events as the native SSE stream, produced as they arrive."""
        ...

    def assemble(self, events: list[JsonEvent]) -> dict[str, Any]:
        """A recorded stream (its JSON events) as the JSON reply the non-streaming API returns."""
        ...

    def render_error(self, e: ProviderError) -> tuple[int, dict[str, Any]]:
        """An error as (HTTP status, native error body)."""
        ...

    def render_stream_error(self, e: ProviderError) -> bytes:
        """An error after a stream began, as the bytes that end it."""
        ...

    def render_count(self, n: int) -> dict[str, Any]: ...

    def unknown_fields(self, body: Any) -> list[str]:
        """The top-level fields of a request body this style neither reads nor knowingly ignores
        (so a field the provider accepts and we misread is said, not silent)."""
        ...

    def render_models(self, names: list[str]) -> dict[str, Any]: ...


class ItemMemo:
    """What the items (messages, tools) of a conversation's last two requests were read as.

    A harness sends its whole conversation every turn, so each request repeats, item for item,
    the one before it plus what is new, and reading every item again costs a long conversation
    milliseconds a turn. `read` gives an item whose JSON text (orjson's, which tells 1, 1.0 and
    true apart), read by the same function, was in the last two requests what it was read as
    then, and reads the others. Two requests, so a side call between two turns (a title, a
    summary) does not make the next turn read everything again. The owner calls `begin` before a
    request is read and `settle` once it has read whole: what a request that failed read is
    dropped with it.

    For items that read alone (their reading depends on nothing else; the index only names them
    in errors), whose readings nobody changes afterwards (they are shared between turns), and
    bodies read by orjson (`fields.read_body`): its text of NaN is that of null."""

    __slots__ = ("last", "before", "now", "size", "_now_size", "_last_size")

    def __init__(self) -> None:
        self.last: dict[tuple[Callable, bytes], Any] = {}
        self.before: dict[tuple[Callable, bytes], Any] = {}
        self.now: dict[tuple[Callable, bytes], Any] = {}  # the request being read
        self.size = 0  # bytes of JSON text held by `last` and `before`
        self._now_size = 0  # ... by `now`, and by `last`: kept as keys come, not summed again
        self._last_size = 0

    def begin(self) -> None:
        self.now = {}
        self._now_size = 0

    def read[T, R](self, items: list[T], parse: Callable[[int, T], R]) -> list[R]:
        out: list[R] = []
        now = self.now
        for i, item in enumerate(items):
            try:
                key = (parse, orjson.dumps(item))
            except TypeError:  # not orjson's to write (an integer past 64 bits): read it
                out.append(parse(i, item))
                continue
            known = now.get(key, _MISSING)
            if known is _MISSING:
                self._now_size += len(key[1])
                known = self.last.get(key, _MISSING)
            if known is _MISSING:
                known = self.before.get(key, _MISSING)
            if known is _MISSING:
                known = parse(i, item)
            now[key] = known
            out.append(known)
        return out

    def settle(self) -> None:
        """The request has read whole: its items become the last request's."""
        self.before, self.last, self.now = self.last, self.now, {}
        self.size = self._last_size + self._now_size
        self._last_size, self._now_size = self._now_size, 0


_MISSING = object()


def freeform_tool(name: str, description: str, grammar: tuple[str, str] | None = None) -> Tool:
    """A custom (freeform) tool, which takes one string and no JSON (OpenAI's `custom` tools in
    Responses and Chat Completions, e.g. Codex's and Copilot CLI's apply_patch), as a function
    with one string argument, `input`; `grammar` is (syntax, definition) when the input must
    match one, and the policy is told it in the argument's description."""
    hint = "The raw input for this tool."
    if grammar is not None:
        hint += f" It must match this {grammar[0]} grammar:\n{grammar[1]}"
    return Tool(
        name=name,
        description=description,
        parameters={
            "type": "object",
            "properties": {"input": {"type": "string", "description": hint}},
            "required": ["input"],
        },
    )


def freeform_input(call: ToolCall) -> str:
    """A call of a freeform tool as the one string it takes (its `input`; the policy's raw text
    when its arguments did not parse; else the arguments as JSON)."""
    value = call.arguments.get("input") if call.raw is None else call.raw
    return value if isinstance(value, str) else json.dumps(call.arguments, ensure_ascii=False)


def unknown_fields(body: Any, known: frozenset[str], spell: Callable[[str], str] = str) -> list[str]:
    """The keys of a request body (spelled by `spell`) that are not in `known`, in body order."""
    if not isinstance(body, dict):
        return []
    return [k for k in body if spell(k) not in known]


def each[T, R](items: Iterable[T], parse: Callable[[int, T], R], *, lenient: bool) -> list[R]:
    """parse(i, item) of every item; with `lenient`, an item that raises ProviderError is left
    out (an upstream's reply is not ours to refuse), without it the error is the caller's."""
    out: list[R] = []
    for i, item in enumerate(items):
        try:
            out.append(parse(i, item))
        except ProviderError:
            if not lenient:
                raise
    return out


def first_of(reply: Any, key: str, *, lenient: bool) -> dict[str, Any]:
    """reply[key][0] (a reply's first choice or candidate) as an object; {} where a lenient
    reader finds none, a 400-style ProviderError where a strict one does."""
    if not isinstance(reply, dict):
        raise ProviderError("invalid_request", "reply must be a JSON object", 400)
    items = reply.get(key)
    if isinstance(items, list) and items and isinstance(items[0], dict):
        return items[0]
    if lenient:
        return {}
    raise ProviderError("invalid_request", f"{key}: a reply has at least one (an object)", 400)
