"""Malformed requests, in every API style: each gets a 400 in the provider's own error shape that
names the field at fault, and writes nothing; nothing unexpected escapes as a bare 500.

The classes below are what fuzzing each style with ~2,000 mutated bodies found (issue 11): JSON
nested 100,000 deep, lone surrogate escapes, and wrong types inside tools and content. Bodies the
property tests (tests/integration/test_fuzz_requests.py) find are kept in tests/integration/fuzz_corpus/.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest

from polar_mitm.neutral import ProviderError
from polar_mitm.providers import STYLES
from tests.support.helpers import VALID_REQUESTS, error_message

CORPUS = Path(__file__).parent / "fuzz_corpus"


def spoil(style: str, edit) -> dict:
    body = copy.deepcopy(VALID_REQUESTS[style])
    edit(body)
    return body


def raw_with(style: str, key: str, raw_value: str) -> bytes:
    """The style's valid body with `key` set to `raw_value`, written as raw JSON text (escapes
    such as `"\\ud800"` stay as the client sent them)."""
    body = copy.deepcopy(VALID_REQUESTS[style])
    body[key] = "@@"
    return json.dumps(body).replace('"@@"', raw_value).encode()


def deep(style: str, depth: int = 100_000) -> bytes:
    return raw_with(style, "x_nested", "[" * depth + "]" * depth)


def _set(path: str, value):
    """An edit that sets body[path] (dotted; list indices as numbers) to value."""

    def edit(body):
        *parents, last = path.split(".")
        node = body
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        node[int(last) if isinstance(node, list) else last] = value

    return edit


A, C, R, G = "anthropic", "openai-chat", "openai-responses", "gemini"
SURROGATE = '"\\ud800"'

# (style, body, what the error message must name)
CASES = [
    # JSON nested 100,000 deep: RecursionError in json.loads
    *[(s, deep(s), "nested") for s in (A, C, R, G)],
    # lone surrogates: UnicodeEncodeError while hashing, TypeError in tokenization, or (in the model
    # name) a generation whose turn could not be stored
    (A, raw_with(A, "messages", '[{"role": "user", "content": "\\ud800"}]'), "messages.0.content"),
    (A, raw_with(A, "model", SURROGATE), "model"),
    (A, raw_with(A, "system", '"a\\udfff b"'), "system"),
    (C, raw_with(C, "messages", '[{"role": "user", "content": "\\ud800"}]'), "messages.0.content"),
    (C, raw_with(C, "model", SURROGATE), "model"),
    (R, raw_with(R, "input", '"hi \\udc00"'), "input"),
    (R, raw_with(R, "model", SURROGATE), "model"),
    (
        G,
        raw_with(G, "contents", '[{"role": "user", "parts": [{"text": "\\ud83d"}]}]'),
        "contents.0.parts.0.text",
    ),
    (A, raw_with(A, "metadata", '{"\\ud800": 1}'), "metadata"),  # a surrogate in a key
    # wrong types inside tools and content
    (A, spoil(A, _set("tools", 5)), "tools"),
    (A, spoil(A, _set("tools", True)), "tools"),
    (A, spoil(A, _set("tools.0.description", 5)), "tools.0.description"),
    (A, spoil(A, _set("tools.0.input_schema", "object")), "tools.0.input_schema"),
    (A, spoil(A, _set("tool_choice", {"type": {}})), "tool_choice.type"),
    (A, spoil(A, _set("messages.0.content.0", {"type": {}})), "messages.0.content.0.type"),
    (C, spoil(C, _set("tools", 5)), "tools"),
    (C, spoil(C, _set("tools", True)), "tools"),
    (C, spoil(C, _set("tools.0.function.description", 5)), "tools.0.function.description"),
    (C, spoil(C, _set("tools.0.function.parameters", "object")), "tools.0.function.parameters"),
    (C, spoil(C, _set("tool_choice", {"type": {}})), "tool_choice"),
    (C, spoil(C, _set("messages.1.content.0", {"type": {}})), "messages.1.content.0.type"),
    (C, spoil(C, _set("messages.4.name", 5)), "messages.4.name"),
    (R, spoil(R, _set("tools", 5)), "tools"),
    (R, spoil(R, _set("tools", True)), "tools"),
    (R, spoil(R, _set("tools.0.description", 5)), "tools.0.description"),
    (R, spoil(R, _set("tools.0.parameters", "object")), "tools.0.parameters"),
    (R, spoil(R, _set("tool_choice", {"type": {}})), "tool_choice.type"),
    (R, spoil(R, _set("input.1.content.0", {"type": {}})), "input.1.content.0.type"),
    (G, spoil(G, _set("tools", 5)), "tools"),
    (G, spoil(G, _set("tools", True)), "tools"),
    (G, spoil(G, _set("tools.0.functionDeclarations.0.description", 5)), "description"),
    (
        G,
        spoil(G, _set("tools.0.functionDeclarations.0.parametersJsonSchema", "object")),
        "parametersJsonSchema",
    ),
    (
        G,
        spoil(G, _set("toolConfig", {"functionCallingConfig": {"mode": {}}})),
        "toolConfig.functionCallingConfig.mode",
    ),
    (G, spoil(G, _set("contents.0.parts.0", {"text": {}})), "contents[0].parts[0].text"),
]


def _id(case) -> str:
    style, body, field = case
    return f"{style}:{field}" + (":deep" if field == "nested" else "")


@pytest.mark.parametrize("style, body, field", CASES, ids=[_id(c) for c in CASES])
async def test_a_bad_body_is_a_400_in_the_styles_shape_naming_the_field(gateway_rig, style, body, field):
    status, ctype, raw = await gateway_rig.post(style, body)
    assert status == 400, raw[:500]
    message = error_message(style, status, ctype, raw)
    assert field in message, message
    assert await gateway_rig.turns() == 0


@pytest.mark.parametrize("style", [A, C, R, G])
async def test_the_valid_bodies_the_bad_ones_are_made_from_are_answered(gateway_rig, style):
    status, _, raw = await gateway_rig.post(style, VALID_REQUESTS[style])
    assert status == 200, raw[:500]
    assert await gateway_rig.turns() == 1


def corpus() -> list[Path]:
    return sorted(CORPUS.glob("*.json"))


@pytest.mark.parametrize("path", corpus(), ids=[p.stem for p in corpus()])
async def test_bodies_that_once_crashed_the_gateway_get_an_answer_in_shape(gateway_rig, path):
    """tests/integration/fuzz_corpus/<style>--<what>.json holds a body, byte for byte, that once got a bare
    500; it must now get a JSON answer in its style's shape (a 400 that stores nothing, or a reply)."""
    style = path.stem.split("--", 1)[0]
    status, ctype, raw = await gateway_rig.post(style, path.read_bytes())
    if status == 200:
        assert await gateway_rig.turns() == 1
        return
    assert 400 <= status < 500, raw[:500]
    error_message(style, status, ctype, raw)
    assert await gateway_rig.turns() == 0


