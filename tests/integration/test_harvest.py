"""Harvest mode: reply assembly per style, credential removal, SFT conversion and retokenized rows
(pure functions over a real store), then the proxy in harvest mode in front of a fake HTTPS
provider (in-process: a real httpx client, mitmproxy, the addon and SQLite)."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import httpx
import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from polar_mitm.backends.tokenizer import Tokenizer
from polar_mitm.cli import main
from polar_mitm.neutral import (
    ChatRequest,
    Completion,
    Done,
    Message,
    ReasoningDelta,
    Started,
    TextDelta,
    ToolCall,
    ToolCallEvent,
)
from polar_mitm.providers import anthropic, gemini, openai_chat, openai_responses
from polar_mitm.proxy.embedded import PolarProxy, ProxyConfig
from polar_mitm.proxy.exchange import Exchange, assemble, error_of, parse_upstream, secret_values
from polar_mitm.reconstruct.export import SinkOptions, export
from polar_mitm.reconstruct.source import Selection
from polar_mitm.reconstruct.trajectory import TRAJECTORY_SCHEMA
from polar_mitm.sse import SSEEvent
from polar_mitm.sse import parse as parse_sse
from polar_mitm.store.requests import RequestReader
from polar_mitm.store.turn import Turn
from polar_mitm.store.writer import Store
from tests.support.helpers import BASH, COMPLETION, MESSAGES_URL, stored_bytes, stream_bytes

KEY = "sk-ant-api03-HARVEST-SECRET-0123456789abcdef"
URL = MESSAGES_URL

# ---- helpers ----------------------------------------------------------------------------------------


def sse(*events: tuple[str | None, dict | str]) -> bytes:
    out = b""
    for name, data in events:
        text = data if isinstance(data, str) else json.dumps(data)
        out += (f"event: {name}\n" if name else "").encode() + f"data: {text}\n\n".encode()
    return out


async def rendered(module, completion: Completion, req: ChatRequest) -> bytes:
    """What a style's own stream renderer sends for `completion` (deltas split in two)."""

    events: list = [Started(turn_id=completion.turn_id, prompt_tokens=completion.usage.prompt_tokens)]
    if completion.reasoning:
        half = len(completion.reasoning) // 2
        events += [
            ReasoningDelta(text=completion.reasoning[:half]),
            ReasoningDelta(text=completion.reasoning[half:]),
        ]
    half = len(completion.text) // 2
    events += [TextDelta(text=completion.text[:half]), TextDelta(text=completion.text[half:])]
    events += [ToolCallEvent(call=call) for call in completion.tool_calls]
    return await stream_bytes(module, [*events, Done(completion=completion)], req)


# ---- SSE and assembly per style ------------------------------------------------------------------


def test_parse_sse_joins_data_lines_and_skips_comments():
    text = ': keep-alive\r\nevent: a\r\ndata: {"x":\r\ndata: 1}\r\n\r\nid: 7\ndata: [DONE]\n\n'
    assert parse_sse(text) == [SSEEvent("a", '{"x":\n1}'), SSEEvent(None, "[DONE]")]


async def test_anthropic_stream_assembles_to_the_message_the_json_api_returns():
    req = ChatRequest(style="anthropic", model="claude-test", messages=[Message(role="user", content="ls")])
    body = await rendered(anthropic, COMPLETION, req)
    got = assemble(anthropic, body, "text/event-stream; charset=utf-8")
    want = anthropic.render_response(COMPLETION)
    assert got["content"] == want["content"]  # thinking + signature, text, tool_use with parsed input
    assert (got["id"], got["stop_reason"], got["usage"]["output_tokens"]) == (want["id"], "tool_use", 9)
    [msg], finish = anthropic.parse_reply(got, lenient=True)
    assert msg == COMPLETION.as_message() and finish == "tool_calls"


