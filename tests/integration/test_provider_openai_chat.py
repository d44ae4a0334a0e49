"""OpenAI Chat Completions: parsing Qwen Code-shaped requests, rendering JSON and SSE, and the
whole path through the proxy for DashScope's and OpenAI's hosts."""

import json
import sqlite3

import httpx
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
from polar_mitm.providers import openai_chat, route
from polar_mitm.store.reader import read_turns
from tests.support.helpers import stream_bytes

SHELL = {
    "type": "function",
    "function": {
        "name": "run_shell_command",
        "description": "Run a shell command",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}

# What Qwen Code 0.15 sends for its second turn (trimmed): text parts with cache_control on the
# system prompt and on the last message, an assistant tool call with JSON-string arguments.
QWEN_BODY = {
    "model": "gpt-4o",
    "stream": True,
    "stream_options": {"include_usage": True},
    "max_tokens": 8000,
    "metadata": {"sessionId": "s", "promptId": "p"},
    "messages": [
        {
            "role": "system",
            "content": [
                {"type": "text", "text": "You are Qwen Code.", "cache_control": {"type": "ephemeral"}}
            ],
        },
        {"role": "user", "content": [{"type": "text", "text": "This is the Qwen Code. Context."}]},
        {"role": "assistant", "content": "Got it. Thanks for the context!"},
        {"role": "user", "content": [{"type": "text", "text": "Create out.txt containing hi"}]},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "use the shell",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "run_shell_command", "arguments": '{"command":"echo hi > out.txt"}'},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": [{"type": "text", "text": "Exit Code: 0", "cache_control": {"type": "ephemeral"}}],
        },
    ],
    "tools": [SHELL],
    "tool_choice": "auto",
    "temperature": 0.7,
    "top_p": 0.8,
    "stop": "STOP",
}


def copy(body):
    return json.loads(json.dumps(body))


# ---- routing -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method, path, expected",
    [
        ("POST", "/v1/chat/completions", "generate"),
        ("POST", "/compatible-mode/v1/chat/completions", "generate"),
        ("POST", "/v1/chat/completions?foo=1", "generate"),
        ("POST", "/chat/completions/", "generate"),
        ("GET", "/v1/models", "models"),
        ("GET", "/compatible-mode/v1/models", "models"),
        ("POST", "/v1/responses", None),  # OpenAI Responses: another style's
        ("GET", "/v1/chat/completions", None),  # stored completions listing: not a generation
        ("POST", "/v1/embeddings", None),
    ],
)
def test_endpoint_claims_only_chat_completions_paths(method, path, expected):
    assert openai_chat.endpoint(method, path) == expected


def test_qwen_code_default_host_is_served_by_this_style():
    found = route("dashscope.aliyuncs.com", "POST", "/compatible-mode/v1/chat/completions")
    assert found is not None and found[0] is openai_chat and found[1] == "generate"


# ---- request -----------------------------------------------------------------------------------


def test_qwen_code_request_parses_to_neutral_messages():
    req = openai_chat.parse_request(QWEN_BODY)
    assert [m.role for m in req.messages] == ["system", "user", "assistant", "user", "assistant", "tool"]
    assert req.messages[0].content == "You are Qwen Code."
    call = req.messages[4].tool_calls[0]
    assert (call.id, call.name, call.arguments) == (
        "call_1",
        "run_shell_command",
        {"command": "echo hi > out.txt"},
    )
    assert req.messages[4].content == "" and req.messages[4].reasoning == "use the shell"
    assert req.messages[5].tool_call_id == "call_1" and req.messages[5].content == "Exit Code: 0"
    assert [t.name for t in req.tools] == ["run_shell_command"]
    assert req.tools[0].parameters["required"] == ["command"]
    assert req.tool_choice == "auto"
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.stop) == (8000, 0.7, 0.8, ["STOP"])
    assert req.stream is True and req.include_usage is True
    assert req.model == "gpt-4o" and req.style == "openai-chat"


def test_moving_cache_control_markers_do_not_change_the_parse():
    a, b = copy(QWEN_BODY), copy(QWEN_BODY)
    del b["messages"][0]["content"][0]["cache_control"]
    del b["messages"][5]["content"][0]["cache_control"]
    b["messages"][3]["content"][0]["cache_control"] = {"type": "ephemeral"}
    b["messages"][0]["content"] = "You are Qwen Code."  # the same text as a plain string
    assert openai_chat.parse_request(a).messages == openai_chat.parse_request(b).messages


