"""The whole turn path in-process: client → mitmproxy → gateway → policy → fake SGLang → SQLite.

A real HTTPS client talks to "api.anthropic.com" through the proxy, trusting only our CA.
"""

import asyncio
import glob
import json
import logging
import sqlite3

import httpx
import pytest

from polar_mitm.backends.render import render_full
from polar_mitm.backends.tokenizer import Tokenizer
from polar_mitm.providers import anthropic
from polar_mitm.store.reader import read_turns
from tests.support.helpers import BASH, MESSAGES_URL, sse_events, wait_until_async

URL = MESSAGES_URL


def body(messages, **kw):
    out = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 512,
        "messages": messages,
        "system": "You are a test agent.",
    }
    out.update(kw)
    return out


async def backend_generate(stack, input_ids, sampling_params):
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.post(
            stack.backend_url + "/generate",
            json={"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": True},
        )
        return r.json()


async def last_backend_request(stack):
    async with httpx.AsyncClient() as c:
        reqs = (await c.get(stack.backend_url + "/_fake/requests")).json()["requests"]
        return [r["body"] for r in reqs if r.get("path") == "/generate"][-1]


async def test_streamed_turn_is_stored_token_exact(make_stack, qwen_tokenizer_dir):
    stack = await make_stack()
    async with stack.client() as c:
        r = await c.post(
            URL, json=body([{"role": "user", "content": "hi"}], stream=True), headers={"x-api-key": "k"}
        )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[0][0] == "message_start" and events[-1][0] == "message_stop"
    text = "".join(d["delta"]["text"] for e, d in events if e == "content_block_delta")
    assert text == "Hello from the polar-mitm fake backend."

    [turn] = list(read_turns(stack.db))
    tok = Tokenizer.load(qwen_tokenizer_dir)
    req = anthropic.parse_request(body([{"role": "user", "content": "hi"}]))
    assert turn.prompt_ids == render_full(tok, req.messages, req.tools, {})
    sent = await last_backend_request(stack)
    assert sent["input_ids"] == turn.prompt_ids and sent["return_logprob"] is True
    again = await backend_generate(stack, turn.prompt_ids, sent["sampling_params"])
    assert turn.output_ids == again["output_ids"]
    assert turn.output_logprobs == [t[0] for t in again["meta_info"]["output_token_logprobs"]]
    assert turn.output_ids[-1] == tok.token_id("<|im_end|>")  # the stop token the engine returned
    assert turn.status == "ok" and turn.finish_reason == "stop"


async def test_a_turn_waits_at_the_closed_gate_with_pings_until_resume(make_stack):
    """Weight sync: while the policy is paused a turn starts for the harness, is counted as
    waiting at the gate (`at_gate`, what a pausing service or a test watches) and generates
    nothing; resumed, it is answered and leaves the gate."""
    stack = await make_stack()
    policy = stack.proxy.policy
    policy.pause()
    async with stack.client() as c:
        turn = asyncio.ensure_future(
            c.post(
                URL, json=body([{"role": "user", "content": "hi"}], stream=True), headers={"x-api-key": "k"}
            )
        )
        await wait_until_async(lambda: policy.at_gate == 1, timeout=20, message="the turn at the gate")
        await asyncio.sleep(0.3)  # past a ping interval (0.2 s): still held
        assert policy.at_gate == 1 and policy.generating == 0 and not turn.done()
        assert list(read_turns(stack.db)) == []
        policy.resume()
        r = await asyncio.wait_for(turn, 30)
    assert r.status_code == 200 and policy.at_gate == 0
    events = sse_events(r.text)
    assert events[0][0] == "message_start" and events[-1][0] == "message_stop"
    assert ("ping", {"type": "ping"}) in events  # the harness was kept alive meanwhile
    assert len(list(read_turns(stack.db))) == 1