def test_anthropic_assembly_of_split_tool_json_pings_and_an_error_event():
    body = sse(
        (
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": "msg_1",
                    "model": "m",
                    "content": [],
                    "usage": {"input_tokens": 5, "output_tokens": 1},
                },
            },
        ),
        ("ping", {"type": "ping"}),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "tool_use", "id": "toolu_9", "name": "Bash", "input": {}},
            },
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "input_json_delta", "partial_json": '{"comm'},
            },
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "input_json_delta", "partial_json": 'and": "echo \\"hi\\""}'},
            },
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("error", {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
    )
    got = assemble(anthropic, body, "text/event-stream")
    assert got["content"] == [
        {"type": "tool_use", "id": "toolu_9", "name": "Bash", "input": {"command": 'echo "hi"'}}
    ]
    assert got["usage"] == {"input_tokens": 5, "output_tokens": 1}
    assert error_of(got) == "Overloaded"


async def test_openai_chat_stream_assembles_to_the_completion_the_json_api_returns():
    req = openai_chat.parse_request(
        {
            "model": "gpt-x",
            "messages": [{"role": "user", "content": "ls"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    body = await rendered(openai_chat, COMPLETION, req)
    got = assemble(openai_chat, body, "text/event-stream")
    want = openai_chat.render_response(COMPLETION)
    gm, wm = got["choices"][0]["message"], want["choices"][0]["message"]
    for k in ("content", "reasoning_content", "tool_calls"):
        assert gm[k] == wm[k], k
    assert got["choices"][0]["finish_reason"] == "tool_calls" and got["usage"] == want["usage"]
    [msg], finish = openai_chat.parse_reply(got, lenient=True)
    assert msg == COMPLETION.as_message() and finish == "tool_calls"


def test_openai_chat_assembly_of_parallel_tool_calls_split_arguments():
    def chunk(delta, finish=None, **kw):
        return (
            None,
            {
                "id": "chatcmpl-1",
                "model": "qwen",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                **kw,
            },
        )

    body = sse(
        chunk({"role": "assistant", "content": ""}),
        chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "call_a",
                        "type": "function",
                        "function": {"name": "read", "arguments": ""},
                    }
                ]
            }
        ),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"path": "a'}}]}),
        chunk(
            {
                "tool_calls": [
                    {
                        "index": 1,
                        "id": "call_b",
                        "type": "function",
                        "function": {"name": "read", "arguments": '{"path"'},
                    }
                ]
            }
        ),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '.txt"}'}}]}),
        chunk({"tool_calls": [{"index": 1, "function": {"arguments": ': "b.txt"}'}}]}),
        chunk({}, "tool_calls"),
        (None, {"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}),
        (None, "[DONE]"),
    )
    got = assemble(openai_chat, body, "text/event-stream")
    [msg], finish = openai_chat.parse_reply(got, lenient=True)
    assert [(c.id, c.arguments) for c in msg.tool_calls] == [
        ("call_a", {"path": "a.txt"}),
        ("call_b", {"path": "b.txt"}),
    ]
    assert finish == "tool_calls" and got["usage"]["completion_tokens"] == 4 and got["model"] == "qwen"


def test_openai_responses_assembly_takes_the_completed_response():
    final = {
        "id": "resp_1",
        "object": "response",
        "status": "completed",
        "output": [
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Plan."}]},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Running it."}],
            },
            {"type": "function_call", "call_id": "call_x", "name": "shell", "arguments": '{"cmd": ["ls"]}'},
        ],
        "usage": {"input_tokens": 9, "output_tokens": 4},
    }
    body = sse(
        (
            "response.created",
            {"type": "response.created", "response": {**final, "status": "in_progress", "output": []}},
        ),
        ("response.output_text.delta", {"type": "response.output_text.delta", "delta": "Running"}),
        ("response.completed", {"type": "response.completed", "response": final}),
    )
    got = assemble(openai_responses, body, "text/event-stream")
    assert got == final
    [msg], finish = openai_responses.parse_reply(got, lenient=True)
    assert (msg.content, msg.reasoning, finish) == ("Running it.", "Plan.", "tool_calls")
    assert msg.tool_calls[0].arguments == {"cmd": ["ls"]}


def test_gemini_assembly_merges_text_parts_and_keeps_thoughts_and_calls_apart():
    chunks = [
        {"candidates": [{"content": {"role": "model", "parts": [{"text": "Think", "thought": True}]}}]},
        {"candidates": [{"content": {"role": "model", "parts": [{"text": "ing.", "thought": True}]}}]},
        {"candidates": [{"content": {"role": "model", "parts": [{"text": "Hello "}]}}]},
        {"candidates": [{"content": {"role": "model", "parts": [{"text": "there."}]}}]},
        {
            "candidates": [
                {
                    "content": {
                        "role": "model",
                        "parts": [{"functionCall": {"name": "ls", "args": {"d": "."}}}],
                    },
                    "finishReason": "STOP",
                }
            ],
            "usageMetadata": {"promptTokenCount": 3, "candidatesTokenCount": 5},
            "modelVersion": "gemini-x",
        },
    ]
    streamed = assemble(gemini, sse(*[(None, c) for c in chunks]), "text/event-stream")
    as_array = assemble(gemini, json.dumps(chunks).encode(), "application/json")  # no alt=sse
    assert streamed == as_array
    parts = streamed["candidates"][0]["content"]["parts"]
    assert parts == [
        {"text": "Thinking.", "thought": True},
        {"text": "Hello there."},
        {"functionCall": {"name": "ls", "args": {"d": "."}}},
    ]
    [msg], finish = gemini.parse_reply(streamed, lenient=True)
    assert (msg.content, msg.reasoning, msg.tool_calls[0].name, finish) == (
        "Hello there.",
        "Thinking.",
        "ls",
        "tool_calls",
    )


def test_json_replies_are_kept_and_other_bodies_kept_as_text():
    reply = {
        "id": "msg_1",
        "type": "message",
        "content": [{"type": "text", "text": "hi"}],
        "stop_reason": "end_turn",
    }
    assert assemble(anthropic, json.dumps(reply).encode(), "application/json") == reply
    assert assemble(anthropic, b"<html>bad gateway</html>", "text/html") == {
        "text": "<html>bad gateway</html>"
    }