def test_option_variants():
    body = {
        "model": "m",
        "messages": [
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}],
            },
        ],
        "max_tokens": 10,
        "max_completion_tokens": 20,
        "stop": ["x", "y"],
        "tool_choice": {"type": "function", "function": {"name": "run_shell_command"}},
        "tools": [SHELL],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "r", "strict": True, "schema": {"type": "object", "required": ["a"]}},
        },
        "chat_template_kwargs": {"enable_thinking": False},
    }
    req = openai_chat.parse_request(body)
    assert req.messages[0].role == "system" and req.messages[1].content == "a[image]"
    assert req.sampling.max_tokens == 20  # max_completion_tokens wins
    assert req.sampling.stop == ["x", "y"]
    assert req.tool_choice == {"name": "run_shell_command"}
    assert req.sampling.json_schema == {"type": "object", "required": ["a"]}
    assert req.thinking is False and req.stream is False and req.include_usage is False
    body["response_format"] = {"type": "json_object"}
    body["enable_thinking"] = True
    req = openai_chat.parse_request(body)
    assert req.sampling.json_schema == {"type": "object"} and req.thinking is True
    body["response_format"] = {"type": "text"}
    assert openai_chat.parse_request(body).sampling.json_schema is None


def test_arguments_that_are_not_a_json_object_are_kept_verbatim():
    body = copy(QWEN_BODY)
    body["messages"][4]["tool_calls"][0]["function"]["arguments"] = '{"command": "ls"'
    call = openai_chat.parse_request(body).messages[4].tool_calls[0]
    assert call.raw == '{"command": "ls"' and call.arguments_json() == '{"command": "ls"'


@pytest.mark.parametrize(
    "body, fragment, param",
    [
        ([], "JSON object", None),
        ({"model": "m"}, "messages", "messages"),
        ({"messages": []}, "messages", "messages"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "messages.0.role", "messages.0.role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "messages.0.content"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n:", "n"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": 3}, "stop", "stop"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens", "max_tokens"),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web"}]},
            "tools.0.type",
            "tools.0",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]},
            "function.name",
            "messages.0.tool_calls.0.function.name",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
            "response_format",
            "response_format",
        ),
    ],
)
def test_malformed_requests_are_invalid_request_errors(body, fragment, param):
    with pytest.raises(ProviderError) as e:
        openai_chat.parse_request(body)
    status, err = openai_chat.render_error(e.value)
    assert status == 400 and set(err) == {"error"}
    assert err["error"]["type"] == "invalid_request_error" and err["error"]["param"] == param
    assert fragment in err["error"]["message"]


@pytest.mark.parametrize(
    "kind, status, expected_status, expected_type",
    [
        ("overloaded", 529, 503, "server_error"),  # the node SDK retries 5xx; 503 is what it expects
        ("api_error", 500, 500, "server_error"),
        ("api_error", 502, 502, "server_error"),
        ("authentication", 401, 401, "authentication_error"),
        ("not_found", 404, 404, "invalid_request_error"),
        ("rate_limit", 429, 429, "rate_limit_error"),
    ],
)
def test_errors_have_openai_shape_and_retryable_statuses(kind, status, expected_status, expected_type):
    code, body = openai_chat.render_error(ProviderError(kind, "boom", status))
    assert code == expected_status
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert (body["error"]["message"], body["error"]["type"]) == ("boom", expected_type)


# ---- response ----------------------------------------------------------------------------------


def completion(**kw):
    base = dict(
        turn_id="turn_abc",
        model="gpt-4o",
        usage=Usage(prompt_tokens=10, completion_tokens=3, cached_tokens=4),
    )
    base.update(kw)
    return Completion(**base)


CALL = ToolCall(id="call_9", name="run_shell_command", arguments={"command": "ls"})


