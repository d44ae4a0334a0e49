"""Requests to provider hosts that are not model calls: telemetry swallowed, probes answered, and
every other endpoint a 404 in the provider's own error shape naming it (an SDK then raises a
not-found error, instead of handing back an empty object)."""

import pytest

from polar_mitm.providers import anthropic, gemini, openai_chat, side_endpoints

UNSERVED = [
    # (url, the SDK call that sends it, how its error is read)
    (
        "https://api.openai.com/v1/embeddings",
        "embeddings.create",
        lambda e: e["error"]["code"] == "not_found",
    ),
    (
        "https://api.openai.com/v1/completions",
        "completions.create",
        lambda e: e["error"]["code"] == "not_found",
    ),
    (
        "https://api.anthropic.com/v1/messages/batches",
        "messages.batches.create",
        lambda e: e["type"] == "error" and e["error"]["type"] == "not_found_error",
    ),
    (
        "https://generativelanguage.googleapis.com/v1beta/models/gemini-2.5-pro:embedContent",
        "embed_content",
        lambda e: e["error"]["status"] == "NOT_FOUND" and e["error"]["code"] == 404,
    ),
]


@pytest.mark.parametrize("url,call,shaped", UNSERVED, ids=[u[1] for u in UNSERVED])
async def test_unserved_endpoints_are_provider_shaped_404s_naming_the_endpoint(make_stack, url, call, shaped):
    stack = await make_stack()
    async with stack.client() as c:
        r = await c.post(url, json={"model": "m", "input": "x"}, headers={"authorization": "Bearer k"})
    assert r.status_code == 404, (call, r.text)
    body = r.json()
    assert shaped(body), body
    path = url.split("googleapis.com", 1)[-1].split(".com", 1)[-1]
    assert path in r.text and "not served by polar-mitm" in r.text


async def test_telemetry_is_swallowed_and_count_tokens_still_answered(make_stack):
    stack = await make_stack()
    async with stack.client() as c:
        r = await c.post("https://api.anthropic.com/api/event_logging/batch", json={"events": []})
        assert (r.status_code, r.json()) == (200, {})
        r = await c.post(
            "https://api.anthropic.com/v1/messages/count_tokens",
            json={"model": "m", "messages": [{"role": "user", "content": "count me"}]},
        )
        assert r.status_code == 200 and r.json()["input_tokens"] > 0
        r = await c.get("https://api.anthropic.com/api/hello")
        assert r.status_code == 200


def test_answer_shapes_by_style_and_side_hosts_swallow_posts():
    for style in (anthropic, openai_chat, gemini):
        status, body, ctype = side_endpoints.answer("POST", "/v1/unknown?x=1", style=style)
        assert status == 404 and b"POST /v1/unknown is not served" in body and ctype == "application/json"
    assert side_endpoints.answer("POST", "/v1/rgstr")[:2] == (200, b"{}")  # a stubbed side host
    assert side_endpoints.answer("GET", "/", style=anthropic)[0] == 200
    assert side_endpoints.answer("GET", "/v1/x", "websocket", style=openai_chat)[0] == 426