async def test_sampling_params_use_sglang_names(make_stack):
    stack = await make_stack()
    async with stack.client() as c:
        await c.post(
            URL,
            json=body(
                [{"role": "user", "content": "hi"}],
                temperature=0.5,
                top_p=0.9,
                top_k=20,
                stop_sequences=["XYZ"],
            ),
        )
    sp = (await last_backend_request(stack))["sampling_params"]
    assert sp == {"max_new_tokens": 512, "temperature": 0.5, "top_p": 0.9, "top_k": 20, "stop": ["XYZ"]}


async def test_tool_call_then_echo_is_spliced(make_stack):
    stack = await make_stack()
    first = [{"role": "user", "content": "Create out.txt containing hi"}]
    async with stack.client() as c:
        r1 = (await c.post(URL, json=body(first, tools=[BASH]))).json()
        [use] = [b for b in r1["content"] if b["type"] == "tool_use"]
        assert use["name"] == "Bash" and "out.txt" in use["input"]["command"]
        assert r1["stop_reason"] == "tool_use"
        second = first + [
            {"role": "assistant", "content": r1["content"]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": ""}]},
        ]
        r2 = (await c.post(URL, json=body(second, tools=[BASH], stream=True))).text
    assert "".join(d["delta"].get("text", "") for e, d in sse_events(r2) if e == "content_block_delta") == (
        "Done. The command finished."
    )
    t1, t2 = list(read_turns(stack.db))
    assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.output_ids)] == t1.prompt_ids + t1.output_ids
    assert t2.prompt_ref == t1.id and t2.prompt_ref_len == len(t1.prompt_ids) + len(t1.output_ids)


async def test_commit_happens_before_the_end_of_the_reply(make_stack):
    stack = await make_stack(backend={"token_delay": 0.01})
    seen_at_message_delta = None
    async with stack.client() as c:
        async with c.stream("POST", URL, json=body([{"role": "user", "content": "hi"}], stream=True)) as r:
            async for line in r.aiter_lines():
                if line.startswith("event: message_delta"):
                    con = sqlite3.connect(stack.db)
                    seen_at_message_delta = con.execute("SELECT status FROM turns").fetchall()
                    con.close()
    assert seen_at_message_delta == [("ok",)]


async def test_backend_down_is_a_retryable_529_and_nothing_is_written(make_stack):
    stack = await make_stack(backend_up=False)
    async with stack.client() as c:
        r = await c.post(URL, json=body([{"role": "user", "content": "hi"}], stream=True))
    assert r.status_code == 529
    assert r.json()["error"]["type"] == "overloaded_error"
    assert "unreachable" in r.json()["error"]["message"]
    assert sqlite3.connect(stack.db).execute("SELECT COUNT(*) FROM turns").fetchone() == (0,)


