"""OpenAI Responses: parsing Codex-shaped requests, rendering JSON and the full SSE sequence,
and the same turn path in-process through the proxy (tool call, echo, splice)."""

import json
import sqlite3

import pytest

from polar_mitm.backends.render import conversation_hashes
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
from polar_mitm.providers import openai_responses as responses
from polar_mitm.store.reader import read_turns
from tests.support.helpers import sse_events, stream_bytes

EXEC_COMMAND = {
    "type": "function",
    "name": "exec_command",
    "description": "Runs a command in a PTY",
    "strict": False,
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
}
APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files",
    "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
}

CODEX_BODY = {
    "model": "gpt-5.5",
    "instructions": "You are Codex.",
    "stream": True,
    "store": False,
    "include": ["reasoning.encrypted_content"],
    "reasoning": {"effort": "medium", "summary": "auto"},
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "max_output_tokens": 2048,
    "temperature": 0.7,
    "top_p": 0.9,
    "tools": [EXEC_COMMAND, APPLY_PATCH, {"type": "web_search"}, {"type": "local_shell"}],
    "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be careful."}]},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Create out.txt containing hi"}],
        },
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [{"type": "summary_text", "text": "I should write the file."}],
            "encrypted_content": responses.reasoning_token("I should write the file."),
        },
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_1",
            "name": "exec_command",
            "arguments": '{"cmd": "echo hi > out.txt"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "ok"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]},
        {"type": "message", "role": "user", "content": "and now?"},
    ],
}


def test_codex_request_parses_to_neutral_messages():
    req = responses.parse_request(CODEX_BODY)
    assert [m.role for m in req.messages] == [
        "system",
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
    ]
    assert req.messages[0].content == "You are Codex." and req.messages[1].content == "Be careful."
    call_turn = req.messages[3]
    assert call_turn.reasoning == "I should write the file." and call_turn.content == ""
    assert call_turn.tool_calls == [
        ToolCall(id="call_1", name="exec_command", arguments={"cmd": "echo hi > out.txt"})
    ]
    assert req.messages[4].tool_call_id == "call_1" and req.messages[4].content == "ok"
    assert req.messages[5].content == "Done." and req.messages[6].content == "and now?"
    # Hosted tools (web_search) are not offered to a local policy; freeform tools take one string.
    assert [t.name for t in req.tools] == ["exec_command", "apply_patch", "local_shell"]
    assert req.tools[1].parameters["required"] == ["input"]
    assert req.tool_kinds == {"apply_patch": "custom", "local_shell": "local_shell"}
    assert req.tool_choice == "auto" and req.stream is True and req.thinking is True
    assert (req.sampling.max_tokens, req.sampling.temperature, req.sampling.top_p) == (2048, 0.7, 0.9)


def test_responses_lite_tools_inside_an_additional_tools_item_with_namespaces():
    body = {
        "model": "gpt-6.2-sol",
        "input": [
            {
                "type": "additional_tools",
                "role": "developer",
                "tools": [
                    {"type": "namespace", "name": "functions", "tools": [APPLY_PATCH, EXEC_COMMAND]},
                    {"type": "namespace", "name": "clock", "tools": [{"type": "function", "name": "sleep"}]},
                ],
            },
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        ],
    }
    req = responses.parse_request(body)
    assert [t.name for t in req.tools] == ["apply_patch", "exec_command", "sleep"]
    assert req.tool_kinds == {"apply_patch": "custom"}
    assert [m.role for m in req.messages] == ["user"]


def test_codex_code_mode_exec_is_what_the_fake_backend_drives():
    """Codex's default models offer only the freeform `exec` (JavaScript) tool; as parsed here it
    is the shell the fake backend's default script calls, with a script that runs the command."""
    from polar_mitm.fake import find_shell_tool, shell_arguments

    exec_tool = {
        "type": "custom",
        "name": "exec",
        "description": "Run JavaScript",
        "format": {"type": "text"},
    }
    body = {
        "input": [
            {
                "type": "additional_tools",
                "tools": [{"type": "namespace", "name": "functions", "tools": [exec_tool, APPLY_PATCH]}],
            }
        ]
    }
    tools = [t.model_dump() for t in responses.parse_request(body).tools]
    shell = find_shell_tool(tools)
    assert shell is not None and shell["name"] == "exec"
    script = shell_arguments(shell, "echo 'hi' > out.txt")["input"]
    assert script.startswith("const r = await tools.exec_command({cmd: \"echo 'hi' > out.txt\"});")


