"""Helpers shared by the tests: request constants and reading what a stream renderer sends."""

from __future__ import annotations

import json
from collections.abc import Iterable
from types import ModuleType

from polar_mitm.neutral import ChatRequest, Event, ProviderError

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


def sse_events(raw: str) -> list[tuple[str | None, dict]]:
    """(event name, data) of each SSE event that carries data; comments and pings without data skipped."""
    out = []
    for block in raw.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in fields:
            out.append((fields.get("event"), json.loads(fields["data"])))
    return out


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
