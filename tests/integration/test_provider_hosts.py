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
    assert [s.NAME for s in stack.proxy.routes.styles(host)] == ["openai-chat", "openai-responses"]
    assert host not in providers.BUILTIN  # this proxy's host, not the process's


async def test_two_proxies_in_one_process_each_answer_only_their_own_hosts(make_stack):
    """Each proxy routes by the table it built from its own --provider-hosts: starting a second
    one with other hosts neither adds them to the first nor takes the first's away. (Asked of
    each proxy's gateway directly: mitmproxy hands every connection in a process to its newest
    master, so two proxies' listeners cannot be told apart in one process.)"""
    import httpx

    from polar_mitm.proxy.gateway import HOST_HEADER, SECRET_HEADER, SESSION_HEADER

    hosts = {"a": "api.a-compatible.test", "b": "api.b-compatible.test"}
    a = await make_stack(provider_hosts={hosts["a"]: "openai"})
    b = await make_stack(provider_hosts={hosts["b"]: "anthropic"})
    assert [s.NAME for s in a.proxy.routes.styles(hosts["a"])] == ["openai-chat", "openai-responses"]
    assert [s.NAME for s in b.proxy.routes.styles(hosts["b"])] == ["anthropic"]
    assert hosts["a"] not in providers.BUILTIN and hosts["b"] not in providers.BUILTIN
    calls = {
        "a": ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        "b": (
            "/v1/messages",
            {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]},
        ),
    }
    for name, stack, other in (("a", a, "b"), ("b", b, "a")):
        proxy = stack.proxy
        assert hosts[name] in proxy.routes and hosts[other] not in proxy.routes, name
        assert proxy.gateway.routes is proxy.routes and proxy.side.routing.routes is proxy.routes, name
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{proxy.gateway.port}", timeout=30) as c:
            for host, expect in ((hosts[name], 200), (hosts[other], 404)):
                path, body = calls[name if expect == 200 else other]
                headers = {HOST_HEADER: host, SECRET_HEADER: proxy.gateway.secret, SESSION_HEADER: "s-test"}
                r = await c.post(path, json=body, headers=headers)
                assert r.status_code == expect, (name, host, r.text)
    assert [t.style for t in read_turns(a.db)] == ["openai-chat"]
    assert [t.style for t in read_turns(b.db)] == ["anthropic"]


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
