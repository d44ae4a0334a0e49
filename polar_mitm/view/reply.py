"""A turn's reply as the harness received it, re-rendered from what the store keeps.

The store keeps a turn's completion (neutral JSON) and the native request, not the bytes sent
back. The style that answered renders the same completion again for the same request: its SSE
stream when the request asked for one, else its JSON reply, exactly as the gateway does (ids and
timestamps the style makes up are new). Harvested turns kept the real reply as it came: shown
as it is.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from polar_mitm.neutral import Completion, Done, Event, ReasoningDelta, Started, TextDelta, ToolCallEvent
from polar_mitm.providers import STYLES


async def native_reply(style: str, path: str | None, request: str | None, response: str | None, *,
                       prompt_tokens: int) -> tuple[str, str]:  # fmt: skip
    """(what it is, its text): the reply in its style's wire shape. ValueError says why not."""
    if response is None:
        raise ValueError("no reply was stored for this turn")
    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}")
    try:
        completion = Completion.model_validate_json(response)
    except ValueError:
        return "the reply as recorded (harvested from the real provider)", response
    if request is None:
        raise ValueError("the request was not stored, so its shape (stream or not) is unknown")
    api = STYLES[style]
    req = api.parse_request(json.loads(request), path=path or "", require_max_tokens=False)
    if not req.stream:
        return f"{style} JSON reply", json.dumps(
            api.render_response(completion, req), indent=2, ensure_ascii=False
        )

    async def events() -> AsyncIterator[Event]:
        yield Started(turn_id=completion.turn_id, prompt_tokens=prompt_tokens)
        if completion.reasoning:
            yield ReasoningDelta(text=completion.reasoning)
        if completion.text:
            yield TextDelta(text=completion.text)
        for call in completion.tool_calls:
            yield ToolCallEvent(call=call)
        yield Done(completion=completion)

    chunks = [chunk async for chunk in api.render_stream(events(), req)]
    return f"{style} SSE stream", b"".join(chunks).decode("utf-8", errors="replace")
