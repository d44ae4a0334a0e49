"""Huge requests: a body over the cap is a 413 in the provider's shape, read no further; a prompt
whose text alone proves it longer than the policy's context is refused before it is tokenized;
long texts are tokenized in worker processes, so the event loop (every other session) keeps
running, and a worker that took a lot of memory gives it back by exiting.

bench/bench_huge_request.py measures the stall and the memory; nothing here is timed.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polar_mitm.backends import large_inputs
from polar_mitm.backends.large_inputs import PooledTokenizer, longest_token_bytes, prompt_tokens_at_least
from polar_mitm.backends.render import render_full
from polar_mitm.backends.tokenizer import Tokenizer
from polar_mitm.neutral import Message
from polar_mitm.store.reader import read_turns
from tests.support.helpers import VALID_REQUESTS, error_message
from tests.support.rig import STYLE_ENDPOINTS, start_gateway_rig

LIMIT = 4000


def body_of(style: str, size: int) -> bytes:
    """The style's valid body padded (with a field every parser ignores) to exactly `size` bytes."""
    import json

    base = json.dumps({**VALID_REQUESTS[style], "x_pad": ""}).encode()
    pad = size - len(base)
    assert pad >= 0
    return base.replace(b'"x_pad": ""', b'"x_pad": "' + b"x" * pad + b'"')


@pytest.fixture
async def capped_rig(tmp_path, qwen_tokenizer_dir):
    rig, close = await start_gateway_rig(tmp_path, qwen_tokenizer_dir, policy={"max_request_bytes": LIMIT})
    yield rig
    await close()


@pytest.mark.parametrize("style", sorted(STYLE_ENDPOINTS))
async def test_a_body_over_the_cap_is_a_413_in_the_styles_shape(capped_rig, style):
    status, ctype, raw = await capped_rig.post(style, body_of(style, LIMIT + 1))
    assert status == 413
    message = error_message(style, status, ctype, raw)
    assert f"{LIMIT + 1:,} bytes" in message and "--max-request-bytes" in message
    status, _, raw = await capped_rig.post(style, body_of(style, LIMIT))
    assert status == 200, raw[:300]
    assert await capped_rig.turns() == 1


async def test_a_chunked_body_over_the_cap_is_cut_off_with_a_413(capped_rig):
    data = body_of("anthropic", 3 * LIMIT)

    async def chunks():
        for i in range(0, len(data), 1000):
            yield data[i : i + 1000]

    host, path = STYLE_ENDPOINTS["anthropic"]
    r = await capped_rig.client.post(path, data=chunks(), headers={"x-polar-host": host})
    raw = await r.read()
    assert r.status == 413
    assert f"more than {LIMIT:,} bytes" in error_message("anthropic", 413, r.headers["content-type"], raw)
    assert await capped_rig.turns() == 0


def test_the_body_cap_is_an_option_of_every_policy_command():
    from click.testing import CliRunner

    from polar_mitm.cli import main

    for command in ("run", "proxy"):
        out = CliRunner().invoke(main, [command, "--help"]).output
        assert "--max-request-bytes" in out


# --- what cannot fit is refused before it is tokenized --------------------------------------------


async def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(
    tmp_path, qwen_tokenizer_dir, monkeypatch
):
    rig, close = await start_gateway_rig(tmp_path, qwen_tokenizer_dir, backend={"context_length": 4096})
    try:
        status, _, _ = await rig.post("anthropic", VALID_REQUESTS["anthropic"])  # tokenizer loaded
        assert status == 200
        encoded: list[int] = []
        original = Tokenizer.encode
        monkeypatch.setattr(
            Tokenizer, "encode", lambda self, text: encoded.append(len(text)) or original(self, text)
        )
        body = {**VALID_REQUESTS["anthropic"], "messages": [{"role": "user", "content": "word " * 120_000}]}
        for style, b in (
            ("anthropic", body),
            ("openai-responses", {**VALID_REQUESTS["openai-responses"], "input": "word " * 120_000}),
        ):
            status, ctype, raw = await rig.post(style, b)
            assert status == 400
            message = error_message(style, status, ctype, raw)
            assert message.startswith("prompt is too long: at least 4688 tokens > 4095 maximum"), message
        assert max(encoded, default=0) < 1000  # the 600,000 characters were never tokenized
        assert await rig.turns() == 1
    finally:
        await close()