@pytest.mark.parametrize(
    "content, fragment",
    [
        (b"{not json", "not valid JSON"),
        (json.dumps({"model": "x", "max_tokens": 5}).encode(), "messages"),
        (
            json.dumps(
                {"model": "x", "max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]}
            ).encode(),
            "role",
        ),
    ],
)
async def test_malformed_requests_get_anthropic_shaped_400(make_stack, content, fragment):
    stack = await make_stack()
    async with stack.client() as c:
        r = await c.post(URL, content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert fragment in err["error"]["message"]
    assert sqlite3.connect(stack.db).execute("SELECT COUNT(*) FROM turns").fetchone() == (0,)


@pytest.mark.parametrize("fault, status", [("garbage", 502), ("http500", 500)])
async def test_backend_garbage_or_errors_are_reported_and_nothing_is_written(make_stack, fault, status):
    stack = await make_stack()
    async with httpx.AsyncClient() as c:
        await c.post(stack.backend_url + "/_fake/fault", json={"mode": fault, "count": 1})
    async with stack.client() as c:
        r = await c.post(URL, json=body([{"role": "user", "content": "hi"}], stream=True))
    assert r.status_code == status
    assert r.json()["error"]["type"] == "api_error"
    assert sqlite3.connect(stack.db).execute("SELECT COUNT(*) FROM turns").fetchone() == (0,)


LONG = [{"match": "", "text": " ".join(f"word{i}" for i in range(300))}]


@pytest.mark.slow
async def test_harness_disconnect_mid_stream_records_an_aborted_turn(make_stack, caplog):
    """The harness gone is told in one info line, not aiohttp's error with a traceback."""
    # Streamed from SGLang's default cumulative chunks (by default the policy asks for whole replies).
    stack = await make_stack(
        backend={"token_delay": 0.01, "script": LONG}, policy={"backend_stream": "stream"}
    )
    async with stack.client() as c:
        async with c.stream("POST", URL, json=body([{"role": "user", "content": "hi"}], stream=True)) as r:
            deltas = 0
            async for line in r.aiter_lines():
                if line.startswith("event: content_block_delta"):
                    deltas += 1
                    if deltas == 5:
                        break  # the harness dies: the connection closes
    rows = await wait_until_async(
        lambda: sqlite3.connect(stack.db).execute("SELECT status, output_len FROM turns").fetchall(),
        timeout=5,
        message="the aborted turn stored",
    )
    [(status, n)] = rows
    assert status == "aborted"
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], errors
    [turn] = list(read_turns(stack.db, include_text_only=True))
    full = await backend_generate(stack, turn.prompt_ids, {"max_new_tokens": 512})
    assert 0 < n < len(full["output_ids"])
    assert turn.output_ids == full["output_ids"][:n]  # what was sampled before the cut, exactly
    assert turn.output_logprobs == [t[0] for t in full["meta_info"]["output_token_logprobs"][:n]]


@pytest.mark.slow
async def test_backend_dying_mid_stream_ends_the_stream_with_an_error_event(make_stack):
    stack = await make_stack(
        backend={"token_delay": 0.005, "script": LONG}, policy={"backend_stream": "stream"}
    )
    async with httpx.AsyncClient() as c:
        await c.post(stack.backend_url + "/_fake/fault", json={"mode": "drop_midstream", "count": 1})
    async with stack.client() as c:
        r = await c.post(URL, json=body([{"role": "user", "content": "hi"}], stream=True))
    events = sse_events(r.text)
    assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "overloaded_error"
    assert "message_stop" not in [e for e, _ in events]
    [(status,)] = sqlite3.connect(stack.db).execute("SELECT status FROM turns").fetchall()
    assert status == "error"  # the harness saw an error; the partial turn is kept, marked


async def test_credentials_never_reach_the_disk(make_stack):
    stack = await make_stack()
    secrets = ["sk-ant-SECRET-KEY-0123456789", "Bearer oauth-SECRET-TOKEN-987"]
    async with stack.client() as c:
        r = await c.post(
            URL + "?beta=true",
            json=body([{"role": "user", "content": "hi"}], stream=True),
            headers={"x-api-key": secrets[0], "authorization": secrets[1], "cookie": "session=SECRET-COOKIE"},
        )
        assert r.status_code == 200
    await stack.proxy.store.query("PRAGMA wal_checkpoint(PASSIVE)")
    blob = b"".join(open(p, "rb").read() for p in glob.glob(stack.db + "*"))
    assert b"x-api-key" in blob  # the header name is kept, its value is not
    for s in [*secrets, "SECRET-COOKIE"]:
        assert s.encode() not in blob


async def test_side_endpoints_are_answered_locally(make_stack, qwen_tokenizer_dir):
    stack = await make_stack()
    async with stack.client() as c:
        r = await c.get("https://api.anthropic.com/api/claude_code/settings")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        r = await c.post("https://api.anthropic.com/api/event_logging/batch", json={"events": []})
        assert r.status_code == 200
        r = await c.head("https://api.anthropic.com/")
        assert r.status_code == 200
        r = await c.get("https://api.anthropic.com/v1/models")
        assert r.json()["data"][0]["id"] == "polar-mitm/fake"
        msgs = [{"role": "user", "content": "count me"}]
        r = await c.post(
            "https://api.anthropic.com/v1/messages/count_tokens", json={"model": "x", "messages": msgs}
        )
    tok = Tokenizer.load(qwen_tokenizer_dir)
    req = anthropic.parse_request({"messages": msgs}, require_max_tokens=False)
    assert r.json() == {"input_tokens": len(render_full(tok, req.messages, [], {}))}
    assert sqlite3.connect(stack.db).execute("SELECT COUNT(*) FROM turns").fetchone() == (0,)


async def test_sessions_are_told_apart_by_proxy_credentials(make_stack):
    stack = await make_stack()
    host, port = stack.proxy.url.removeprefix("http://").split(":")
    for sid in ("alpha", "beta"):
        async with httpx.AsyncClient(
            proxy=f"http://{sid}:tok@{host}:{port}", verify=str(stack.proxy.ca.cert), timeout=30
        ) as c:
            await c.post(URL, json=body([{"role": "user", "content": "hi"}]))
    assert sorted(t.session_id for t in read_turns(stack.db)) == ["alpha", "beta"]


THINK_THEN_CALL = [
    {"match": "<tool_response>", "text": "All done."},
    {
        "match": "",
        "reasoning": "I should run a command.",
        "tool_call": {"name": "Bash", "arguments": {"command": "ls"}},
    },
]


async def test_thinking_is_streamed_signed_and_its_echo_still_splices(make_stack):
    stack = await make_stack(backend={"script": THINK_THEN_CALL})
    first = [{"role": "user", "content": "list files"}]
    async with stack.client() as c:
        r1 = await c.post(
            URL,
            json=body(first, tools=[BASH], stream=True, thinking={"type": "enabled", "budget_tokens": 512}),
        )
        events = sse_events(r1.text)
        starts = [d["content_block"]["type"] for e, d in events if e == "content_block_start"]
        assert starts == ["thinking", "tool_use"]
        thinking = "".join(d["delta"].get("thinking", "") for e, d in events if e == "content_block_delta")
        [sig] = [
            d["delta"]["signature"] for e, d in events if d.get("delta", {}).get("type") == "signature_delta"
        ]
        assert thinking == "I should run a command."
        [use] = [
            d["content_block"]
            for e, d in events
            if e == "content_block_start" and d["content_block"]["type"] == "tool_use"
        ]
        tool_json = "".join(
            d["delta"].get("partial_json", "") for e, d in events if e == "content_block_delta"
        )
        # Claude Code echoes the thinking block with its signature and the tool_use with its input.
        echoed = [
            {"type": "thinking", "thinking": thinking, "signature": sig},
            {"type": "tool_use", "id": use["id"], "name": use["name"], "input": json.loads(tool_json)},
        ]
        second = first + [
            {"role": "assistant", "content": echoed},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "a.txt"}],
            },
        ]
        r2 = (
            await c.post(
                URL, json=body(second, tools=[BASH], thinking={"type": "enabled", "budget_tokens": 512})
            )
        ).json()
    assert r2["content"] == [{"type": "text", "text": "All done."}]
    t1, t2 = list(read_turns(stack.db))
    assert t2.prompt_ref == t1.id
    assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.output_ids)] == t1.prompt_ids + t1.output_ids


