"""Every API style is one module implementing one protocol (held to it by the type checker), read
and written through one SSE reader and writer, and parses an upstream's reply the way it parses
the same reply echoed in a request."""

from __future__ import annotations

from pathlib import Path

import pytest

from polar_mitm import providers, sse
from polar_mitm.neutral import Message, ProviderError
from polar_mitm.providers import anthropic, gemini, openai_chat, openai_responses
from tests.support.helpers import COMPLETION

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_every_style_module_implements_the_style_protocol_by_type():
    """mypy checks each module in `providers.STYLES` against `Style` (signatures included)."""
    api = pytest.importorskip("mypy.api", reason="the type check needs mypy (the test extra)")
    out, err, rc = api.run(
        [
            "--follow-imports=silent",
            "--ignore-missing-imports",
            "--no-incremental",
            "--cache-dir=/dev/null",
            str(ROOT / "polar_mitm" / "providers" / "__init__.py"),
        ]
    )
    assert rc == 0, out + err


def test_the_registry_is_built_once_with_the_recipes_hosts():
    assert set(providers.STYLES) == {"anthropic", "gemini", "openai-chat", "openai-responses"}
    assert providers.HOST_STYLES["chatgpt.com"] == (openai_responses,)  # from the Codex recipe
    assert providers.HOST_STYLES["api.openai.com"] == (openai_chat, openai_responses)
    assert providers.route("chatgpt.com", "POST", "/backend-api/codex/responses") == (
        openai_responses,
        "generate",
    )
    with pytest.raises(TypeError):
        providers.HOST_STYLES["example.com"] = (anthropic,)  # type: ignore[index]


def test_the_sse_reader_joins_data_lines_and_skips_comments():
    text = ': keep-alive\r\nevent: a\r\ndata: {"x":\r\ndata: 1}\r\n\r\nid: 7\ndata: [DONE]\n\n'
    assert sse.parse(text) == [sse.SSEEvent("a", '{"x":\n1}'), sse.SSEEvent(None, "[DONE]")]
    assert sse.json_events(text.encode()) == [("a", {"x": 1})]


def test_the_sse_writer_reads_back():
    for eol in ("\n", "\r\n"):
        raw = (
            sse.encode({"type": "x", "n": "é"}, event="x", eol=eol)
            + sse.comment("ping")
            + sse.encode("[DONE]")
        )
        assert sse.json_events(raw) == [("x", {"type": "x", "n": "é"})]


def test_what_orjson_will_not_write_is_still_an_event_that_reads_back():
    """An integer past 64 bits, a key that is not a string, a lone surrogate: written by `json`."""
    data = {"n": 2**70, "t": "é\ud800", 1: "k"}
    raw = sse.encode(data, event="x")
    raw.decode()  # the bytes are UTF-8
    assert sse.json_events(raw) == [("x", {"n": 2**70, "t": "é\ud800", "1": "k"})]
    assert sse.json_events(sse.encode({"lp": float("nan")})) == [(None, {"lp": None})]


def test_the_stream_reader_reads_what_parse_reads_whatever_the_chunking():
    """`sse.Reader` (the engine client's and the live viewer's) gives, chunk by chunk, the events
    `parse` gives for the whole body: cut anywhere, inside a line, a `\\n\\n`, or a UTF-8 character."""
    raw = (
        sse.comment("ping")
        + sse.encode({"text": "é€", "n": 1}, event="a")
        + sse.encode({"text": "x"})
        + b"data: line one\ndata: line two\n\n"
        + sse.encode("[DONE]")
    )
    whole = sse.parse(raw.decode())
    assert len(whole) == 4
    for step in (1, 2, 3, 7, len(raw)):
        events, payloads = sse.Reader(), sse.Reader()
        got: list[sse.SSEEvent] = []
        data: list[bytes] = []
        for i in range(0, len(raw), step):
            got += events.feed(raw[i : i + step])
            data += payloads.data(raw[i : i + step])
        assert got == whole, step
        assert data == [p for e in whole for p in e.data.encode().split(b"\n")], step
    assert sse.Reader().feed(b"data: no end yet\n") == []


@pytest.mark.parametrize("style", [anthropic, gemini, openai_chat, openai_responses], ids=lambda s: s.NAME)
def test_a_rendered_reply_parses_back_to_the_completion(style):
    messages, finish = style.parse_reply(style.render_response(COMPLETION, None))
    assert finish == "tool_calls"
    [msg] = messages
    assert (msg.content, msg.reasoning) == (COMPLETION.text, COMPLETION.reasoning)
    assert [(c.name, c.arguments) for c in msg.tool_calls] == [("Bash", {"command": "ls -la"})]


MALFORMED = {
    anthropic: {"content": ["junk", {"type": "tool_use"}, {"type": "text", "text": "ok"}]},
    openai_chat: {
        "choices": [
            {"message": {"content": "ok", "tool_calls": ["junk", {"function": {}}]}, "finish_reason": "stop"}
        ]
    },
    openai_responses: {
        "output": [
            "junk",
            {"type": "function_call"},
            {"type": "message", "content": [{"type": "output_text", "text": "ok"}]},
        ]
    },
    gemini: {"candidates": [{"content": {"parts": ["junk", {"functionCall": {}}, {"text": "ok"}]}}]},
}


@pytest.mark.parametrize("style", list(MALFORMED), ids=lambda s: s.NAME)
def test_a_malformed_upstream_reply_is_refused_strictly_and_read_leniently(style):
    with pytest.raises(ProviderError):
        style.parse_reply(MALFORMED[style])
    assert style.parse_reply(MALFORMED[style], lenient=True) == (
        [Message(role="assistant", content="ok")],
        "stop",
    )