def test_json_response_with_only_a_tool_call():
    out = openai_chat.render_response(completion(tool_calls=[CALL], finish_reason="tool_calls"))
    assert out["object"] == "chat.completion" and out["id"] == "chatcmpl-abc"
    [choice] = out["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None and "reasoning_content" not in choice["message"]
    assert choice["message"]["tool_calls"] == [
        {
            "id": "call_9",
            "type": "function",
            "function": {"name": "run_shell_command", "arguments": '{"command": "ls"}'},
        }
    ]
    assert out["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 3,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 4},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


@pytest.mark.parametrize("neutral, native", [("stop", "stop"), ("length", "length"), ("abort", "stop")])
def test_finish_reasons(neutral, native):
    out = openai_chat.render_response(completion(text="x", finish_reason=neutral))
    assert out["choices"][0]["finish_reason"] == native and out["choices"][0]["message"]["content"] == "x"


def echo(message: dict):
    """Feed a rendered assistant message back as the next request's history, as a harness does."""
    body = {"messages": [{"role": "user", "content": "q"}, message]}
    return openai_chat.parse_request(body).messages[1]


@pytest.mark.parametrize(
    "c",
    [
        completion(text="hello"),
        completion(reasoning="think", text="answer"),
        completion(reasoning="think", tool_calls=[CALL], finish_reason="tool_calls"),
        completion(
            text="two",
            tool_calls=[CALL, CALL.model_copy(update={"id": "call_10"})],
            finish_reason="tool_calls",
        ),
        completion(tool_calls=[ToolCall(id="call_r", name="f", raw="not json")], finish_reason="tool_calls"),
    ],
)
def test_json_response_round_trips_through_the_next_request(c):
    message = openai_chat.render_response(c)["choices"][0]["message"]
    assert echo(message) == c.as_message()


# ---- streaming -----------------------------------------------------------------------------------


def parse_sse(raw: bytes):
    """(comments, data payloads) of an SSE body; `[DONE]` stays a string."""
    comments, data = [], []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        assert "\n" not in block, block  # one line per event, as OpenAI sends them
        if block.startswith(":"):
            comments.append(block)
        else:
            assert block.startswith("data: ")
            payload = block[len("data: ") :]
            data.append(payload if payload == "[DONE]" else json.loads(payload))
    return comments, data


async def collect(events, req):
    return await stream_bytes(openai_chat, events, req)


def accumulate(chunks):
    """Rebuild the message from deltas the way OpenAI's SDKs and Qwen Code do."""
    msg = {"role": None, "content": "", "reasoning_content": "", "tool_calls": {}}
    finish, usage = None, None
    for ch in chunks:
        if ch.get("usage"):
            usage = ch["usage"]
        for choice in ch["choices"]:
            d = choice["delta"]
            msg["role"] = d.get("role") or msg["role"]
            msg["content"] += d.get("content") or ""
            msg["reasoning_content"] += d.get("reasoning_content") or ""
            for tc in d.get("tool_calls") or []:
                slot = msg["tool_calls"].setdefault(tc["index"], {"id": "", "name": "", "arguments": ""})
                slot["id"] = tc.get("id") or slot["id"]
                slot["name"] += (tc.get("function") or {}).get("name") or ""
                slot["arguments"] += (tc.get("function") or {}).get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return msg, finish, usage


async def test_sse_chunk_sequence_with_usage():
    req = openai_chat.parse_request(QWEN_BODY)
    c = completion(reasoning="th", text="ok", tool_calls=[CALL], finish_reason="tool_calls")
    raw = await collect(
        [
            Started(turn_id="turn_abc", prompt_tokens=10),
            Ping(),
            ReasoningDelta(text="t"),
            ReasoningDelta(text="h"),
            TextDelta(text="o"),
            TextDelta(text="k"),
            ToolCallEvent(call=CALL),
            Done(completion=c),
        ],
        req,
    )
    comments, data = parse_sse(raw)
    assert comments == [": ping"]
    assert data[-1] == "[DONE]"
    chunks = data[:-1]
    assert {ch["id"] for ch in chunks} == {"chatcmpl-abc"}
    assert {ch["object"] for ch in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [ch["choices"][0]["delta"] if ch["choices"] else None for ch in chunks]
    assert deltas[1:5] == [
        {"reasoning_content": "t"},
        {"reasoning_content": "h"},
        {"content": "o"},
        {"content": "k"},
    ]
    # The call whole, in one chunk: Mistral's SDK requires the name in every tool-call chunk.
    assert deltas[5] == {
        "tool_calls": [
            {
                "index": 0,
                "id": "call_9",
                "type": "function",
                "function": {"name": "run_shell_command", "arguments": '{"command": "ls"}'},
            }
        ]
    }
    assert deltas[6] == {} and chunks[6]["choices"][0]["finish_reason"] == "tool_calls"
    # The usage chunk: no choices; every other chunk says usage null, as OpenAI does.
    assert chunks[7]["choices"] == [] and chunks[7]["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
    assert all(ch["usage"] is None for ch in chunks[:7])
    assert [ch["choices"][0]["finish_reason"] for ch in chunks[:6]] == [None] * 6


async def test_stream_reassembles_to_the_json_response():
    req = openai_chat.parse_request(QWEN_BODY)
    second = CALL.model_copy(update={"id": "call_10", "arguments": {"command": "pwd"}})
    c = completion(reasoning="r", text="t", tool_calls=[CALL, second], finish_reason="tool_calls")
    raw = await collect(
        [
            Started(turn_id="turn_abc", prompt_tokens=10),
            ReasoningDelta(text="r"),
            TextDelta(text="t"),
            ToolCallEvent(call=CALL),
            ToolCallEvent(call=second),
            Done(completion=c),
        ],
        req,
    )
    msg, finish, usage = accumulate(parse_sse(raw)[1][:-1])
    whole = openai_chat.render_response(c)
    expected = whole["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"] == expected["content"]
    assert msg["reasoning_content"] == expected["reasoning_content"]
    assert [
        {"id": s["id"], "type": "function", "function": {"name": s["name"], "arguments": s["arguments"]}}
        for _, s in sorted(msg["tool_calls"].items())
    ] == expected["tool_calls"]
    assert finish == "tool_calls" and usage == whole["usage"]


async def test_stream_without_include_usage_has_no_usage_at_all():
    body = copy(QWEN_BODY)
    del body["stream_options"]
    req = openai_chat.parse_request(body)
    raw = await collect(
        [
            Started(turn_id="turn_x", prompt_tokens=1),
            TextDelta(text="a"),
            Done(completion=completion(text="a")),
        ],
        req,
    )
    _, data = parse_sse(raw)
    assert data[-1] == "[DONE]" and all("usage" not in ch for ch in data[:-1])
    assert [ch["choices"][0]["finish_reason"] for ch in data[:-1]] == [None, None, "stop"]


async def test_stream_without_done_never_sends_finish_or_done():
    req = openai_chat.parse_request(QWEN_BODY)
    raw = await collect([Started(turn_id="t", prompt_tokens=1), TextDelta(text="partial")], req)
    _, data = parse_sse(raw)
    assert "[DONE]" not in data
    assert all(ch["choices"][0]["finish_reason"] is None for ch in data)


def test_stream_error_is_a_data_chunk_with_an_error_object():
    raw = openai_chat.render_stream_error(ProviderError("overloaded", "backend went away", 529))
    _, [data] = parse_sse(raw)
    assert data["error"]["message"] == "backend went away" and data["error"]["type"] == "server_error"


def test_models_list_shape():
    out = openai_chat.render_models(["polar/fake"])
    assert out["object"] == "list" and out["data"][0]["id"] == "polar/fake"
    assert out["data"][0]["object"] == "model"


# ---- through the proxy ---------------------------------------------------------------------------

DASHSCOPE = "https://dashscope.aliyuncs.com/compatible-mode/v1/chat/completions"
OPENAI = "https://api.openai.com/v1/chat/completions"


def sse_data(text: str):
    return parse_sse(text.encode())[1]


async def test_tool_call_turn_then_echo_is_spliced_through_the_proxy(make_stack):
    stack = await make_stack()
    first = [
        {
            "role": "system",
            "content": [
                {"type": "text", "text": "You are a test agent.", "cache_control": {"type": "ephemeral"}}
            ],
        },
        {"role": "user", "content": "Create out.txt containing hi"},
    ]
    async with stack.client() as c:
        r1 = await c.post(
            DASHSCOPE,
            json={
                "model": "gpt-4o",
                "messages": first,
                "tools": [SHELL],
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            headers={"authorization": "Bearer sk-x"},
        )
        assert r1.status_code == 200 and r1.headers["content-type"].startswith("text/event-stream")
        data = sse_data(r1.text)
        assert data[-1] == "[DONE]"
        msg, finish, usage = accumulate(data[:-1])
        assert finish == "tool_calls" and usage["prompt_tokens"] > 0
        [call] = msg["tool_calls"].values()
        assert call["id"].startswith("call_") and call["name"] == "run_shell_command"
        assert "out.txt" in json.loads(call["arguments"])["command"]
        assistant = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]},
                }
            ],
        }
        second = first + [assistant, {"role": "tool", "tool_call_id": call["id"], "content": ""}]
        r2 = await c.post(DASHSCOPE, json={"model": "gpt-4o", "messages": second, "tools": [SHELL]})
    assert r2.status_code == 200
    out = r2.json()
    assert out["choices"][0]["message"]["content"] == "Done. The command finished."
    assert out["choices"][0]["finish_reason"] == "stop"
    t1, t2 = list(read_turns(stack.db))
    assert t1.style == "openai-chat"
    host = sqlite3.connect(stack.db).execute("SELECT host FROM turns WHERE id = ?", (t1.id,)).fetchone()
    assert host == ("dashscope.aliyuncs.com",)
    assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.output_ids)] == t1.prompt_ids + t1.output_ids
    assert t2.prompt_ref == t1.id