# ---- one exchange → one stored turn -----------------------------------------------------------------


def anthropic_request(messages, **kw) -> dict:
    return {
        "model": "claude-test",
        "max_tokens": 1024,
        "system": "You are a test agent.",
        "messages": messages,
        "tools": [BASH],
        **kw,
    }


def exchange(body: dict, *, path="/v1/messages?beta=true", headers=None, session="s1") -> Exchange:
    return Exchange(
        session_id=session,
        style=anthropic,
        host="api.anthropic.com",
        method="POST",
        path=path,
        request_headers=headers
        if headers is not None
        else [("x-api-key", KEY), ("content-type", "application/json")],
        request_body=json.dumps(body).encode(),
    )


def test_record_removes_every_credential_from_what_is_stored():
    ex = exchange(
        anthropic_request([{"role": "user", "content": f"my key is {KEY}"}], stream=True),
        path="/v1/messages?beta=true&key=QUERY-SECRET-42",
        headers=[
            ("x-api-key", KEY),
            ("authorization", f"Bearer {KEY}"),
            ("cookie", "sid=COOKIE-SECRET-7; t=1"),
            ("x-goog-api-key", "GOOG-SECRET-99"),
            ("content-type", "application/json"),
        ],
    )
    chunk = sse(
        ("message_start", {"type": "message_start", "message": {"id": "m", "content": [], "usage": {}}}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {}}),
    )
    assert ex.tee(chunk) == chunk  # passed on unchanged
    rec = ex.record(status_code=200, content_type="text/event-stream", reply_body=bytes(ex.reply))
    stored = rec.model_dump_json()
    for secret in (KEY, "QUERY-SECRET-42", "COOKIE-SECRET-7", "GOOG-SECRET-99"):
        assert secret not in stored
    assert rec.request_headers["x-api-key"] == rec.request_headers["x-goog-api-key"] == "[redacted]"
    assert rec.request_headers["content-type"] == "application/json"
    assert "my key is [redacted]" in rec.request and rec.path == "/v1/messages?beta=true&key=[redacted]"
    assert (rec.status, rec.finish_reason, rec.model, rec.style) == ("ok", "stop", "claude-test", "anthropic")
    assert rec.prompt_ids == [] and rec.output_ids == [] and rec.latency_ms is not None


def test_secret_values_finds_bearer_basic_and_query_credentials():
    import base64

    basic = base64.b64encode(b"user:BASIC-PASSWORD-1").decode()
    found = secret_values(
        [("Authorization", f"Basic {basic}"), ("X-Api-Key", "short")], "/x?api_key=QUERYVALUE1&q=1"
    )
    assert {"BASIC-PASSWORD-1", "QUERYVALUE1", f"Basic {basic}"} <= found
    assert "short" not in found  # too short to be a credential; would blank ordinary text


def test_record_of_an_error_reply_a_failed_exchange_and_a_tagged_side_call():
    body = anthropic_request([{"role": "user", "content": "hi"}])
    err = {"type": "error", "error": {"type": "rate_limit_error", "message": "Slow down"}}
    rec = exchange(body).record(
        status_code=429, content_type="application/json", reply_body=json.dumps(err).encode()
    )
    assert (rec.status, rec.error, rec.finish_reason) == ("error", "Slow down", "error")

    rec = exchange(body).record(
        status_code=None, content_type=None, reply_body=None, failure="connection refused"
    )
    assert (rec.status, rec.error, rec.response) == ("aborted", "connection refused", None)

    seen = []

    def tagger(req, path, headers):
        seen.append((req.messages[0].content, path))
        return "title"

    ok = json.dumps({"content": [{"type": "text", "text": "A title"}], "stop_reason": "end_turn"}).encode()
    rec = exchange(body).record(
        status_code=200, content_type="application/json", reply_body=ok, tagger=tagger
    )
    assert rec.tag == "title" and seen == [("You are a test agent.", "/v1/messages?beta=true")]


def test_parse_upstream():
    host, up = parse_upstream("API.Anthropic.com=https://127.0.0.1:8443/gw/")
    assert (host, up.scheme, up.host, up.port, up.path_prefix) == (
        "api.anthropic.com",
        "https",
        "127.0.0.1",
        8443,
        "/gw",
    )
    assert parse_upstream("a.com=http://gw.internal")[1].port == 80
    for bad in ("api.anthropic.com", "a.com=ftp://x", "a.com=https://user:pw@x", "=https://x"):
        with pytest.raises(ValueError):
            parse_upstream(bad)


def test_cli_upstream_needs_harvest_and_a_valid_url():
    r = CliRunner().invoke(main, ["run", "--upstream", "api.anthropic.com=https://127.0.0.1:1", "--", "true"])
    assert r.exit_code == 2 and "only apply with --harvest" in r.output
    r = CliRunner().invoke(main, ["run", "--harvest", "--upstream", "nonsense", "--", "true"])
    assert r.exit_code == 2 and "expected HOST=URL" in r.output


# ---- SFT conversations and retokenized rows from a real store -----------------------------------------