def test_string_input_and_structured_output_request():
    req = responses.parse_request(
        {
            "model": "m",
            "input": "hello",
            "text": {
                "format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}
            },
            "tool_choice": {"type": "function", "name": "exec_command"},
            "reasoning": {"effort": "none"},
        }
    )
    assert [(m.role, m.content) for m in req.messages] == [("user", "hello")]
    assert req.sampling.json_schema == {"type": "object"}
    assert req.tool_choice == {"name": "exec_command"} and req.thinking is False and req.stream is False


def test_custom_and_local_shell_calls_are_echoed_as_tool_calls():
    req = responses.parse_request(
        {
            "input": [
                {"type": "message", "role": "user", "content": "go"},
                {
                    "type": "custom_tool_call",
                    "call_id": "c1",
                    "name": "apply_patch",
                    "input": "*** Begin Patch",
                },
                {"type": "custom_tool_call_output", "call_id": "c1", "output": "applied"},
                {
                    "type": "local_shell_call",
                    "call_id": "c2",
                    "status": "completed",
                    "action": {"type": "exec", "command": ["ls"], "working_directory": "/w"},
                },
                {
                    "type": "function_call_output",
                    "call_id": "c2",
                    "output": [{"type": "input_text", "text": "a.txt"}],
                },
            ]
        }
    )
    assert [m.role for m in req.messages] == ["user", "assistant", "tool", "assistant", "tool"]
    assert req.messages[1].tool_calls[0].arguments == {"input": "*** Begin Patch"}
    assert req.messages[3].tool_calls[0].name == "local_shell"
    assert req.messages[3].tool_calls[0].arguments == {"command": ["ls"], "workdir": "/w"}
    assert req.messages[4].content == "a.txt"


def test_foreign_reasoning_falls_back_to_its_summary_and_bad_tokens_are_not_decoded():
    assert responses.reasoning_from_token(responses.reasoning_token("é thoughts")) == "é thoughts"
    assert responses.reasoning_from_token("gAAAAB-openai-encrypted") is None
    assert responses.reasoning_from_token("polar-r1:!!!not base64") is None
    req = responses.parse_request(
        {
            "input": [
                {"type": "message", "role": "user", "content": "q"},
                {
                    "type": "reasoning",
                    "summary": [{"type": "summary_text", "text": "hmm"}],
                    "encrypted_content": "gAAAAB-openai-encrypted",
                },
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
            ]
        }
    )
    assert (req.messages[1].reasoning, req.messages[1].content) == ("hmm", "a")