async def test_json_schema_response_format_constrains_the_reply(make_stack):
    stack = await make_stack()
    schema = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}
    async with stack.client() as c:
        r = await c.post(
            OPENAI,
            json={
                "model": "gpt-4o",
                "messages": [{"role": "user", "content": "title?"}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}},
                "max_completion_tokens": 64,
            },
        )
    assert r.status_code == 200
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"])["title"], str)
    async with httpx.AsyncClient() as c:
        reqs = (await c.get(stack.backend_url + "/_fake/requests")).json()["requests"]
    sp = [q["body"] for q in reqs if q.get("path") == "/generate"][-1]["sampling_params"]
    assert json.loads(sp["json_schema"]) == schema and sp["max_new_tokens"] == 64


async def test_models_and_side_paths_on_openai_hosts(make_stack):
    stack = await make_stack()
    async with stack.client() as c:
        models = await c.get("https://api.openai.com/v1/models")
        dash_models = await c.get("https://dashscope.aliyuncs.com/compatible-mode/v1/models")
    assert models.status_code == 200 and models.json()["object"] == "list"
    assert dash_models.json()["data"][0]["id"] == models.json()["data"][0]["id"]


async def test_backend_down_is_a_retryable_503_in_openai_shape(make_stack):
    stack = await make_stack(backend_up=False)
    async with stack.client() as c:
        r = await c.post(
            DASHSCOPE, json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        )
    assert r.status_code == 503 and r.headers.get("x-should-retry") == "true"
    err = r.json()["error"]
    assert err["type"] == "server_error" and "unreachable" in err["message"]
    assert sqlite3.connect(stack.db).execute("SELECT COUNT(*) FROM turns").fetchone() == (0,)