TOOL_USE = {"type": "tool_use", "id": "toolu_01", "name": "Bash", "input": {"command": "echo hi > out.txt"}}


def reply_sse(content: list[dict], stop: str) -> bytes:
    events = [
        (
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": "msg_x",
                    "model": "claude-test",
                    "content": [],
                    "usage": {"input_tokens": 20},
                },
            },
        )
    ]
    for i, block in enumerate(content):
        if block["type"] == "text":
            events += [
                (
                    "content_block_start",
                    {
                        "type": "content_block_start",
                        "index": i,
                        "content_block": {"type": "text", "text": ""},
                    },
                ),
                (
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": i,
                        "delta": {"type": "text_delta", "text": block["text"]},
                    },
                ),
            ]
        else:
            events += [
                (
                    "content_block_start",
                    {"type": "content_block_start", "index": i, "content_block": {**block, "input": {}}},
                ),
                (
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": i,
                        "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])},
                    },
                ),
            ]
        events.append(("content_block_stop", {"type": "content_block_stop", "index": i}))
    events.append(
        (
            "message_delta",
            {"type": "message_delta", "delta": {"stop_reason": stop}, "usage": {"output_tokens": 8}},
        )
    )
    return sse(*events)


def harvested(messages, content, stop, *, session="s1", system=None) -> Turn:
    body = anthropic_request(messages, stream=True)
    if system:
        body["system"] = system
    ex = exchange(body, session=session)
    ex.tee(reply_sse(content, stop))
    tagger = lambda req, path, headers: "title" if "concise title" in req.messages[0].content else None  # noqa: E731
    return ex.record(
        status_code=200, content_type="text/event-stream", reply_body=bytes(ex.reply), tagger=tagger
    )


USER = {"role": "user", "content": "Create out.txt containing hi"}
ASSISTANT_1 = [{"type": "text", "text": "I'll create it."}, TOOL_USE]
RESULT = {
    "role": "user",
    "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "(no output)"}],
}
ANSWER = "Done: out.txt now contains hi."


@pytest.fixture
async def harvest_db(tmp_path) -> tuple[Path, list[Turn]]:
    """A store as harvest mode leaves it: a two-turn tool loop, a title side call, and a separate
    one-turn conversation in another session."""
    db = tmp_path / "sft.sqlite"
    store = await Store.open(db)
    await store.ensure_session("s1", mode="harvest", task_id="task-7")
    await store.ensure_session("s2", mode="harvest")
    turns = [
        harvested([USER], ASSISTANT_1, "tool_use"),
        harvested(
            [USER], [{"type": "text", "text": "Out.txt"}], "end_turn", system="Generate a concise title"
        ),
        harvested(
            [USER, {"role": "assistant", "content": ASSISTANT_1}, RESULT],
            [{"type": "text", "text": ANSWER}],
            "end_turn",
        ),
        harvested(
            [{"role": "user", "content": "hello"}],
            [{"type": "text", "text": "Hi there."}],
            "end_turn",
            session="s2",
        ),
    ]
    for t in turns:
        await store.insert_turn(t)
    await store.set_reward("s1", 1.0)
    await store.close()
    return db, turns


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_sft_jsonl_has_one_line_per_final_conversation_in_openai_format(harvest_db, tmp_path):
    db, turns = harvest_db
    out = tmp_path / "sft.jsonl"
    stats = export(db, out, fmt="sft-jsonl")
    first, second = read_jsonl(out)
    assert stats.trajectories == 2 and stats.side_calls_excluded == 1
    assert [m["role"] for m in first["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    call = first["messages"][2]["tool_calls"][0]
    assert call["type"] == "function" and call["function"]["name"] == "Bash"
    assert json.loads(call["function"]["arguments"]) == {"command": "echo hi > out.txt"}  # a JSON string
    assert first["messages"][3] == {"role": "tool", "content": "(no output)", "tool_call_id": "toolu_01"}
    assert first["messages"][4] == {"role": "assistant", "content": ANSWER}
    assert first["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "Bash",
                "description": "Run a shell command",
                "parameters": BASH["input_schema"],
            },
        }
    ]
    meta = first["metadata"]
    assert meta["turn_ids"] == [turns[0].id, turns[2].id] and meta["trajectory_id"] == turns[2].id
    assert (meta["source"], meta["session_id"], meta["task_id"], meta["reward"]) == (
        "harvest",
        "s1",
        "task-7",
        1.0,
    )
    assert second["messages"][-1]["content"] == "Hi there." and second["metadata"]["session_id"] == "s2"


def test_sft_jsonl_per_request_and_side_calls(harvest_db, tmp_path):
    db, turns = harvest_db
    out = tmp_path / "all.jsonl"
    export(db, out, fmt="sft-jsonl", strategy="per-request", selection=Selection(include_side_calls=True))
    rows = read_jsonl(out)
    assert [r["metadata"]["trajectory_id"] for r in rows] == [t.id for t in turns]
    assert rows[1]["metadata"]["tags"] == ["title"] and rows[0]["messages"][-1]["tool_calls"]


