"""How replies come from the backend: streamed (SGLang's cumulative or incremental chunks) or whole
(`backend_stream`), and that every way stores the same ids and logprobs, bit for bit."""

from __future__ import annotations

import json
import sqlite3

import httpx
import pytest
from aiohttp import web

from polar_mitm.backends import sglang
from polar_mitm.backends.engine_api import GenerateState, ids_json
from polar_mitm.backends.engine_client import EngineClient
from polar_mitm.store.reader import read_turns
from tests.support.helpers import BASH, MESSAGES_URL, sse_events

LONG = [{"match": "", "text": " ".join(f"word{i} ünï" for i in range(60))}]


def body(messages, **kw):
    return {"model": "m", "max_tokens": 512, "messages": messages, **kw}


HI = [{"role": "user", "content": "hi"}]


async def backend_requests(stack) -> list[dict]:
    async with httpx.AsyncClient() as c:
        reqs = (await c.get(stack.backend_url + "/_fake/requests")).json()["requests"]
    return [r["body"] for r in reqs if r["path"] == "/generate"]


async def straight(stack, input_ids: list[int]) -> dict:
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.post(
            stack.backend_url + "/generate",
            json={"input_ids": input_ids, "sampling_params": {"max_new_tokens": 512}, "return_logprob": True},
        )
        return r.json()


# --- the pure parts ------------------------------------------------------------------------------


def test_ids_json_and_the_generate_body_are_plain_json():
    assert ids_json([1, 22, 333]) == b"1,22,333" and ids_json([]) == b""
    sent = json.loads(sglang.body(ids_json([5, 6]), {"max_new_tokens": 3}, stream=False))
    assert sent == {
        "input_ids": [5, 6],
        "sampling_params": {"max_new_tokens": 3},
        "return_logprob": True,
        "stream": False,
    }


def chunk(text: str, ids: list[int], lps: list[float], finish=None) -> bytes:
    meta = {
        "output_token_logprobs": [[lp, i, None] for lp, i in zip(lps, ids, strict=True)],
        "finish_reason": finish,
    }
    return json.dumps({"text": text, "output_ids": ids, "meta_info": meta}).encode()


def test_cumulative_and_incremental_chunks_fold_to_the_same_state():
    ids, lps = [11, 12, 13, 14], [-0.5, -0.25, -1.0, -0.125]
    words = ["a", "b", "c", "d"]
    cumulative, incremental = GenerateState(), GenerateState()
    added_c, added_i = [], []
    for k in range(1, 5):
        done = {"type": "stop"} if k == 4 else None
        added_c.append(sglang.fold(cumulative, chunk("".join(words[:k]), ids[:k], lps[:k], done)))
        added_i.append(sglang.fold(incremental, chunk(words[k - 1], ids[k - 1 : k], lps[k - 1 : k], done)))
    for st in (cumulative, incremental):
        assert (st.output_ids, st.output_logprobs, st.text, st.chunks) == (ids, lps, "abcd", 4)
        assert st.finish_reason == {"type": "stop"}
    assert added_c == added_i == words
    assert (cumulative.cumulative, incremental.cumulative) == (True, False)


async def serve_chunks(payloads: list[bytes]):
    """A /generate that streams these SSE payloads in one write (as a fast backend's chunks arrive
    together), then [DONE]."""

    async def generate(request):
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"".join(b"data: " + p + b"\n\n" for p in payloads) + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


@pytest.mark.parametrize("cumulative", [True, False, None])
async def test_chunks_that_arrive_together_come_out_as_one_piece_of_news(cumulative):
    ids = list(range(100, 140))
    lps = [-(i % 7) / 8 for i in range(40)]
    text = [f"t{i} " for i in range(40)]
    if cumulative is False:
        payloads = [chunk(text[k], ids[k : k + 1], lps[k : k + 1]) for k in range(40)]
    else:
        payloads = [chunk("".join(text[: k + 1]), ids[: k + 1], lps[: k + 1]) for k in range(40)]
    payloads[-1] = payloads[-1].replace(b'"finish_reason": null', b'"finish_reason": {"type": "length"}')
    runner, url = await serve_chunks(payloads)
    client = EngineClient(url)
    try:
        gen = client.generate(sglang, [1, 2], {"max_new_tokens": 40}, cumulative=cumulative)
        news = []
        while not (gen.state.finish_reason or gen.finished):
            got = await gen.next(5)
            if got is not None:
                news.append(got)
        await gen.aclose()
    finally:
        await client.close()
        await runner.cleanup()
    assert "".join(news) == "".join(text)
    assert (gen.state.output_ids, gen.state.output_logprobs) == (ids, lps)
    assert len(news) < 40  # coalesced
    if cumulative:
        assert gen.state.chunks < 40  # only the last of the cumulative chunks that came together was parsed


