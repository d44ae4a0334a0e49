"""Google Gemini API: parsing Gemini CLI-shaped requests, rendering JSON and SSE, and the same
through the proxy (key redaction, splicing, Google-shaped errors)."""

import copy
import glob
import json
import re
import sqlite3

import httpx
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
from polar_mitm.providers import gemini
from polar_mitm.store.reader import read_turns
from tests.support.helpers import stream_bytes

STREAM_PATH = "/v1beta/models/gemini-3.1-pro-preview:streamGenerateContent?alt=sse"
JSON_PATH = "/v1beta/models/gemini-3.5-flash-lite:generateContent"

SHELL = {
    "name": "run_shell_command",
    "description": "This tool executes a given shell command as `bash -c <command>`.",
    "parametersJsonSchema": {
        "type": "object",
        "properties": {
            "command": {"type": "string", "description": "Exact bash command to execute"},
            "description": {"type": "string"},
            "is_background": {"type": "boolean"},
        },
        "required": ["command"],
    },
}
SESSION_CONTEXT = "<session_context>\nThis is the Gemini CLI.\n</session_context>"

# Gemini CLI 0.61's second agent request, as captured through the proxy (system prompt and tools
# trimmed): the echoed call carries our id prefixed with the tool name, and a thoughtSignature.
CLI_BODY = {
    "contents": [
        {"role": "user", "parts": [{"text": SESSION_CONTEXT}, {"text": "Create out.txt containing hi"}]},
        {
            "role": "model",
            "parts": [
                {
                    "functionCall": {
                        "id": "run_shell_command__call_a95561c0",
                        "args": {"command": "printf '%s\\n' 'hi' > 'out.txt'"},
                        "name": "run_shell_command",
                    },
                    "thoughtSignature": "skip_thought_signature_validator",
                }
            ],
        },
        {
            "role": "user",
            "parts": [
                {
                    "functionResponse": {
                        "name": "run_shell_command",
                        "response": {"output": "<untrusted_context>\nOutput: (empty)\n</untrusted_context>"},
                        "id": "run_shell_command__call_a95561c0",
                    }
                }
            ],
        },
    ],
    "systemInstruction": {"role": "user", "parts": [{"text": "You are a non-interactive CLI agent."}]},
    "tools": [{"functionDeclarations": [SHELL]}],
    "generationConfig": {
        "temperature": 1,
        "topP": 0.95,
        "topK": 64,
        "thinkingConfig": {"includeThoughts": True, "thinkingLevel": "HIGH"},
    },
}

# Gemini CLI's router call: JSON with a responseJsonSchema written with upper-case types.
ROUTER_BODY = {
    "contents": [
        {"role": "user", "parts": [{"text": SESSION_CONTEXT}]},
        {"role": "user", "parts": [{"text": "Create out.txt containing hi"}]},
    ],
    "systemInstruction": {"role": "user", "parts": [{"text": "You are a specialized Task Routing AI."}]},
    "generationConfig": {
        "temperature": 1,
        "responseMimeType": "application/json",
        "responseJsonSchema": {
            "type": "OBJECT",
            "properties": {
                "complexity_reasoning": {"type": "STRING"},
                "complexity_score": {"type": "INTEGER"},
            },
            "required": ["complexity_reasoning", "complexity_score"],
        },
        "thinkingConfig": {"includeThoughts": True, "thinkingLevel": "HIGH"},
    },
}


# ---- endpoints ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method, path, expected",
    [
        ("POST", STREAM_PATH, "generate"),
        ("POST", JSON_PATH + "?key=abc", "generate"),
        ("POST", "/v1/models/gemini-2.5-pro:generateContent", "generate"),
        ("POST", "/v1beta/models/gemini-2.5-pro:countTokens", "count_tokens"),
        ("POST", "/v1/projects/p/locations/us/publishers/google/models/m:generateContent", "generate"),
        ("POST", "/v1beta/models/gemini-2.5-pro%3AgenerateContent", "generate"),
        ("GET", "/v1beta/models", "models"),
        ("GET", JSON_PATH, None),
        ("POST", "/v1beta/models/m:embedContent", None),
        ("POST", "/v1beta/cachedContents", None),
        ("POST", "/log", None),
    ],
)
def test_endpoints(method, path, expected):
    assert gemini.endpoint(method, path) == expected