async def test_sft_jsonl_reads_policy_turns_too(tmp_path):
    db = tmp_path / "policy.sqlite"
    store = await Store.open(db)
    await store.ensure_session("p1")
    await store.insert_turn(
        Turn(
            id="turn_p1",
            session_id="p1",
            style="anthropic",
            status="ok",
            prompt_ids=[1, 2],
            output_ids=[3],
            output_logprobs=[-0.5],
            request=json.dumps(anthropic_request([USER])),
            response=COMPLETION.model_dump_json(),
        )
    )
    await store.close()
    out = tmp_path / "p.jsonl"
    export(db, out, fmt="sft-jsonl")
    (row,) = read_jsonl(out)
    assert row["metadata"]["source"] == "policy"
    assert row["messages"][-1]["reasoning_content"] == COMPLETION.reasoning
    assert row["messages"][-1]["tool_calls"][0]["function"]["arguments"] == '{"command": "ls -la"}'


def test_parquet_with_tokenizer_retokenizes_harvested_conversations(harvest_db, tmp_path, qwen_tokenizer_dir):
    db, turns = harvest_db
    assert export(db, tmp_path / "none.parquet").trajectories == 0  # text turns need a tokenizer
    out = tmp_path / "sft.parquet"
    export(db, out, options=SinkOptions(tokenizer=str(qwen_tokenizer_dir)))
    table = pq.read_table(out)
    assert table.schema == TRAJECTORY_SCHEMA
    rows = table.to_pylist()
    assert len(rows) == 2
    row = rows[0]
    tok = Tokenizer.load(qwen_tokenizer_dir)
    meta = json.loads(row["metadata"])
    assert meta["source"] == "harvest" and meta["retokenized"] is True
    assert row["turn_ids"] == [turns[0].id, turns[2].id] and row["num_turns"] == 2 and row["reward"] == 1.0
    assert row["finish_reason"] == "stop" and row["task_id"] == "task-7"
    ids = row["prompt_ids"] + row["response_ids"]
    mask = [0] * len(row["prompt_ids"]) + row["loss_mask"]
    assert len(row["response_ids"]) == len(row["loss_mask"]) == len(row["response_logprobs"])
    assert set(row["response_logprobs"]) == {0.0}
    # The whole sequence is the template's rendering of the conversation...
    conv = [
        Message(role="system", content="You are a test agent."),
        Message(role="user", content="Create out.txt containing hi"),
        Message(
            role="assistant",
            content="I'll create it.",
            tool_calls=[ToolCall(id="toolu_01", name="Bash", arguments={"command": "echo hi > out.txt"})],
        ),
        Message(role="tool", content="(no output)", tool_call_id="toolu_01"),
        Message(role="assistant", content=ANSWER),
    ]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "Bash",
                "description": "Run a shell command",
                "parameters": BASH["input_schema"],
            },
        }
    ]
    assert tok.decode(ids) == tok.render(
        [m.to_template() for m in conv], tools=tools, add_generation_prompt=False
    )
    # ...and exactly the two replies are trained, each up to its end-of-turn token.
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append(tok.decode(ids[start:i]))
            start = None
    assert len(spans) == 2 and all(s.endswith("<|im_end|>") for s in spans)
    assert "I'll create it." in spans[0] and '"command": "echo hi > out.txt"' in spans[0]
    assert spans[1].endswith(ANSWER + "<|im_end|>") and "tool_response" not in spans[1]


def test_parquet_per_request_retokenizes_each_turn_training_its_reply(
    harvest_db, tmp_path, qwen_tokenizer_dir
):
    db, turns = harvest_db
    out = tmp_path / "pr.parquet"
    export(db, out, strategy="per-request", options=SinkOptions(tokenizer=str(qwen_tokenizer_dir)))
    rows = pq.read_table(out).to_pylist()
    assert [r["trajectory_id"] for r in rows] == [turns[0].id, turns[2].id, turns[3].id]
    tok = Tokenizer.load(qwen_tokenizer_dir)
    last = rows[1]
    trained = [t for t, m in zip(last["response_ids"], last["loss_mask"], strict=True) if m]
    assert tok.decode(trained).endswith(ANSWER + "<|im_end|>") and "I'll create it." not in tok.decode(
        trained
    )
    assert np.count_nonzero(last["loss_mask"]) == len(trained)


# ---- the proxy in harvest mode, in front of a fake HTTPS provider --------------------------------------


@pytest.fixture
async def harvest_proxy(tmp_path, certs_dir):
    """await harvest_proxy(upstreams, insecure=True) -> a started PolarProxy in harvest mode."""
    started: list[PolarProxy] = []

    async def make(upstreams: dict[str, str], insecure: bool = True) -> PolarProxy:
        p = PolarProxy(
            ProxyConfig(
                db=str(tmp_path / "harvest.sqlite"),
                certs_dir=certs_dir,
                default_session="s-harvest",
                mode="harvest",
                upstreams=upstreams,
                upstream_insecure=insecure,
            )
        )
        started.append(p)
        await p.start()
        return p

    yield make
    for p in started:
        await p.stop()


