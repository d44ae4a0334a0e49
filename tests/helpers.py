"""Helpers shared by the tests: request constants and reading what a stream renderer sends."""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

from polar_mitm import sse
from polar_mitm.neutral import ChatRequest, Completion, Event, ProviderError, ToolCall, Usage

MESSAGES_URL = "https://api.anthropic.com/v1/messages"

# Claude Code's shell tool, as an Anthropic `tools` entry.
BASH = {
    "name": "Bash",
    "description": "Run a shell command",
    "input_schema": {
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "required": ["command"],
    },
}

# A reply with reasoning, text and a tool call, as the policy produces one.
COMPLETION = Completion(
    turn_id="turn_0001abcd",
    model="claude-test",
    text="I'll list the files.",
    reasoning="The user wants a listing.",
    tool_calls=[ToolCall(id="toolu_01", name="Bash", arguments={"command": "ls -la"})],
    finish_reason="tool_calls",
    usage=Usage(prompt_tokens=12, completion_tokens=9),
)


def sse_events(raw: str | bytes) -> list[tuple[str | None, dict]]:
    """(event name, data) of each SSE event whose data is a JSON object, read by the reader harvest
    mode uses (comments, keep-alives and `[DONE]` left out)."""
    return sse.json_events(raw)


async def stream_bytes(
    module: ModuleType, events: Iterable[Event], req: ChatRequest, raise_at_end: ProviderError | None = None
) -> bytes:
    """Everything a style's `render_stream` writes for these policy events (then the error, if any)."""

    async def gen():
        for e in events:
            yield e
        if raise_at_end is not None:
            raise raise_at_end

    return b"".join([chunk async for chunk in module.render_stream(gen(), req)])
