"""The policy's one room for "the prompt is longer than the context" and for a reply's
max_tokens (`polar_mitm.policy.admission`): the rule both backend modes take, and the refusal's
words. Its bounds read from text and body are tested on the real tokenizer in
tests/integration/test_huge_inputs.py."""

from __future__ import annotations

import pytest

from polar_mitm.backends.engine_client import EngineClient
from polar_mitm.backends.engines import EnginePool
from polar_mitm.neutral import ChatRequest, Message, ProviderError, Sampling
from polar_mitm.policy.admission import Admission
from polar_mitm.policy.config import PolicyConfig
from polar_mitm.policy.discovery import Discovery


def admission(**config) -> Admission:
    cfg = PolicyConfig(**config)
    client = EngineClient(cfg.backend_url)  # asked nothing: the context length is configured
    return Admission(cfg, Discovery(cfg, client, EnginePool(cfg.backend_urls, client.alive)))


def request(max_tokens: int | None = None, text: str = "hi") -> ChatRequest:
    return ChatRequest(
        style="anthropic",
        model="m",
        messages=[Message(role="user", content=text)],
        sampling=Sampling(max_tokens=max_tokens),
    )


def test_max_tokens_is_what_was_asked_else_the_default_at_most_the_cap_and_what_the_context_leaves():
    a = admission(default_max_tokens=4096, max_tokens_cap=8192)
    assert a.max_tokens(request()) == 4096
    assert a.max_tokens(request(100)) == 100
    assert a.max_tokens(request(64_000)) == 8192  # Claude Code asks for 32k-64k
    assert a.max_tokens(request(64_000), prompt_tokens=30_000, context=32_768) == 2768
    assert admission().max_tokens(request(64_000)) == 64_000  # no cap, no context known


async def test_the_budget_fits_the_reply_in_the_context_and_refuses_a_prompt_that_fills_it():
    a = admission(context_length=4096, max_tokens_cap=1000)
    assert await a.budget(request(), 100) == 1000
    assert await a.budget(request(), 3500) == 596
    with pytest.raises(ProviderError) as e:
        await a.budget(request(), 4096)
    assert (e.value.kind, e.value.status) == ("invalid_request", 400)
    assert e.value.message == "prompt is too long: 4096 tokens > 4095 maximum of the policy"


async def test_chat_mode_is_admitted_by_the_engine_itself():
    a = admission(context_length=16, backend_mode="chat", tokenizer="/no/such/tokenizer")
    long = "word " * 1000
    await a.text(request(text=long))  # neither reads a tokenizer (there is none)
    await a.body(('{"messages": [{"role": "user", "content": "' + long + '"}]}').encode())