def test_model_and_stream_flag_come_from_the_path():
    assert gemini.parse_request(CLI_BODY, path=STREAM_PATH).model == "gemini-3.1-pro-preview"
    assert gemini.parse_request(CLI_BODY, path=STREAM_PATH).stream is True
    assert gemini.parse_request(CLI_BODY, path=JSON_PATH).stream is False


# ---- request -----------------------------------------------------------------------------------


def test_gemini_cli_request_parses_to_neutral_messages():
    req = gemini.parse_request(CLI_BODY, path=STREAM_PATH)
    assert [m.role for m in req.messages] == ["system", "user", "assistant", "tool"]
    assert req.messages[0].content == "You are a non-interactive CLI agent."
    assert req.messages[1].content == SESSION_CONTEXT + "\nCreate out.txt containing hi"
    [call] = req.messages[2].tool_calls
    assert call.name == "run_shell_command" and call.arguments == {
        "command": "printf '%s\\n' 'hi' > 'out.txt'"
    }
    tool = req.messages[3]
    assert tool.content == "<untrusted_context>\nOutput: (empty)\n</untrusted_context>"
    assert tool.tool_call_id == call.id and tool.name == "run_shell_command"
    [t] = req.tools
    assert t.name == "run_shell_command" and t.parameters == SHELL["parametersJsonSchema"]
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens, s.json_schema) == (1, 0.95, 64, None, None)
    assert req.thinking is True


def test_function_calls_without_ids_get_stable_ids_and_responses_pair_by_name():
    body = {
        "contents": [
            {"role": "user", "parts": [{"text": "go"}]},
            {
                "role": "model",
                "parts": [
                    {"functionCall": {"name": "read_file", "args": {"path": "a"}}},
                    {"functionCall": {"name": "run_shell_command", "args": {"command": "ls"}}},
                ],
            },
            {
                "role": "user",
                "parts": [
                    {"functionResponse": {"name": "run_shell_command", "response": {"output": "x"}}},
                    {"functionResponse": {"name": "read_file", "response": {"error": "no such file"}}},
                    {"text": "and then?"},
                ],
            },
        ]
    }
    a = gemini.parse_request(body, path=JSON_PATH)
    assert a == gemini.parse_request(copy.deepcopy(body), path=JSON_PATH)  # same ids every time
    read, shell = a.messages[1].tool_calls
    assert read.id != shell.id and read.id.startswith("call_")
    assert [(m.role, m.tool_call_id, m.content) for m in a.messages[2:]] == [
        ("tool", shell.id, "x"),
        ("tool", read.id, "Error: no such file"),
        ("user", None, "and then?"),
    ]


def test_thought_parts_are_reasoning_and_other_parts_become_placeholders():
    body = {
        "contents": [
            {
                "parts": [  # no role: the API treats it as the user
                    {"text": "what is this?"},
                    {"inlineData": {"mimeType": "image/png", "data": "iVBORw0KGgo="}},
                    {"fileData": {"mimeType": "application/pdf", "fileUri": "gs://b/f.pdf"}},
                ]
            },
            {
                "role": "model",
                "parts": [{"text": "let me look", "thought": True}, {"text": "A "}, {"text": "cat."}],
            },
        ]
    }
    req = gemini.parse_request(body, path=JSON_PATH)
    assert req.messages[0].content == (
        "what is this?\n[inline data: image/png]\n[file: gs://b/f.pdf (application/pdf)]"
    )
    assert "iVBORw0KGgo" not in req.model_dump_json()
    assert req.messages[1].reasoning == "let me look" and req.messages[1].content == "A cat."