def db_bytes(db: str) -> bytes:
    return stored_bytes(db)


def message_body(**kw) -> dict:
    return {
        "model": "claude-test",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hello"}],
        **kw,
    }


@pytest.mark.slow
async def test_streamed_reply_reaches_the_harness_chunk_by_chunk(fake_provider, harvest_proxy):
    fake_provider.delay = 0.4  # 11 events: the upstream takes about 4 s to send its reply
    proxy = await harvest_proxy({"api.anthropic.com": fake_provider.url})
    arrivals: list[tuple[float, bytes]] = []
    async with httpx.AsyncClient(proxy=proxy.url, verify=str(proxy.ca.cert), timeout=60) as client:
        async with client.stream(
            "POST", URL, json=message_body(stream=True), headers={"x-api-key": KEY}
        ) as r:
            assert r.status_code == 200
            async for chunk in r.aiter_raw():
                arrivals.append((time.time(), chunk))
    # The first bytes arrived while the upstream was still sending, not all at the end.
    assert arrivals[0][0] < fake_provider.sent[-1] - 2.0, (arrivals[0][0], fake_provider.sent)
    assert len(arrivals) >= 5
    assert b"".join(c for _, c in arrivals) == bytes(fake_provider.sent_body)  # passed through unchanged

    con = sqlite3.connect(proxy.config.db)
    ((style, status, finish, response, headers, plen, olen),) = con.execute(
        "SELECT style, status, finish_reason, response, request_headers, prompt_len, output_len FROM turns"
    ).fetchall()
    assert (style, status, finish, plen, olen) == ("anthropic", "ok", "stop", 0, 0)
    reply = json.loads(response)
    assert reply["content"] == [{"type": "text", "text": fake_provider.GREETING}]
    assert reply["usage"]["input_tokens"] == 42
    assert json.loads(headers)["x-api-key"] == "[redacted]"
    con.close()
    assert KEY.encode() not in db_bytes(proxy.config.db)


async def test_requests_reach_the_upstream_unchanged_and_only_model_calls_are_stored(
    fake_provider, harvest_proxy
):
    proxy = await harvest_proxy({"api.anthropic.com": fake_provider.url})
    session_token = "proxy-token-SECRET-5150"
    via = proxy.url.replace("http://", f"http://sess-a:{session_token}@")
    async with httpx.AsyncClient(proxy=via, verify=str(proxy.ca.cert), timeout=60) as client:
        r = await client.post(URL + "?beta=true", json=message_body(), headers={"x-api-key": KEY})
        assert r.json()["content"][0]["text"] == fake_provider.GREETING
        side = await client.post(
            "https://api.anthropic.com/api/event_logging/batch",
            json={"events": []},
            headers={"x-api-key": KEY},
        )
        models = await client.get("https://api.anthropic.com/v1/models?key=" + KEY)
    assert (side.status_code, models.status_code) == (200, 404)  # the upstream's own answers
    got = fake_provider.requests
    assert [q["path"] for q in got] == [
        "/v1/messages?beta=true",
        "/api/event_logging/batch",
        "/v1/models?key=" + KEY,
    ]
    assert got[0]["headers"]["x-api-key"] == KEY and got[0]["body"] == message_body()  # credentials forwarded

    con = sqlite3.connect(proxy.config.db)
    rows = con.execute("SELECT session_id, path, status, id FROM turns").fetchall()
    assert [(s, p, st) for s, p, st, _ in rows] == [("sess-a", "/v1/messages?beta=true", "ok")]
    assert json.loads(RequestReader(con).request(rows[0][3])) == message_body()  # stored compressed
    assert con.execute("SELECT mode FROM sessions WHERE id = 'sess-a'").fetchone() == ("harvest",)
    con.close()
    raw = db_bytes(proxy.config.db)
    assert KEY.encode() not in raw and session_token.encode() not in raw


async def test_upstream_certificates_are_checked_without_upstream_insecure(fake_provider, harvest_proxy):
    proxy = await harvest_proxy({"api.anthropic.com": fake_provider.url}, insecure=False)
    async with httpx.AsyncClient(proxy=proxy.url, verify=str(proxy.ca.cert), timeout=60) as client:
        r = await client.post(URL, json=message_body(), headers={"x-api-key": KEY})
    assert r.status_code == 502 and fake_provider.requests == []
    con = sqlite3.connect(proxy.config.db)
    ((status, error),) = con.execute("SELECT status, error FROM turns").fetchall()
    con.close()
    assert status == "aborted" and "certificate" in error.lower()