@pytest.mark.parametrize(
    "body, fragment",
    [
        ([], "JSON object"),
        ({"model": "m"}, "input: field required"),
        ({"input": 5}, "input: must be"),
        ({"input": [5]}, "input.0"),
        ({"input": [{"type": "message", "role": "bot", "content": "x"}]}, "input.0.role"),
        ({"input": [{"type": "message", "role": "user", "content": 5}]}, "input.0.content"),
        ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input.0.name"),
        ({"input": "x", "max_output_tokens": "many"}, "max_output_tokens"),
        ({"input": "x", "tools": [{"type": "function"}]}, "tools.0.name"),
        # Parsed alone (not through the proxy, which holds the responses it gave): not found.
        ({"input": "x", "previous_response_id": "resp_1"}, "only the polar-mitm proxy that gave"),
        ({"input": "x", "conversation": {"id": "conv_1"}}, "conversation is not supported"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference"),
    ],
)
def test_malformed_or_stateful_requests_are_openai_shaped_400s(body, fragment):
    with pytest.raises(ProviderError) as e:
        responses.parse_request(body)
    status, err = responses.render_error(e.value)
    assert status in (400, 404) and err["error"]["type"] == "invalid_request_error"
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert fragment in err["error"]["message"]


def test_error_shapes():
    status, err = responses.render_error(ProviderError("overloaded", "backend down", 503))
    assert status == 503 and err["error"]["type"] == "server_error"
    assert err["error"]["code"] != "server_is_overloaded"  # Codex gives up on that code instead of retrying
    _, err = responses.render_error(ProviderError("invalid_request", "prompt is too long: 9 tokens > 8", 400))
    assert err["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    "method, path, expected",
    [
        ("POST", "/v1/responses", "generate"),
        ("POST", "/v1/responses?x=1", "generate"),
        ("POST", "/backend-api/codex/responses", "generate"),
        ("POST", "/v1/responses/input_tokens", "count_tokens"),
        ("GET", "/v1/responses", None),  # Codex's WebSocket attempt: left to the stubs (426)
        ("POST", "/v1/chat/completions", None),  # the Chat Completions module's
        ("POST", "/v1/responses/compact", None),
        ("GET", "/v1/models", None),
    ],
)
def test_endpoint(method, path, expected):
    assert responses.endpoint(method, path) == expected


def completion(**kw):
    base = dict(
        turn_id="turn_abc", model="m", usage=Usage(prompt_tokens=10, completion_tokens=3, cached_tokens=4)
    )
    base.update(kw)
    return Completion(**base)


def test_json_response_items_and_usage():
    c = completion(
        reasoning="r",
        text="hi",
        tool_calls=[ToolCall(id="call_x", name="exec_command", arguments={"cmd": "ls"})],
        finish_reason="tool_calls",
    )
    out = responses.render_response(c)
    assert out["object"] == "response" and out["status"] == "completed" and out["id"] == "resp_abc"
    assert [i["type"] for i in out["output"]] == ["reasoning", "message", "function_call"]
    assert out["output"][0]["encrypted_content"] == responses.reasoning_token("r")
    assert out["output"][1]["content"][0] == {
        "type": "output_text",
        "text": "hi",
        "annotations": [],
        "logprobs": [],
    }
    fc = out["output"][2]
    assert (fc["call_id"], fc["name"], json.loads(fc["arguments"])) == (
        "call_x",
        "exec_command",
        {"cmd": "ls"},
    )
    assert out["usage"] == {
        "input_tokens": 10,
        "input_tokens_details": {"cached_tokens": 4},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 13,
    }
    cut = responses.render_response(completion(text="par", finish_reason="length"))
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}


def test_rendered_reply_echoed_back_hashes_like_the_turn_that_sampled_it():
    """The splice matches an echoed reply by hash: our output items, sent back as input, must
    parse to exactly the assistant message the policy produced."""
    req = responses.parse_request(CODEX_BODY)
    c = completion(
        reasoning="think",
        text="Let me do it.",
        tool_calls=[
            ToolCall(id="call_a", name="exec_command", arguments={"cmd": "ls"}),
            ToolCall(id="call_b", name="apply_patch", arguments={"input": "*** Begin Patch\n"}),
        ],
        finish_reason="tool_calls",
    )
    out = responses.render_response(c, req)
    assert [i["type"] for i in out["output"]] == ["reasoning", "message", "function_call", "custom_tool_call"]
    assert out["output"][3]["input"] == "*** Begin Patch\n"
    echoed = dict(CODEX_BODY)
    # Codex echoes the items as they came (minus the summary when it hides reasoning), then outputs.
    items = [dict(i) for i in out["output"]]
    items[0]["summary"] = []
    echoed["input"] = (
        CODEX_BODY["input"]
        + items
        + [
            {"type": "function_call_output", "call_id": "call_a", "output": "a"},
            {"type": "custom_tool_call_output", "call_id": "call_b", "output": "b"},
        ]
    )
    again = responses.parse_request(echoed)
    n = len(req.messages)
    assert again.messages[:n] == req.messages
    assert again.messages[n] == c.as_message()
    post = conversation_hashes(req.messages + [c.as_message()], req.tools)[-1]
    assert conversation_hashes(again.messages, again.tools)[n + 1] == post


async def collect(events, req, raise_at_end: ProviderError | None = None):
    return await stream_bytes(responses, events, req, raise_at_end)