def test_no_token_stands_for_more_bytes_than_the_longest(qwen_tokenizer_dir):
    tok = Tokenizer.load(qwen_tokenizer_dir)
    assert longest_token_bytes(tok) == 128  # Qwen's longest: 128 spaces
    for text in (
        " " * 10_000,
        "-" * 5000 + "=" * 5000,
        "word " * 2000,
        "日本語のテキスト" * 500,
        "🙂" * 1000,
    ):
        tokens, size = prompt_tokens_at_least([Message(role="user", content=text)], longest_token_bytes(tok))
        assert size == len(text.encode()) and len(tok.encode(text)) >= tokens


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(text=st.text(min_size=1, max_size=400) | st.sampled_from([" " * 300, "\n" * 300, "ab" * 200]))
def test_the_bound_never_exceeds_the_real_count(qwen_tokenizer_dir, text):
    tok = Tokenizer.load(qwen_tokenizer_dir)
    messages = [Message(role="system", content=text), Message(role="user", content=text * 3)]
    tokens, _ = prompt_tokens_at_least(messages, longest_token_bytes(tok))
    assert len(render_full(tok, messages, [], {})) >= tokens


# --- long texts in worker processes ---------------------------------------------------------------


@pytest.fixture
def pooled_tiny(tiny_tokenizer_dir):
    tok = Tokenizer.load(tiny_tokenizer_dir)
    return tok, PooledTokenizer(tok, long_text=1000, recycle_text=50_000)


def _text(n: int) -> str:
    rng = random.Random(n)
    words = ["alpha", "beta", "<|im_end|>", "\n", "  ", "日本", "🙂", "x=1;", "the"]
    return "".join(rng.choice(words) + " " for _ in range(n // 4))[:n]


def test_long_texts_are_encoded_in_a_worker_to_the_same_ids(pooled_tiny):
    tok, pooled = pooled_tiny
    before = pooled.pool.encoded
    for n in (10, 1000, 1001, 20_000):
        assert pooled.encode(_text(n)) == tok.encode(_text(n))
    assert pooled.pool.encoded - before == 2  # the two longer than 1,000 characters
    assert pooled.vocab_size == tok.vocab_size and pooled.path == tok.path  # the rest is tok's


def test_a_worker_that_took_a_long_text_exits_and_gives_its_memory_back(pooled_tiny):
    _, pooled = pooled_tiny
    pooled.encode(_text(2000))
    assert pooled.pool.idle() == 1  # kept warm for the next long text
    [warm] = pooled.pool._idle
    started = pooled.pool.started
    pooled.encode(_text(60_000))  # over recycle_text: the worker that took it exits
    assert pooled.pool.idle() == 0 and not warm.alive()
    pooled.encode(_text(2000))
    assert pooled.pool.started == started + 1 and pooled.pool.idle() == 1


@pytest.mark.slow
async def test_the_event_loop_runs_while_a_long_text_is_tokenized(qwen_tokenizer_dir):
    tok = Tokenizer.load(qwen_tokenizer_dir)
    pooled = PooledTokenizer(tok)
    pooled.encode(_text(large_inputs.LONG_TEXT + 1))  # a warm worker
    text = "the quick brown fox jumps over the lazy dog\n" * 40_000  # 1.8 MB: ~1 s to tokenize
    ticks = 0
    job = asyncio.ensure_future(asyncio.to_thread(pooled.encode, text))
    while not job.done():
        await asyncio.sleep(0.005)
        ticks += 1
    assert len(await job) > 100_000
    # In-process the tokenizer holds the GIL for the whole second: the loop would tick once or twice.
    assert ticks > 20, ticks


@pytest.mark.slow
async def test_a_long_prompt_that_fits_is_answered_with_the_ids_tokenized_in_a_worker(
    gateway_rig, qwen_tokenizer_dir
):
    long = "the quick brown fox jumps over the lazy dog\n" * 2000  # 88,000 characters
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": long}]}
    status, _, raw = await gateway_rig.post("anthropic", body)
    assert status == 200, raw[:300]
    tok = Tokenizer.load(qwen_tokenizer_dir)
    [turn] = list(read_turns(gateway_rig.store.path))
    expected = render_full(tok, [Message(role="user", content=long)], [], {})
    assert turn.prompt_ids == expected
    assert (await gateway_rig.gateway.policy.tokenizer()).pool.encoded >= 1
