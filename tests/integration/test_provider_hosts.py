"""--provider-host HOST=STYLE: a compatible provider host is answered like the built-in ones."""

import pytest

from polar_mitm import providers
from polar_mitm.store.reader import read_turns


async def test_a_declared_host_is_answered_in_its_style_and_recorded(make_stack):
    host = "api.example-compatible.test"
    assert providers.route(host, "POST", "/v1/chat/completions") is None
    stack = await make_stack(provider_hosts={host: "openai"})
    body = {"model": "grok-4", "messages": [{"role": "user", "content": "hi"}]}
    async with stack.client() as c:
        r = await c.post(
            f"https://{host}/v1/chat/completions", json=body, headers={"authorization": "Bearer k"}
        )
        assert r.status_code == 200 and r.json()["object"] == "chat.completion", r.text
        r = await c.post(
            f"https://{host}/v1/responses",
            json={"model": "grok-4", "input": "hi"},
            headers={"authorization": "Bearer k"},
        )
        assert r.status_code == 200 and r.json()["object"] == "response", r.text
        r = await c.post(f"https://{host}/v1/embeddings", json={"input": "x"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"  # in the host's style
    styles = [t.style for t in read_turns(stack.db)]
    assert styles == ["openai-chat", "openai-responses"]
    assert [s.NAME for s in providers.HOST_STYLES[host]] == ["openai-chat", "openai-responses"]


@pytest.mark.parametrize(
    "spec,fragment",
    [
        ("api.x.ai", "is not HOST=STYLE"),
        ("https://api.x.ai=openai", "bare host name"),
        ("api.x.ai=cohere", "is not an API style"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec, fragment):
    with pytest.raises(ValueError, match=fragment):
        providers.parse_provider_host(spec)
    assert providers.parse_provider_host(" API.X.AI = gemini ") == ("api.x.ai", "gemini")