async def test_sse_event_sequence():
    req = responses.parse_request(CODEX_BODY)
    call = ToolCall(id="call_9", name="exec_command", arguments={"cmd": "ls"})
    c = completion(reasoning="th", text="ok", tool_calls=[call], finish_reason="tool_calls")
    raw = await collect(
        [
            Started(turn_id="turn_abc", prompt_tokens=10),
            Ping(),
            ReasoningDelta(text="t"),
            ReasoningDelta(text="h"),
            TextDelta(text="o"),
            TextDelta(text="k"),
            ToolCallEvent(call=call),
            Done(completion=c),
        ],
        req,
    )
    assert b": keep-alive\n\n" in raw  # the Ping, as an SSE comment
    evs = sse_events(raw)
    names = [e for e, _ in evs]
    assert names == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert all(d["type"] == e for e, d in evs)
    assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
    assert evs[0][1]["response"]["status"] == "in_progress" and evs[0][1]["response"]["id"] == "resp_abc"
    assert evs[13][1]["text"] == "ok" and evs[6][1]["text"] == "th"
    assert [d["output_index"] for e, d in evs if e == "response.output_item.done"] == [0, 1, 2]
    assert evs[18][1]["arguments"] == '{"cmd": "ls"}'
    final = evs[-1][1]["response"]
    assert final["status"] == "completed" and final["usage"]["input_tokens"] == 10
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"] == [d["item"] for e, d in evs if e == "response.output_item.done"]
    assert final["output"][0]["encrypted_content"] == responses.reasoning_token("th")


async def test_stream_renders_freeform_tool_calls_as_custom_tool_calls():
    req = responses.parse_request(CODEX_BODY)
    call = ToolCall(id="call_p", name="apply_patch", arguments={"input": "*** Begin Patch"})
    c = completion(tool_calls=[call], finish_reason="tool_calls")
    evs = sse_events(
        await collect(
            [Started(turn_id="turn_abc", prompt_tokens=1), ToolCallEvent(call=call), Done(completion=c)], req
        )
    )
    assert [e for e, _ in evs][2:] == [
        "response.output_item.added",
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
        "response.output_item.done",
        "response.completed",
    ]
    item = evs[-2][1]["item"]
    assert (item["type"], item["name"], item["input"], item["call_id"]) == (
        "custom_tool_call",
        "apply_patch",
        "*** Begin Patch",
        "call_p",
    )


async def test_stream_cut_by_the_token_limit_ends_incomplete():
    req = responses.parse_request({"input": "x", "stream": True})
    c = completion(text="par", finish_reason="length")
    evs = sse_events(
        await collect(
            [Started(turn_id="turn_abc", prompt_tokens=1), TextDelta(text="par"), Done(completion=c)], req
        )
    )
    assert evs[-1][0] == "response.incomplete"
    assert evs[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


async def test_error_mid_stream_ends_with_failed_events_and_never_completes():
    req = responses.parse_request({"input": "x", "stream": True})
    evs = sse_events(
        await collect(
            [Started(turn_id="turn_abc", prompt_tokens=1), TextDelta(text="pa")],
            req,
            raise_at_end=ProviderError("overloaded", "backend went away", 503),
        )
    )
    names = [e for e, _ in evs]
    assert names[-2:] == ["error", "response.failed"] and "response.completed" not in names
    assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
    failed = evs[-1][1]["response"]
    assert failed["status"] == "failed" and failed["error"]["message"] == "backend went away"
    lone = sse_events(responses.render_stream_error(ProviderError("api_error", "boom", 500)))
    assert [e for e, _ in lone] == ["error", "response.failed"]


def test_count_and_models():
    assert responses.render_count(7) == {"object": "response.input_tokens", "input_tokens": 7}
    assert responses.render_models(["p"])["data"][0]["id"] == "p"


# ---- in-process: a real HTTPS client through the proxy ------------------------------------------

URL = "https://api.openai.com/v1/responses"


def codex_like(input_items, **kw):
    out = {
        "model": "gpt-5.5",
        "instructions": "You are a test agent.",
        "input": input_items,
        "tools": [EXEC_COMMAND],
        "store": False,
        "stream": True,
    }
    out.update(kw)
    return out


async def test_tool_call_then_echo_is_spliced_through_the_proxy(make_stack):
    stack = await make_stack()
    first = [
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Create out.txt containing hi"}],
        }
    ]
    async with stack.client() as c:
        r1 = await c.post(URL, json=codex_like(first), headers={"authorization": "Bearer sk-test"})
        assert r1.status_code == 200 and r1.headers["content-type"].startswith("text/event-stream")
        evs1 = sse_events(r1.content)
        assert evs1[-1][0] == "response.completed"
        output = evs1[-1][1]["response"]["output"]
        [call] = [i for i in output if i["type"] == "function_call"]
        assert call["name"] == "exec_command" and "out.txt" in json.loads(call["arguments"])["cmd"]
        second = first + output + [{"type": "function_call_output", "call_id": call["call_id"], "output": ""}]
        r2 = await c.post(URL, json=codex_like(second, stream=False))
    assert r2.status_code == 200
    msg = [i for i in r2.json()["output"] if i["type"] == "message"]
    assert msg[0]["content"][0]["text"] == "Done. The command finished."
    t1, t2 = list(read_turns(stack.db))
    assert t1.finish_reason == "tool_calls" and t1.style == "openai-responses"
    assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.output_ids)] == t1.prompt_ids + t1.output_ids
    assert t2.prompt_ref == t1.id


