"""Stateful Responses clients (OpenClaw) through the real proxy: the second request carries only
`previous_response_id` and the new input, and the proxy continues the stored conversation with
the exact splice a stateless client gets; what it cannot continue is refused as OpenAI does."""

from __future__ import annotations

import httpx

from polar_mitm.proxy.continuations import Continuations
from polar_mitm.store.reader import read_turns
from tests.support.helpers import sse_events

URL = "https://api.openai.com/v1/responses"
EXEC = {
    "type": "function",
    "name": "exec_command",
    "description": "Runs a command",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
}
FIRST = [
    {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": "Create out.txt containing hi"}],
    }
]


def openclaw_like(input_items, **kw):
    return {
        "model": "gpt-5.5",
        "instructions": "You are a personal assistant running inside OpenClaw.",
        "input": input_items,
        "tools": [EXEC],
        "store": True,
        "stream": True,
        **kw,
    }


def client(stack, session: str | None = None) -> httpx.AsyncClient:
    proxy = stack.proxy.session_url(session) if session else stack.proxy.url
    return httpx.AsyncClient(proxy=proxy, verify=str(stack.proxy.ca.cert), timeout=30)


async def first_turn(stack) -> tuple[str, dict]:
    """(response id, its function call) of a first, streamed request."""
    async with client(stack) as c:
        r = await c.post(URL, json=openclaw_like(FIRST), headers={"authorization": "Bearer sk-test"})
    assert r.status_code == 200, r.text
    done = sse_events(r.content)[-1]
    assert done[0] == "response.completed" and done[1]["response"]["store"] is True
    [call] = [i for i in done[1]["response"]["output"] if i["type"] == "function_call"]
    return done[1]["response"]["id"], call


async def test_a_continued_response_splices_exactly(make_stack):
    stack = await make_stack()
    resp1, call = await first_turn(stack)
    result = [{"type": "function_call_output", "call_id": call["call_id"], "output": ""}]
    async with client(stack) as c:
        r2 = await c.post(URL, json=openclaw_like(result, previous_response_id=resp1, stream=False))
        assert r2.status_code == 200, r2.text
        assert r2.json()["previous_response_id"] == resp1 and r2.json()["store"] is True
        [msg] = [i for i in r2.json()["output"] if i["type"] == "message"]
        assert msg["content"][0]["text"] == "Done. The command finished."
        # A third turn continues the second (whose own request was a continuation).
        more = [{"type": "message", "role": "user", "content": "and now?"}]
        r3 = await c.post(URL, json=openclaw_like(more, previous_response_id=r2.json()["id"], stream=False))
        assert r3.status_code == 200, r3.text
    t1, t2, t3 = list(read_turns(stack.db))
    assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.output_ids)] == t1.prompt_ids + t1.output_ids
    assert len(t2.prompt_ids) > len(t1.prompt_ids) + len(t1.output_ids)  # + the tool result's rendering
    assert t2.prompt_ref == t1.id
    assert t3.prompt_ids[: len(t2.prompt_ids) + len(t2.output_ids)] == t2.prompt_ids + t2.output_ids
    assert t3.prompt_ref == t2.id
    # After a restart nothing is remembered: the chain is read back from the store, alike.
    warm = await stack.proxy.gateway.continuations.history("s-test", r2.json()["id"])
    cold = await Continuations(stack.proxy.store).history("s-test", r2.json()["id"])
    assert cold == warm and [i.get("type") for i in cold][-2:] == ["function_call_output", "message"]


async def test_a_continuation_equals_the_stateless_request(make_stack):
    """The conversation rebuilt for previous_response_id is what a stateless client sends."""
    stack = await make_stack()
    resp1, call = await first_turn(stack)
    history = await stack.proxy.gateway.continuations.history("s-test", resp1)
    assert history[: len(FIRST)] == FIRST
    assert call in history[len(FIRST) :]  # the output items, as the stream gave them


async def refused(stack, resp_id, session=None) -> dict:
    result = [{"type": "function_call_output", "call_id": "call_x", "output": ""}]
    async with client(stack, session) as c:
        r = await c.post(URL, json=openclaw_like(result, previous_response_id=resp_id, stream=False))
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "previous_response_id"
    assert err["code"] == "previous_response_not_found"
    return err


async def test_responses_it_cannot_continue_are_refused_as_openai_does(make_stack):
    stack = await make_stack()
    resp1, _ = await first_turn(stack)
    assert "gave no such response" in (await refused(stack, "resp_19a0b1c2d3e4f5a6b7c8d9e0"))["message"]
    assert "no response of that form" in (await refused(stack, "chatcmpl-123"))["message"]
    # Another session's response: its conversation is not this session's to continue.
    assert "not a response of this session" in (await refused(stack, resp1, session="other"))["message"]
    assert len(list(read_turns(stack.db))) == 1


async def test_a_previous_response_that_failed_is_refused(make_stack):
    stack = await make_stack()
    resp1, _ = await first_turn(stack)
    await stack.proxy.store.write(("UPDATE turns SET status = 'aborted'", ()))
    stack.proxy.gateway.continuations = Continuations(stack.proxy.store)  # as after a restart
    assert "ended aborted" in (await refused(stack, resp1))["message"]