# --- through the proxy ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "backend, policy, streamed",
    [
        ({}, {}, False),  # SGLang's default cumulative chunks: auto asks for the whole reply
        ({"incremental_streaming_output": True}, {}, True),  # auto streams incremental chunks
        ({}, {"backend_stream": "stream"}, True),  # cumulative chunks, streamed on request
        ({"incremental_streaming_output": True}, {"backend_stream": "whole"}, False),
    ],
)
async def test_every_way_of_reading_the_backend_stores_the_same_tokens(make_stack, backend, policy, streamed):
    stack = await make_stack(backend={"script": LONG, **backend}, policy=policy)
    async with stack.client() as c:
        r = await c.post(MESSAGES_URL, json=body(HI, stream=True))
    events = sse_events(r.text)
    assert events[-1][0] == "message_stop"
    text = "".join(d["delta"].get("text", "") for e, d in events if e == "content_block_delta")
    assert text == LONG[0]["text"]
    [sent] = await backend_requests(stack)
    assert sent["stream"] is streamed
    [turn] = list(read_turns(stack.db))
    full = await straight(stack, turn.prompt_ids)
    assert turn.output_ids == full["output_ids"]
    assert turn.output_logprobs == [t[0] for t in full["meta_info"]["output_token_logprobs"]]


async def test_a_whole_reply_keeps_the_harness_alive_with_pings_then_streams_it(make_stack):
    stack = await make_stack(backend={"token_delay": 0.002, "script": LONG})  # ~0.5 s, pings every 0.2 s
    async with stack.client() as c:
        r = await c.post(MESSAGES_URL, json=body(HI, stream=True))
    names = [e for e, _ in sse_events(r.text)]
    assert names[0] == "message_start" and "ping" in names[: names.index("content_block_delta")]
    assert names[-1] == "message_stop"
    assert [s for (s,) in sqlite3.connect(stack.db).execute("SELECT status FROM turns")] == ["ok"]


@pytest.mark.slow
async def test_a_whole_reply_may_take_no_longer_than_the_first_token_timeout(make_stack):
    stack = await make_stack(
        backend={"token_delay": 0.01, "script": LONG}, policy={"first_token_timeout": 0.5}
    )
    async with stack.client() as c:
        r = await c.post(MESSAGES_URL, json=body(HI, stream=True))
    events = sse_events(r.text)
    assert events[-1][0] == "error" and "--first-token-timeout" in events[-1][1]["error"]["message"]
    assert sqlite3.connect(stack.db).execute("SELECT COUNT(*) FROM turns").fetchone() == (
        0,
    )  # nothing arrived


@pytest.mark.parametrize("policy", [{}, {"backend_stream": "stream"}])
async def test_spliced_prompts_sent_from_kept_serialized_ids_are_the_stored_prompts(make_stack, policy):
    script = [{"match": "<tool_response>", "tool_call": {"name": "Bash", "arguments": {"command": "ls"}}}]
    script += [{"match": "", "tool_call": {"name": "Bash", "arguments": {"command": "pwd"}}}]
    stack = await make_stack(backend={"script": script}, policy=policy)
    msgs = [{"role": "user", "content": "go"}]
    async with stack.client() as c:
        for _ in range(4):
            reply = (await c.post(MESSAGES_URL, json=body(msgs, tools=[BASH]))).json()
            use = next(b for b in reply["content"] if b["type"] == "tool_use")
            msgs += [
                {"role": "assistant", "content": reply["content"]},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "a\nb"}],
                },
            ]
    turns = list(read_turns(stack.db))
    assert [t.prompt_ref is not None for t in turns] == [False, True, True, True]  # spliced
    assert [b["input_ids"] for b in await backend_requests(stack)] == [t.prompt_ids for t in turns]


async def test_retried_turns_send_the_stored_prompts_from_their_successors_serialized_ids(make_stack):
    """A turn sent again (a harness's retry: every answer a new branch from the same point), and
    a request that goes back two turns: the turn they splice onto had its serialized ids covered
    by its successor's, and they are read from there."""
    script = [{"match": "", "tool_call": {"name": "Bash", "arguments": {"command": "ls"}}}]
    stack = await make_stack(backend={"script": script})
    msgs = [{"role": "user", "content": "go"}]
    sent = []
    async with stack.client() as c:
        for _ in range(5):
            sent.append(body(list(msgs), tools=[BASH]))
            reply = (await c.post(MESSAGES_URL, json=sent[-1])).json()
            use = next(b for b in reply["content"] if b["type"] == "tool_use")
            msgs += [
                {"role": "assistant", "content": reply["content"]},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "a"}],
                },
            ]
        for again in (sent[-1], sent[-1], sent[2], sent[-1]):
            r = await c.post(MESSAGES_URL, json=again)
            assert r.status_code == 200
        # The conversation goes on from the last retry's answer (a branch of the cache).
        use = next(b for b in r.json()["content"] if b["type"] == "tool_use")
        on = sent[-1]["messages"] + [
            {"role": "assistant", "content": r.json()["content"]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "b"}]},
        ]
        assert (await c.post(MESSAGES_URL, json=body(on, tools=[BASH]))).status_code == 200
    turns = list(read_turns(stack.db))
    assert all(t.prompt_ref is not None for t in turns[1:])  # every one spliced
    assert [b["input_ids"] for b in await backend_requests(stack)] == [t.prompt_ids for t in turns]
    first, retries = turns[4], [turns[5], turns[6], turns[8]]
    assert all(t.prompt_ids == first.prompt_ids for t in retries)
    assert turns[7].prompt_ids == turns[2].prompt_ids
    assert turns[9].prompt_ref == turns[8].id  # spliced onto the retry's answer
    whole = turns[8].prompt_ids + turns[8].output_ids  # read back from the database
    assert turns[9].prompt_ids[: len(whole)] == whole
