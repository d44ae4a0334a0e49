"""Anthropic Messages: parsing Claude Code-shaped requests, rendering JSON and SSE."""

import json

import pytest

from polar_mitm.neutral import (
    Completion,
    Done,
    Ping,
    ProviderError,
    ReasoningDelta,
    Started,
    TextDelta,
    ToolCall,
    ToolCallEvent,
    Usage,
)
from polar_mitm.providers import anthropic
from tests.support.helpers import sse_events, stream_bytes

CC_BODY = {
    "model": "claude-sonnet-4-5-20250929",
    "max_tokens": 32000,
    "stream": True,
    "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=abc123;"},
        {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
    ],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Create out.txt containing hi"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "plan", "signature": "sig"},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "Bash",
                    "input": {"command": "echo hi > out.txt"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": "ok",
                    "cache_control": {"type": "ephemeral"},
                },
                {"type": "text", "text": "<system-reminder>x</system-reminder>"},
            ],
        },
        {"role": "system", "content": "a system note inside messages"},
    ],
    "tools": [{"name": "Bash", "description": "run", "input_schema": {"type": "object", "properties": {}}}],
    "tool_choice": {"type": "auto"},
    "temperature": 1,
    "stop_sequences": ["STOP"],
    "thinking": {"type": "enabled", "budget_tokens": 1024},
}


def test_claude_code_request_parses_to_neutral_messages():
    req = anthropic.parse_request(CC_BODY)
    roles = [m.role for m in req.messages]
    assert roles == ["system", "user", "assistant", "tool", "user", "system"]
    assert req.messages[0].content == "You are Claude Code."  # billing line dropped
    assert req.messages[2].reasoning == "plan"
    assert req.messages[2].tool_calls[0].arguments == {"command": "echo hi > out.txt"}
    assert req.messages[3].tool_call_id == "toolu_1" and req.messages[3].content == "ok"
    assert req.tools[0].name == "Bash"
    assert req.tool_choice == "auto"
    assert req.sampling.max_tokens == 32000 and req.sampling.stop == ["STOP"]
    assert req.thinking is True and req.stream is True


def test_volatile_noise_does_not_change_the_parse():
    a = json.loads(json.dumps(CC_BODY))
    b = json.loads(json.dumps(CC_BODY))
    b["system"][0]["text"] = "x-anthropic-billing-header: cc_version=2.1; cch=zzz999;"
    b["system"][1].pop("cache_control")
    b["messages"][0]["content"][0]["cache_control"] = {"type": "ephemeral"}
    assert anthropic.parse_request(a) == anthropic.parse_request(b)


@pytest.mark.parametrize(
    "body, fragment",
    [
        ([], "JSON object"),
        ({"max_tokens": 5}, "messages"),
        ({"messages": []}, "max_tokens"),
        ({"max_tokens": 5, "messages": [{"role": "bot", "content": "x"}]}, "messages.0.role"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ],
)
def test_malformed_requests_are_invalid_request_errors(body, fragment):
    with pytest.raises(ProviderError) as e:
        anthropic.parse_request(body)
    status, err = anthropic.render_error(e.value)
    assert status == 400 and err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert fragment in err["error"]["message"]


def test_backend_down_is_a_retryable_overloaded_error():
    status, err = anthropic.render_error(ProviderError("overloaded", "down", 529))
    assert status == 529 and err["error"]["type"] == "overloaded_error"


def completion(**kw):
    base = dict(turn_id="turn_1", model="m", usage=Usage(prompt_tokens=10, completion_tokens=3))
    base.update(kw)
    return Completion(**base)


def test_json_response_with_thinking_text_and_tool_use():
    c = completion(
        reasoning="r",
        text="hi",
        tool_calls=[ToolCall(id="toolu_x", name="Bash", arguments={"a": 1})],
        finish_reason="tool_calls",
    )
    out = anthropic.render_response(c)
    assert [b["type"] for b in out["content"]] == ["thinking", "text", "tool_use"]
    assert out["content"][0]["signature"] == anthropic.signature_for("r")
    assert out["stop_reason"] == "tool_use" and out["usage"]["output_tokens"] == 3


async def collect(events, req):
    return sse_events(await stream_bytes(anthropic, events, req))


async def test_sse_event_sequence():
    req = anthropic.parse_request(CC_BODY)
    call = ToolCall(id="toolu_9", name="Bash", arguments={"command": "ls"})
    c = completion(reasoning="th", text="ok", tool_calls=[call], finish_reason="tool_calls")
    evs = await collect(
        [
            Started(turn_id="turn_1", prompt_tokens=10),
            Ping(),
            ReasoningDelta(text="th"),
            TextDelta(text="o"),
            TextDelta(text="k"),
            ToolCallEvent(call=call),
            Done(completion=c),
        ],
        req,
    )
    names = [e for e, _ in evs]
    assert names == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert evs[0][1]["message"]["usage"]["input_tokens"] == 10
    assert evs[4][1]["delta"]["type"] == "signature_delta"
    assert evs[11][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"command": "ls"}'}
    assert evs[-2][1]["delta"]["stop_reason"] == "tool_use"


async def test_stream_without_done_never_sends_message_stop():
    req = anthropic.parse_request(CC_BODY)
    evs = await collect([Started(turn_id="t", prompt_tokens=1), TextDelta(text="partial")], req)
    assert "message_stop" not in [e for e, _ in evs]