def test_router_json_schema_is_standard_json_schema_and_thinking_is_off():
    req = gemini.parse_request(ROUTER_BODY, path=JSON_PATH)
    assert req.sampling.json_schema == {
        "type": "object",
        "properties": {"complexity_reasoning": {"type": "string"}, "complexity_score": {"type": "integer"}},
        "required": ["complexity_reasoning", "complexity_score"],
    }
    # Constrained decoding starts at the first token: no room to think first.
    assert req.thinking is False
    assert [m.role for m in req.messages] == ["system", "user", "user"]


def test_openapi_schemas_become_json_schema():
    schema = {
        "type": "OBJECT",
        "propertyOrdering": ["a", "b"],
        "properties": {
            "a": {"type": "STRING", "nullable": True, "enum": ["X", "Y"]},
            "b": {"type": "ARRAY", "items": {"type": "NUMBER"}},
            "type": {"type": "BOOLEAN"},
        },
    }
    assert gemini.openapi_to_json_schema(schema) == {
        "type": "object",
        "properties": {
            "a": {"type": ["string", "null"], "enum": ["X", "Y"]},
            "b": {"type": "array", "items": {"type": "number"}},
            "type": {"type": "boolean"},
        },
    }
    body = {
        "contents": [{"role": "user", "parts": [{"text": "x"}]}],
        "tools": [
            {"functionDeclarations": [{"name": "f", "parameters": schema}, {"name": "g"}]},
            {"googleSearch": {}},
        ],
        "generationConfig": {"responseMimeType": "application/json", "responseSchema": schema},
    }
    req = gemini.parse_request(body, path=JSON_PATH)
    assert req.tools[0].parameters == gemini.openapi_to_json_schema(schema)
    assert req.tools[1].parameters == {"type": "object", "properties": {}}
    assert req.sampling.json_schema == gemini.openapi_to_json_schema(schema)


def test_json_mode_without_a_schema_accepts_any_json():
    body = {
        "contents": [{"role": "user", "parts": [{"text": "x"}]}],
        "generationConfig": {"responseMimeType": "application/json"},
    }
    assert gemini.parse_request(body, path=JSON_PATH).sampling.json_schema == {}