async def test_compressed_replies_are_stored_decoded(fake_provider, harvest_proxy):
    fake_provider.compress = True
    proxy = await harvest_proxy({"api.anthropic.com": fake_provider.url})
    async with httpx.AsyncClient(proxy=proxy.url, verify=str(proxy.ca.cert), timeout=60) as client:
        plain = await client.post(URL, json=message_body(), headers={"accept-encoding": "gzip"})
        streamed = await client.post(URL, json=message_body(stream=True), headers={"accept-encoding": "gzip"})
    assert plain.headers["content-encoding"] == streamed.headers["content-encoding"] == "gzip"
    greeting = [{"type": "text", "text": fake_provider.GREETING}]
    assert assemble(anthropic, streamed.content, "text/event-stream")["content"] == greeting  # decodable
    con = sqlite3.connect(proxy.config.db)
    replies = [json.loads(r) for (r,) in con.execute("SELECT response FROM turns ORDER BY seq")]
    con.close()
    assert [r["content"] for r in replies] == [greeting, greeting]


async def test_a_websocket_to_a_model_endpoint_gets_426_so_the_harness_uses_http(
    fake_provider, harvest_proxy
):
    proxy = await harvest_proxy({"api.anthropic.com": fake_provider.url})
    upgrade = {
        "connection": "Upgrade",
        "upgrade": "websocket",
        "sec-websocket-version": "13",
        "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ==",
    }
    async with httpx.AsyncClient(proxy=proxy.url, verify=str(proxy.ca.cert), timeout=60) as client:
        r = await client.get(URL, headers=upgrade)
    assert r.status_code == 426 and fake_provider.requests == []


def test_harvest_gives_the_harness_no_dummy_credentials(certs_dir):
    # A dummy key would replace the harness's own login (e.g. Claude Code's OAuth) at the real provider.
    from polar_mitm import recipes
    from polar_mitm.harness.local import child_env
    from polar_mitm.proxy.certs import ensure_ca

    ca, recipe = ensure_ca(certs_dir), recipes.get("claude-code")
    policy = child_env({}, recipe, "http://127.0.0.1:1", ca, "s")
    harvest = child_env({}, recipe, "http://127.0.0.1:1", ca, "s", harvest=True)
    assert (
        policy["ANTHROPIC_AUTH_TOKEN"]
        and "ANTHROPIC_AUTH_TOKEN" not in harvest
        and "ANTHROPIC_API_KEY" not in harvest
    )
    assert harvest["NODE_EXTRA_CA_CERTS"] == str(ca.cert) and harvest["HTTPS_PROXY"] == "http://127.0.0.1:1"