async def test_non_streamed_reply_calls_a_freeform_tool_as_a_custom_tool_call(make_stack):
    """The gateway renders a JSON reply with its request, as it renders a stream: a call of a
    `custom` tool is a custom_tool_call item with its raw input, never a function_call."""
    stack = await make_stack()
    exec_tool = {
        "type": "custom",
        "name": "exec",
        "description": "Run JavaScript",
        "format": {"type": "text"},
    }
    body = codex_like(
        [{"type": "message", "role": "user", "content": "Create out.txt containing hi"}],
        tools=[exec_tool],
        stream=False,
    )
    async with stack.client() as c:
        r = await c.post(URL, json=body)
    assert r.status_code == 200, r.text
    [call] = [i for i in r.json()["output"] if i["type"] != "reasoning"]
    assert call["type"] == "custom_tool_call" and call["name"] == "exec"
    assert "out.txt" in call["input"] and "arguments" not in call


async def test_websocket_attempt_gets_426_and_errors_are_openai_shaped(make_stack):
    stack = await make_stack()
    async with stack.client() as c:
        ws = await c.get(
            URL,
            headers={
                "upgrade": "websocket",
                "connection": "Upgrade",
                "sec-websocket-version": "13",
                "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ==",
            },
        )
        assert ws.status_code == 426
        bad = await c.post(URL, json={"model": "m", "input": "x", "previous_response_id": "resp_1"})
        assert bad.status_code == 404 and bad.json()["error"]["code"] == "previous_response_not_found"
    assert sqlite3.connect(stack.db).execute("SELECT COUNT(*) FROM turns").fetchone() == (0,)


async def test_backend_down_is_a_retryable_server_error(make_stack):
    stack = await make_stack(backend_up=False)
    async with stack.client() as c:
        r = await c.post(URL, json=codex_like([{"type": "message", "role": "user", "content": "hi"}]))
    assert r.status_code >= 500 and r.json()["error"]["type"] == "server_error"


COMPACT_BODY = {
    "model": "gpt-6.2-sol",
    "stream": True,
    "input": [
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Create out.txt containing hi"}],
        },
        {"type": "function_call", "call_id": "call_1", "name": "exec_command", "arguments": '{"cmd": "ls"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"},
        {"type": "compaction_trigger"},
    ],
}


async def test_compaction_trigger_gets_exactly_one_compaction_item_that_round_trips():
    req = responses.parse_request(COMPACT_BODY)
    assert req.compaction and req.messages[-1].content == responses.COMPACTION_PROMPT
    c = completion(text="Wrote nothing yet; ls showed a.txt.", tool_calls=[])
    out = responses.render_response(c, req)["output"]
    assert [i["type"] for i in out] == ["compaction"]
    raw = await collect(
        [Started(turn_id="turn_c", prompt_tokens=5), TextDelta(text="Wrote"), Done(completion=c)], req
    )
    evs = sse_events(raw)
    assert "response.output_text.delta" not in [e for e, _ in evs]  # the summary goes out whole
    [final] = [d for e, d in evs if e == "response.completed"]
    [item] = final["response"]["output"]
    assert item["type"] == "compaction" and item["encrypted_content"] == out[0]["encrypted_content"]
    # The next request carries the item instead of the history; it reads back as the summary.
    later = responses.parse_request(
        {
            "model": "m",
            "input": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Create out.txt"}],
                },
                item,
            ],
        }
    )
    assert not later.compaction
    assert later.messages[-1].role == "user"
    assert later.messages[-1].content == responses.COMPACTION_HEADER + "Wrote nothing yet; ls showed a.txt."


def test_a_foreign_compaction_item_is_an_explicit_gap():
    req = responses.parse_request(
        {"model": "m", "input": [{"type": "compaction", "encrypted_content": "gAAAA-opaque"}]}
    )
    assert req.messages[-1].content == "[earlier conversation compacted]"