@pytest.mark.parametrize(
    "config, expected",
    [
        ({"functionCallingConfig": {"mode": "AUTO"}}, "auto"),
        ({"functionCallingConfig": {"mode": "ANY"}}, "required"),
        ({"functionCallingConfig": {"mode": "NONE"}}, "none"),
        ({"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["f"]}}, {"name": "f"}),
        (None, None),
    ],
)
def test_tool_config(config, expected):
    body = {"contents": [{"role": "user", "parts": [{"text": "x"}]}], "toolConfig": config}
    assert gemini.parse_request(body, path=JSON_PATH).tool_choice == expected


@pytest.mark.parametrize(
    "thinking_config, expected",
    [
        ({"thinkingBudget": 0}, False),
        ({"thinkingBudget": -1}, True),
        ({"thinkingBudget": 8192, "includeThoughts": True}, True),
        ({"thinkingLevel": "LOW"}, True),
        ({"thinkingLevel": "MINIMAL"}, False),
        ({"includeThoughts": True}, None),
    ],
)
def test_thinking_config(thinking_config, expected):
    body = {
        "contents": [{"role": "user", "parts": [{"text": "x"}]}],
        "generationConfig": {
            "maxOutputTokens": 100,
            "stopSequences": ["END"],
            "thinkingConfig": thinking_config,
        },
    }
    req = gemini.parse_request(body, path=JSON_PATH)
    assert req.thinking is expected
    assert req.sampling.max_tokens == 100 and req.sampling.stop == ["END"]


def test_count_tokens_accepts_contents_or_a_whole_generate_request():
    path = "/v1beta/models/gemini-2.5-pro:countTokens"
    bare = gemini.parse_request({"contents": CLI_BODY["contents"]}, path=path, require_max_tokens=False)
    wrapped = gemini.parse_request({"generateContentRequest": CLI_BODY}, path=path, require_max_tokens=False)
    assert [m.role for m in bare.messages] == ["user", "assistant", "tool"]
    assert [m.role for m in wrapped.messages] == ["system", "user", "assistant", "tool"]
    assert wrapped.tools and not bare.tools
    assert gemini.render_count(42) == {"totalTokens": 42}


@pytest.mark.parametrize(
    "body, fragment",
    [
        ([], "JSON object"),
        ({}, "contents"),
        ({"contents": [{"role": "assistant", "parts": [{"text": "x"}]}]}, "contents[0].role"),
        ({"contents": [{"role": "user", "parts": "x"}]}, "contents[0].parts"),
        ({"contents": [{"role": "model", "parts": [{"functionCall": {"args": {}}}]}]}, "functionCall.name"),
        (
            {"contents": [], "tools": [{"functionDeclarations": [{"description": "x"}]}]},
            "functionDeclarations[0]",
        ),
        ({"contents": [], "generationConfig": {"temperature": "hot"}}, "generationConfig"),
    ],
)
def test_malformed_requests_are_invalid_argument_errors(body, fragment):
    with pytest.raises(ProviderError) as e:
        gemini.parse_request(body, path=JSON_PATH)
    status, err = gemini.render_error(e.value)
    assert status == 400 and err["error"]["code"] == 400 and err["error"]["status"] == "INVALID_ARGUMENT"
    assert fragment in err["error"]["message"]


@pytest.mark.parametrize(
    "kind, status, code",
    [
        ("overloaded", 503, "UNAVAILABLE"),
        ("api_error", 500, "INTERNAL"),
        ("rate_limit", 429, "RESOURCE_EXHAUSTED"),
    ],
)
def test_errors_use_google_rpc_codes(kind, status, code):
    # The policy says 529 for an unreachable backend (Anthropic's code); Google's is 503.
    got_status, err = gemini.render_error(ProviderError(kind, "backend is unreachable", 529))
    assert got_status == status and err == {
        "error": {"code": status, "message": "backend is unreachable", "status": code}
    }


def test_stream_error_is_a_bare_json_error_object():
    # The google-genai SDK raises an ApiError with this code only for a bare JSON error chunk.
    raw = gemini.render_stream_error(ProviderError("overloaded", "down", 529))
    assert json.loads(raw) == {"error": {"code": 503, "message": "down", "status": "UNAVAILABLE"}}


# ---- response ----------------------------------------------------------------------------------


def completion(**kw):
    base = dict(
        turn_id="turn_abc", model="gemini-3.1-pro-preview", usage=Usage(prompt_tokens=10, completion_tokens=3)
    )
    base.update(kw)
    return Completion(**base)


def test_json_response_with_thought_text_and_function_call():
    c = completion(
        reasoning="r",
        text="hi",
        tool_calls=[ToolCall(id="call_x", name="run_shell_command", arguments={"command": "ls"})],
        finish_reason="tool_calls",
        usage=Usage(prompt_tokens=10, completion_tokens=3, cached_tokens=8),
    )
    assert gemini.render_response(c) == {
        "candidates": [
            {
                "content": {
                    "role": "model",
                    "parts": [
                        {"text": "r", "thought": True},
                        {"text": "hi"},
                        {
                            "functionCall": {
                                "id": "call_x",
                                "name": "run_shell_command",
                                "args": {"command": "ls"},
                            }
                        },
                    ],
                },
                "finishReason": "STOP",
                "index": 0,
            }
        ],
        "usageMetadata": {
            "promptTokenCount": 10,
            "candidatesTokenCount": 3,
            "totalTokenCount": 13,
            "cachedContentTokenCount": 8,
        },
        "modelVersion": "gemini-3.1-pro-preview",
        "responseId": "abc",
    }


@pytest.mark.parametrize(
    "kw, reason",
    [
        ({"text": "x", "finish_reason": "length"}, "MAX_TOKENS"),
        ({"text": "x", "finish_reason": "abort"}, "OTHER"),
        ({"tool_calls": [ToolCall(id="c", name="f", raw="{not json")], "finish_reason": "tool_calls"}, None),
    ],
)
def test_finish_reasons(kw, reason):
    out = gemini.render_response(completion(**kw))
    cand = out["candidates"][0]
    if reason is None:  # arguments that are no JSON object cannot be a functionCall
        assert cand["finishReason"] == "MALFORMED_FUNCTION_CALL" and cand["content"]["parts"] == []
    else:
        assert cand["finishReason"] == reason


def echo_like_gemini_cli(reply: dict) -> dict:
    """The model content Gemini CLI puts back into its history: thoughts dropped, call ids
    prefixed with the tool name, a thoughtSignature added."""
    parts = []
    for p in reply["candidates"][0]["content"]["parts"]:
        if p.get("thought"):
            continue
        p = copy.deepcopy(p)
        if "functionCall" in p:
            fc = p["functionCall"]
            fc["id"] = f"{fc['name']}__{fc['id']}"
            p["thoughtSignature"] = "skip_thought_signature_validator"
        parts.append(p)
    return {"role": "model", "parts": parts}


def test_echo_of_a_rendered_reply_hashes_like_the_reply():
    """Splicing finds the earlier turn by its post-reply hash; the CLI's echo must hash the same."""
    first = {k: v for k, v in CLI_BODY.items() if k != "contents"} | {"contents": CLI_BODY["contents"][:1]}
    req = gemini.parse_request(first, path=STREAM_PATH)
    c = completion(
        reasoning="I will use the shell.",
        text="Creating it.\n",
        tool_calls=[
            ToolCall(id="call_1234", name="run_shell_command", arguments={"command": "echo hi > out.txt"})
        ],
        finish_reason="tool_calls",
    )
    post_hash = conversation_hashes(req.messages + [c.as_message()], req.tools)[-1]
    echo = copy.deepcopy(first)
    echo["contents"].append(echo_like_gemini_cli(gemini.render_response(c)))
    echo["contents"].append(
        {
            "role": "user",
            "parts": [{"functionResponse": {"name": "run_shell_command", "response": {"output": ""}}}],
        }
    )
    req2 = gemini.parse_request(echo, path=STREAM_PATH)
    assert conversation_hashes(req2.messages, req2.tools)[len(req.messages) + 1] == post_hash


SDK_DATA_LINE = re.compile(r"^\s*data: (.*)(?:\n\n|\r\r|\r\n\r\n)")


def sdk_chunks(raw: bytes) -> list[dict]:
    """Split a stream the way the google-genai JS SDK does (its responseLineRE), failing where it
    would: anything left over at the end is 'Incomplete JSON segment'."""
    buf, out = raw.decode(), []
    while m := SDK_DATA_LINE.match(buf):
        out.append(json.loads(m.group(1)))
        buf = buf[m.end() :]
    assert buf.strip() == "", f"the SDK would fail on {buf!r}"
    return out


async def collect(events, req):
    return await stream_bytes(gemini, events, req)


async def test_sse_chunk_sequence():
    req = gemini.parse_request(CLI_BODY, path=STREAM_PATH)
    call = ToolCall(id="call_9", name="run_shell_command", arguments={"command": "ls"})
    c = completion(reasoning="th", text="ok", tool_calls=[call], finish_reason="tool_calls")
    raw = await collect(
        [
            Started(turn_id="turn_abc", prompt_tokens=10),
            Ping(),
            ReasoningDelta(text="th"),
            TextDelta(text="o"),
            Ping(),
            TextDelta(text="k"),
            ToolCallEvent(call=call),
            Done(completion=c),
        ],
        req,
    )
    chunks = sdk_chunks(raw)
    assert [ch["candidates"][0]["content"]["parts"] for ch in chunks] == [
        [{"text": "th", "thought": True}],
        [{"text": "o"}],
        [{"text": "k"}],
        [{"functionCall": {"id": "call_9", "name": "run_shell_command", "args": {"command": "ls"}}}],
        [],
    ]
    assert all(ch["responseId"] == "abc" and ch["modelVersion"] == "gemini-3.1-pro-preview" for ch in chunks)
    assert all("finishReason" not in ch["candidates"][0] for ch in chunks[:-1])
    assert chunks[-1]["candidates"][0]["finishReason"] == "STOP"
    assert chunks[-1]["usageMetadata"] == {
        "promptTokenCount": 10,
        "candidatesTokenCount": 3,
        "totalTokenCount": 13,
    }
    # Keep-alives are bare line breaks: an SSE comment line would wedge the SDK's parser.
    assert raw.startswith(gemini.KEEPALIVE + b"data: ")
    assert raw.count(b"\r\n\r\n" + gemini.KEEPALIVE + b"data: ") == 1
    assert not any(line.startswith(b":") for line in raw.split(b"\r\n"))


async def test_stream_without_done_has_no_finish_reason():
    # Gemini CLI retries a stream that ends without a finishReason instead of accepting it.
    req = gemini.parse_request(CLI_BODY, path=STREAM_PATH)
    chunks = sdk_chunks(
        await collect([Started(turn_id="t", prompt_tokens=1), TextDelta(text="partial")], req)
    )
    assert chunks and all("finishReason" not in ch["candidates"][0] for ch in chunks)


def test_models_list():
    out = gemini.render_models(["polar-mitm/fake"])
    assert out["models"][0]["name"] == "models/polar-mitm/fake"
    assert "generateContent" in out["models"][0]["supportedGenerationMethods"]


def test_gemini_cli_recipe_tags_its_helper_calls_not_its_agent_turns():
    from polar_mitm import recipes

    recipe = recipes.get("gemini-cli")
    next_speaker = copy.deepcopy(CLI_BODY)
    next_speaker["contents"][-1] = {
        "role": "user",
        "parts": [
            {"text": "Analyze *only* the content ... determine who should logically speak next: the 'user'"}
        ],
    }
    tags = [
        recipe.tag(gemini.parse_request(b, path=p), p)
        for b, p in [(ROUTER_BODY, JSON_PATH), (next_speaker, JSON_PATH), (CLI_BODY, STREAM_PATH)]
    ]
    assert tags == ["router", "next-speaker", None]
    assert recipes.for_command(["gemini", "-p", "hi"]).name == "gemini-cli"


# ---- through the proxy -------------------------------------------------------------------------

HOST = "https://generativelanguage.googleapis.com"


def agent_body(contents):
    return {
        "contents": contents,
        "systemInstruction": {"parts": [{"text": "You are a test agent."}]},
        "tools": [{"functionDeclarations": [SHELL]}],
    }


async def test_tool_call_then_echo_is_spliced_through_the_proxy(make_stack):
    stack = await make_stack()
    first = [{"role": "user", "parts": [{"text": "Create out.txt containing hi"}]}]
    async with stack.client() as c:
        r1 = await c.post(HOST + STREAM_PATH, json=agent_body(first), headers={"x-goog-api-key": "k"})
        assert r1.headers["content-type"].startswith("text/event-stream")
        chunks = sdk_chunks(r1.content)
        [fc] = [
            p["functionCall"]
            for ch in chunks
            for p in ch["candidates"][0]["content"]["parts"]
            if "functionCall" in p
        ]
        assert fc["name"] == "run_shell_command" and "out.txt" in fc["args"]["command"]
        assert fc["id"].startswith("call_")
        reply = {"candidates": [{"content": {"role": "model", "parts": [{"functionCall": fc}]}}]}
        second = first + [
            echo_like_gemini_cli(reply),
            {
                "role": "user",
                "parts": [
                    {
                        "functionResponse": {
                            "id": f"run_shell_command__{fc['id']}",
                            "name": "run_shell_command",
                            "response": {"output": "Output: (empty)"},
                        }
                    }
                ],
            },
        ]
        r2 = await c.post(HOST + JSON_PATH, json=agent_body(second), headers={"x-goog-api-key": "k"})
    assert r2.status_code == 200
    assert r2.json()["candidates"][0]["content"]["parts"] == [{"text": "Done. The command finished."}]
    assert r2.json()["candidates"][0]["finishReason"] == "STOP"
    t1, t2 = list(read_turns(stack.db))
    assert (
        t1.style == "gemini" and t1.model == "gemini-3.1-pro-preview" and t2.model == "gemini-3.5-flash-lite"
    )
    assert t2.prompt_ref == t1.id
    assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.output_ids)] == t1.prompt_ids + t1.output_ids