async def test_malformed_request_through_the_proxy_is_an_openai_400(make_stack):
    stack = await make_stack()
    async with stack.client() as c:
        bad_json = await c.post(OPENAI, content=b"{nope", headers={"content-type": "application/json"})
        bad_role = await c.post(OPENAI, json={"model": "m", "messages": [{"role": "robot", "content": "x"}]})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["type"] == "invalid_request_error"
    assert bad_role.status_code == 400 and bad_role.json()["error"]["param"] == "messages.0.role"


# ---- the Qwen Code recipe ------------------------------------------------------------------------


def test_qwen_code_recipe_routes_its_hosts_here_and_tags_the_memory_extractor():
    from polar_mitm import recipes
    from polar_mitm.providers import STYLES

    rec = recipes.for_command(["qwen", "--auth-type", "openai", "-p", "hi"])
    assert rec.name == "qwen-code" and "NODE_EXTRA_CA_CERTS" in rec.ca.cert_env
    assert rec.env_default["OPENAI_API_KEY"]
    assert all(STYLES[style] is openai_chat for style in rec.hosts.values())
    assert "dashscope.aliyuncs.com" in rec.hosts
    path = "/compatible-mode/v1/chat/completions"
    assert rec.tag(openai_chat.parse_request(QWEN_BODY), path) is None
    extractor = copy(QWEN_BODY)
    extractor["messages"][0]["content"][0]["text"] = (
        "You are now acting as the managed memory extraction subagent for an AI coding assistant.\n\nRules:"
    )
    assert rec.tag(openai_chat.parse_request(extractor), path) == "memory-extract"