async def test_sft_jsonl_from_a_harvested_openai_chat_session(tmp_path):
    def chat_exchange(messages, reply: bytes) -> Turn:
        ex = Exchange(
            session_id="oa",
            style=openai_chat,
            host="dashscope.aliyuncs.com",
            method="POST",
            path="/compatible-mode/v1/chat/completions",
            request_headers=[("authorization", f"Bearer {KEY}")],
            request_body=json.dumps(
                {
                    "model": "qwen3-coder-plus",
                    "messages": messages,
                    "stream": True,
                    "tools": [
                        {"type": "function", "function": {"name": "shell", "parameters": {"type": "object"}}}
                    ],
                }
            ).encode(),
        )
        ex.tee(reply)
        return ex.record(status_code=200, content_type="text/event-stream", reply_body=bytes(ex.reply))

    def chunk(delta, finish=None):
        return (
            None,
            {
                "id": "c1",
                "model": "qwen3-coder-plus",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            },
        )

    call = {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": "shell", "arguments": '{"cmd": "ls"}'},
    }
    user = {"role": "user", "content": "list files"}
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{k: v for k, v in call.items() if k != "index"}],
    }
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"}
    turns = [
        chat_exchange(
            [user],
            sse(
                chunk({"role": "assistant", "tool_calls": [call]}), chunk({}, "tool_calls"), (None, "[DONE]")
            ),
        ),
        chat_exchange(
            [user, assistant, tool],
            sse(
                chunk({"content": "There is "}),
                chunk({"content": "a.txt."}),
                chunk({}, "stop"),
                (None, "[DONE]"),
            ),
        ),
    ]
    db = tmp_path / "oa.sqlite"
    store = await Store.open(db)
    for t in turns:
        await store.insert_turn(t)
    await store.close()
    out = tmp_path / "oa.jsonl"
    export(db, out, fmt="sft-jsonl")
    (row,) = read_jsonl(out)
    assert [m["role"] for m in row["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert row["messages"][1]["tool_calls"][0]["function"] == {"name": "shell", "arguments": '{"cmd": "ls"}'}
    assert row["messages"][-1]["content"] == "There is a.txt." and row["metadata"]["style"] == "openai-chat"
    assert row["metadata"]["turn_ids"] == [t.id for t in turns] and KEY not in out.read_text()


async def test_openai_responses_stream_assembles_to_the_response_the_json_api_returns():
    req = openai_responses.parse_request({"model": "gpt-x", "input": "ls", "stream": True})
    body = await rendered(openai_responses, COMPLETION, req)
    got = assemble(openai_responses, body, "text/event-stream")
    want = openai_responses.render_response(COMPLETION)
    assert [i["type"] for i in got["output"]] == [i["type"] for i in want["output"]]
    [msg], finish = openai_responses.parse_reply(got, lenient=True)
    assert msg.content == COMPLETION.text and msg.reasoning == COMPLETION.reasoning
    assert [(c.name, c.arguments) for c in msg.tool_calls] == [("Bash", {"command": "ls -la"})]
    assert finish == "tool_calls"


async def test_gemini_stream_assembles_to_the_reply_the_json_api_returns():
    path = "/v1beta/models/gemini-x:streamGenerateContent?alt=sse"
    req = gemini.parse_request({"contents": [{"role": "user", "parts": [{"text": "ls"}]}]}, path=path)
    body = await rendered(gemini, COMPLETION, req)
    got = assemble(gemini, body, "text/event-stream")
    [msg], finish = gemini.parse_reply(got, lenient=True)
    [want], _ = gemini.parse_reply(gemini.render_response(COMPLETION))
    assert msg.content == want.content == COMPLETION.text
    assert msg.reasoning == want.reasoning == COMPLETION.reasoning
    assert [(c.name, c.arguments) for c in msg.tool_calls] == [("Bash", {"command": "ls -la"})]
    assert finish == "tool_calls"


@pytest.mark.parametrize("kind", ["custom", "local_shell"])
async def test_a_harvested_codex_session_with_a_freeform_or_shell_call_is_one_conversation(tmp_path, kind):
    """A reply parsed from the upstream and the same reply echoed in the next request are parsed
    the same way, so the session's two turns are one conversation, not two."""
    tools = [{"type": "custom", "name": "apply_patch", "format": {"type": "text"}}, {"type": "local_shell"}]
    if kind == "custom":
        call = ToolCall(
            id="call_1", name="apply_patch", arguments={"input": "*** Begin Patch\n*** End Patch"}
        )
    else:
        call = ToolCall(id="call_1", name="local_shell", arguments={"command": ["ls"], "workdir": "/w"})
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go"}]}

    async def exchange(items: list) -> tuple[Turn, list]:
        body = {"model": "gpt-5", "input": items, "tools": tools, "stream": True, "store": False}
        req = openai_responses.parse_request(body)
        last = [m for m in req.messages if m.role == "tool"]
        c = Completion(
            turn_id=f"turn_{len(items):04d}",
            model="gpt-5",
            text="Done." if last else "",
            tool_calls=[] if last else [call],
            finish_reason="stop" if last else "tool_calls",
        )
        reply = await rendered(openai_responses, c, req)
        ex = Exchange(
            session_id="codex",
            style=openai_responses,
            host="api.openai.com",
            method="POST",
            path="/v1/responses",
            request_headers=[("authorization", f"Bearer {KEY}")],
            request_body=json.dumps(body).encode(),
        )
        ex.tee(reply)
        rec = ex.record(status_code=200, content_type="text/event-stream", reply_body=bytes(ex.reply))
        return rec, assemble(openai_responses, reply, "text/event-stream")["output"]

    first, output = await exchange([user])
    result = {
        "type": f"{'custom_tool_call' if kind == 'custom' else 'local_shell_call'}_output",
        "call_id": "call_1",
    }
    second, _ = await exchange([user, *output, {**result, "output": "ok"}])
    db = tmp_path / "codex.sqlite"
    store = await Store.open(db)
    for t in (first, second):
        await store.insert_turn(t)
    await store.close()
    out = tmp_path / "codex.jsonl"
    export(db, out, fmt="sft-jsonl")
    (row,) = read_jsonl(out)
    assert [m["role"] for m in row["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert row["metadata"]["turn_ids"] == [first.id, second.id]
    assert row["messages"][-1]["content"] == "Done."


@pytest.mark.slow
async def test_a_proxy_stopped_right_after_a_reply_still_stores_it(
    fake_provider, tmp_path, certs_dir, monkeypatch
):
    """A reply with a length has reached the harness before its exchange is written: stopping must
    wait for that, here on a store that takes half a second to write (a slow disk)."""
    import asyncio

    from polar_mitm.store.writer import Store

    insert = Store.insert_turn

    async def slow_insert(self, rec):
        await asyncio.sleep(0.5)
        await insert(self, rec)

    monkeypatch.setattr(Store, "insert_turn", slow_insert)
    for i in range(2):
        proxy = PolarProxy(
            ProxyConfig(
                db=str(tmp_path / f"stop-{i}.sqlite"),
                certs_dir=certs_dir,
                mode="harvest",
                upstreams={"api.anthropic.com": fake_provider.url},
                upstream_insecure=True,
            )
        )
        await proxy.start()
        try:
            async with httpx.AsyncClient(proxy=proxy.url, verify=str(proxy.ca.cert), timeout=60) as client:
                for stream in (True, False):  # chunked, then with a length
                    r = await client.post(URL, json=message_body(stream=stream), headers={"x-api-key": KEY})
                    assert r.status_code == 200 and (b"message_stop" if stream else b"end_turn") in r.content
        finally:
            await proxy.stop()
        con = sqlite3.connect(tmp_path / f"stop-{i}.sqlite")
        assert con.execute("SELECT status FROM turns").fetchall() == [("ok",), ("ok",)]
        con.close()