async def test_json_schema_reaches_sglang_constrained_decoding(make_stack):
    stack = await make_stack()
    async with stack.client() as c:
        r = await c.post(HOST + JSON_PATH, json=ROUTER_BODY)
    answer = json.loads(r.json()["candidates"][0]["content"]["parts"][0]["text"])
    assert set(answer) == {"complexity_reasoning", "complexity_score"}
    async with httpx.AsyncClient() as h:
        reqs = (await h.get(stack.backend_url + "/_fake/requests")).json()["requests"]
    sp = [r["body"] for r in reqs if r.get("path") == "/generate"][-1]["sampling_params"]
    assert json.loads(sp["json_schema"])["properties"]["complexity_score"] == {"type": "integer"}


async def test_api_keys_never_reach_the_disk(make_stack):
    stack = await make_stack()
    secrets = ["AIzaSy-HEADER-SECRET-0123456789", "AIzaSy-QUERY-SECRET-9876543210"]
    async with stack.client() as c:
        r = await c.post(
            HOST + STREAM_PATH + "&key=" + secrets[1],
            json=agent_body([{"role": "user", "parts": [{"text": "hi"}]}]),
            headers={"x-goog-api-key": secrets[0]},
        )
        assert r.status_code == 200
    await stack.proxy.store.query("PRAGMA wal_checkpoint(PASSIVE)")
    blob = b"".join(open(p, "rb").read() for p in glob.glob(stack.db + "*"))
    assert b"x-goog-api-key" in blob and b"key=[redacted]" in blob  # names kept, values not
    for s in secrets:
        assert s.encode() not in blob