# Copilot CLI's default OpenAI path offers apply_patch as a Chat Completions `custom` tool.
APPLY_PATCH = {
    "type": "custom",
    "custom": {
        "name": "apply_patch",
        "description": "Apply a patch",
        "format": {
            "type": "grammar",
            "grammar": {"syntax": "lark", "definition": "start: PATCH\nPATCH: /.+/s"},
        },
    },
}
PATCH_TEXT = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"


def test_custom_tools_are_offered_as_one_string_argument_and_their_calls_echo_back():
    body = {
        "model": "gpt-5",
        "messages": [
            {"role": "user", "content": "add a.txt"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_1", "type": "custom", "custom": {"name": "apply_patch", "input": PATCH_TEXT}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "Done!"},
        ],
        "tools": [SHELL, APPLY_PATCH, {"type": "custom", "custom": {"name": "notes"}}],
    }
    req = openai_chat.parse_request(body)
    shell, patch, notes = req.tools
    assert patch.name == "apply_patch" and patch.parameters["required"] == ["input"]
    assert "lark grammar" in patch.parameters["properties"]["input"]["description"]
    assert "PATCH: /.+/s" in patch.parameters["properties"]["input"]["description"]
    assert notes.parameters["properties"]["input"]["type"] == "string"
    assert req.custom_tools == ["apply_patch", "notes"]
    [call] = req.messages[1].tool_calls
    assert call == ToolCall(id="call_1", name="apply_patch", arguments={"input": PATCH_TEXT})
    # The same Responses-style freeform tool: one reading of custom tools for both styles.
    from polar_mitm.providers import openai_responses

    r = openai_responses.parse_request(
        {
            "model": "m",
            "input": "x",
            "tools": [
                {
                    "type": "custom",
                    "name": "apply_patch",
                    "description": "Apply a patch",
                    "format": {
                        "type": "grammar",
                        "syntax": "lark",
                        "definition": "start: PATCH\nPATCH: /.+/s",
                    },
                }
            ],
        }
    )
    assert r.tools == [patch]


async def test_custom_tool_calls_render_as_custom_in_json_and_stream_and_reassemble():
    req = openai_chat.parse_request(
        {
            "model": "gpt-5",
            "messages": [{"role": "user", "content": "x"}],
            "tools": [SHELL, APPLY_PATCH],
            "stream": True,
        }
    )
    patch = ToolCall(id="call_7", name="apply_patch", arguments={"input": PATCH_TEXT})
    c = completion(tool_calls=[CALL, patch], finish_reason="tool_calls")
    whole = openai_chat.render_response(c, req)
    calls = whole["choices"][0]["message"]["tool_calls"]
    assert calls[0]["type"] == "function"
    assert calls[1] == {
        "id": "call_7",
        "type": "custom",
        "custom": {"name": "apply_patch", "input": PATCH_TEXT},
    }
    raw = await collect(
        [
            Started(turn_id="turn_abc", prompt_tokens=10),
            ToolCallEvent(call=CALL),
            ToolCallEvent(call=patch),
            Done(completion=c),
        ],
        req,
    )
    events = [(None, ch) for ch in parse_sse(raw)[1][:-1]]
    assembled = openai_chat.assemble(events)
    assert assembled["choices"][0]["message"]["tool_calls"] == calls
    # What the reply reads as is what its echo in the next request reads as.
    [msg], finish = openai_chat.parse_reply(assembled)
    assert msg.tool_calls == [CALL, patch] and finish == "tool_calls"


async def test_custom_tools_through_the_proxy_reach_the_prompt(make_stack):
    stack = await make_stack()
    body = {
        "model": "gpt-5",
        "messages": [{"role": "user", "content": "add a.txt"}],
        "tools": [APPLY_PATCH],
    }
    async with stack.client() as c:
        r = await c.post(
            "https://api.openai.com/v1/chat/completions", json=body, headers={"authorization": "Bearer k"}
        )
    assert r.status_code == 200, r.text
    [turn] = list(read_turns(stack.db))
    tok = await stack.proxy.policy.tokenizer()
    assert "apply_patch" in tok.decode(turn.prompt_ids) and "lark grammar" in tok.decode(turn.prompt_ids)