# --- the last-resort handler -----------------------------------------------------------------------


@pytest.mark.parametrize("style", [A, C, R, G])
async def test_an_unexpected_exception_is_the_styles_api_error_and_one_log_line(
    gateway_rig, style, monkeypatch, caplog
):
    async def broken(req, ctx):
        raise KeyError("something nobody expected")
        yield  # an async generator, like the policy's stream

    monkeypatch.setattr(gateway_rig.gateway.policy, "stream", broken)
    with caplog.at_level(logging.ERROR, logger="polar_mitm.proxy.gateway"):
        status, ctype, raw = await gateway_rig.post(style, VALID_REQUESTS[style])
    assert status == 500
    message = error_message(style, status, ctype, raw)
    assert "KeyError" in message and "internal error" in message
    [record] = [r for r in caplog.records if r.name == "polar_mitm.proxy.gateway"]
    assert "\n" not in record.getMessage() and "request req_" in record.getMessage()
    assert record.getMessage().split("request ")[1].split()[0].rstrip(":") in message


async def test_an_unexpected_exception_mid_stream_ends_the_stream_with_the_styles_error(
    gateway_rig, monkeypatch, caplog
):
    from polar_mitm.neutral import Started

    async def broken(req, ctx):
        yield Started(turn_id="turn_0123", prompt_tokens=3)
        raise KeyError("mid-stream")

    monkeypatch.setattr(gateway_rig.gateway.policy, "stream", broken)
    body = {**VALID_REQUESTS[A], "stream": True}
    with caplog.at_level(logging.ERROR, logger="polar_mitm.proxy.gateway"):
        status, _, raw = await gateway_rig.post(A, body)
    assert status == 200
    events = raw.decode().split("\n\n")
    assert events[0].startswith("event: message_start")
    assert "event: error" in events[-2] and "api_error" in events[-2] and "KeyError" in events[-2]
    [record] = [r for r in caplog.records if r.name == "polar_mitm.proxy.gateway"]
    assert "turn_0123" in record.getMessage()


def test_every_style_has_an_api_error_shape():
    for style in STYLES.values():
        status, body = style.render_error(ProviderError("api_error", "x", 500))
        assert status == 500 and "x" in json.dumps(body)