async def test_backend_down_is_a_retryable_503_unavailable(make_stack):
    stack = await make_stack(backend_up=False)
    async with stack.client() as c:
        r = await c.post(HOST + STREAM_PATH, json=agent_body([{"role": "user", "parts": [{"text": "hi"}]}]))
    assert r.status_code == 503
    assert r.json()["error"]["status"] == "UNAVAILABLE" and r.json()["error"]["code"] == 503
    assert "unreachable" in r.json()["error"]["message"]
    assert sqlite3.connect(stack.db).execute("SELECT COUNT(*) FROM turns").fetchone() == (0,)


async def test_malformed_request_is_a_google_shaped_400_and_side_paths_are_stubbed(make_stack):
    stack = await make_stack()
    async with stack.client() as c:
        r = await c.post(HOST + JSON_PATH, json={"contents": [{"role": "bot", "parts": []}]})
        assert r.status_code == 400 and r.json()["error"]["status"] == "INVALID_ARGUMENT"
        r = await c.get(HOST + "/v1beta/models")
        assert r.json()["models"][0]["name"] == "models/polar-mitm/fake"
        r = await c.post(
            HOST + "/v1beta/models/gemini-2.5-pro:countTokens",
            json={"contents": [{"parts": [{"text": "count me"}]}]},
        )
        assert r.status_code == 200 and r.json()["totalTokens"] > 0
    assert sqlite3.connect(stack.db).execute("SELECT COUNT(*) FROM turns").fetchone() == (0,)