async def test_each_turn_records_the_weight_version_that_sampled_it(make_stack):
    stack = await make_stack(backend={"weight_version": "step-1"})
    async with stack.client() as c:
        await c.post(URL, json=body([{"role": "user", "content": "hi"}]))
        async with httpx.AsyncClient() as admin:
            await admin.post(stack.backend_url + "/update_weight_version", json={"new_version": "step-2"})
        await c.post(URL, json=body([{"role": "user", "content": "hello"}], stream=True))
    assert [t.weight_version for t in read_turns(stack.db)] == ["step-1", "step-2"]


async def test_tokenizer_defaults_to_the_servers_model_info(make_stack, qwen_tokenizer_dir):
    stack = await make_stack(policy={"tokenizer": None})
    async with stack.client() as c:
        r = await c.post(URL, json=body([{"role": "user", "content": "hi"}]))
    assert r.status_code == 200
    assert stack.proxy.policy.discovery._tok.path == str(qwen_tokenizer_dir)


async def test_a_tokenizer_that_is_not_a_local_directory_is_a_clear_error(make_stack):
    from polar_mitm.backends.engine_api import ModelInfo

    stack = await make_stack(policy={"tokenizer": None})
    # A real SGLang server often reports a hub id, which is not a directory on this machine.
    stack.proxy.policy.discovery._info = ModelInfo(model_path="Qwen/Qwen3-8B", tokenizer_path="Qwen/Qwen3-8B")
    async with stack.client() as c:
        r = await c.post(URL, json=body([{"role": "user", "content": "hi"}]))
    assert r.status_code == 500
    assert "pass --tokenizer" in r.json()["error"]["message"]


@pytest.mark.slow
async def test_replies_stream_as_generated_with_pings_while_the_backend_is_silent(make_stack):
    import time

    stack = await make_stack(
        backend={
            "first_token_delay": 1.0,
            "token_delay": 0.03,
            "script": [{"match": "", "text": "one two three " * 10}],
            "incremental_streaming_output": True,  # so the policy streams from it
        }
    )
    seen: list[tuple[float, str]] = []
    t0 = time.perf_counter()
    async with stack.client() as c:
        async with c.stream("POST", URL, json=body([{"role": "user", "content": "hi"}], stream=True)) as r:
            async for line in r.aiter_lines():
                if line.startswith("event: "):
                    seen.append((time.perf_counter() - t0, line[7:]))
    names = [n for _, n in seen]
    first_delta = names.index("content_block_delta")
    assert "ping" in names[:first_delta]  # keep-alives while the backend was still silent
    t_first = seen[first_delta][0]
    t_stop = seen[names.index("message_stop")][0]
    assert t_stop - t_first > 0.5  # the text arrived over time, not all at the end
    assert sum(n == "content_block_delta" for n in names) > 10


async def test_reasoning_tokens_are_counted_up_to_the_closing_tag(make_stack, qwen_tokenizer_dir):
    stack = await make_stack(backend={"script": THINK_THEN_CALL})
    async with stack.client() as c:
        r = await c.post(
            "https://api.openai.com/v1/responses",
            json={
                "model": "gpt-x",
                "input": "list files",
                "tools": [{"type": "function", "name": "Bash", "parameters": {"type": "object"}}],
            },
        )
    usage = r.json()["usage"]
    [turn] = list(read_turns(stack.db))
    end = Tokenizer.load(qwen_tokenizer_dir).token_id("</think>")
    assert usage["output_tokens_details"]["reasoning_tokens"] == turn.output_ids.index(end) + 1
    assert (
        0
        < usage["output_tokens_details"]["reasoning_tokens"]
        < usage["output_tokens"]
        == len(turn.output_ids)
    )


async def test_reasoning_tokens_are_counted_up_to_the_parsers_own_closing_marker(
    make_stack, qwen_tokenizer_dir
):
    """The bug: the count looked for `</think>` whatever the reasoning parser, so kimi's
    ◁think▷…◁/think▷ (several tokens in the vocabulary) counted the whole reply as reasoning."""
    stack = await make_stack(
        backend={"script": [{"match": "", "text": "◁think▷Weigh the options.◁/think▷The answer is 4."}]},
        policy={"reasoning_parser": "kimi", "tool_parser": "none"},
    )
    async with stack.client() as c:
        r = await c.post("https://api.openai.com/v1/responses", json={"model": "gpt-x", "input": "2+2?"})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    [turn] = list(read_turns(stack.db))
    tok = Tokenizer.load(qwen_tokenizer_dir)
    n = usage["output_tokens_details"]["reasoning_tokens"]
    assert tok.token_id("◁/think▷") is None  # several tokens: found by text, not by id
    assert tok.decode(turn.output_ids[:n]).endswith("◁/think▷")
    assert "◁/think▷" not in tok.decode(turn.output_ids[: n - 1])
    assert 0 < n < usage["output_tokens"] == len(turn.output_ids)


CODER_CALL = [
    {
        "match": "",
        "text": "<tool_call>\n<function=Bash>\n<parameter=command>\nls\n</parameter>\n"
        "<parameter=timeout>\n30\n</parameter>\n</function>\n</tool_call>",
    }
]


async def test_text_valued_tool_formats_are_typed_by_the_requests_schema(make_stack):
    """qwen3_coder writes every value as text; the tool's schema says timeout is an integer, so
    the harness gets 30, not "30" (a harness rejects a call whose arguments break its schema)."""
    stack = await make_stack(backend={"script": CODER_CALL}, policy={"tool_parser": "qwen3_coder"})
    tool = {
        **BASH,
        "input_schema": {
            **BASH["input_schema"],
            "properties": {**BASH["input_schema"]["properties"], "timeout": {"type": "integer"}},
        },
    }
    async with stack.client() as c:
        r = await c.post(URL, json=body([{"role": "user", "content": "list"}], tools=[tool]))
    [use] = [b for b in r.json()["content"] if b["type"] == "tool_use"]
    assert use["input"] == {"command": "ls", "timeout": 30}


async def test_the_gateway_tls_port_answers_only_connections_the_proxy_handed_over(make_stack):
    """Model calls reach the gateway's TLS port through the proxy; another local client that
    connects to that port itself is refused and writes nothing."""
    stack = await make_stack()
    async with stack.client() as c:  # through the proxy: served
        r = await c.post(
            URL, json={"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}
        )
        assert r.status_code == 200
    port = stack.proxy.handoff.gateway_port
    async with httpx.AsyncClient(verify=False, timeout=30) as direct:  # noqa: S501 - a stranger
        r = await direct.post(
            f"https://127.0.0.1:{port}/v1/messages",
            headers={"host": "api.anthropic.com"},
            json={"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]},
        )
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert len(list(read_turns(stack.db))) == 1


def test_provider_certificates_are_loaded_without_leaving_files(certs_dir):
    import ssl
    import tempfile
    from pathlib import Path

    from polar_mitm.proxy.addons.handoff import provider_tls

    before = set(Path(tempfile.gettempdir()).glob("polar-mitm-tls-*"))
    ctx = provider_tls(certs_dir, {"api.anthropic.com", "api.openai.com"})
    assert isinstance(ctx, ssl.SSLContext) and ctx.sni_callback is not None
    assert set(Path(tempfile.gettempdir()).glob("polar-mitm-tls-*")) == before


@pytest.mark.parametrize("version", ["TLSv1_2", "TLSv1_3"])
async def test_a_client_limited_to_one_tls_version_is_answered(make_stack, version):
    """The gateway terminates the harness's TLS itself: a client that speaks only TLS 1.2 (older
    runtimes, some corporate builds) gets its turn as one that speaks TLS 1.3 does."""
    import ssl

    stack = await make_stack()
    ctx = ssl.create_default_context(cafile=str(stack.proxy.ca.cert))
    ctx.minimum_version = ctx.maximum_version = getattr(ssl.TLSVersion, version)
    host, port = stack.proxy.url.removeprefix("http://").split(":")
    async with httpx.AsyncClient(proxy=f"http://tls:tok@{host}:{port}", verify=ctx, timeout=30) as c:
        r = await c.post(URL, json=body([{"role": "user", "content": "hi"}]))
        assert r.status_code == 200, r.text
        tls = r.extensions["network_stream"].get_extra_info("ssl_object")
        assert tls.version() == version.replace("_", ".")  # what the gateway negotiated
    assert [t.session_id for t in read_turns(stack.db)] == ["tls"]
