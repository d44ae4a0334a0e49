"""Claude Code's per-request `x-anthropic-billing-header:` system line is dropped in every style
(claude-code-router keeps it in the system prompt it sends on in Chat Completions, and any proxy
may in another), so two requests that differ only in that line read as the same conversation."""

import pytest

from polar_mitm.providers import anthropic, gemini, openai_chat, openai_responses

LINE = "x-anthropic-billing-header: cc_version=2.1.332.a1b; cc_entrypoint=sdk-cli; cch={};"
PROMPT = "You are Claude Code, Anthropic's official CLI for Claude.\nRun shell commands."
USER = "Create out.txt containing hi"


def chat(system):
    return openai_chat.parse_request(
        {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": USER}]}
    )


def chat_parts(system):  # the router's form: the Anthropic system blocks as text parts
    first, _, rest = system.partition("\n")
    parts = [{"type": "text", "text": first + "\n"}, {"type": "text", "text": rest}]
    return openai_chat.parse_request(
        {"model": "m", "messages": [{"role": "system", "content": parts}, {"role": "user", "content": USER}]}
    )


def responses(system):
    return openai_responses.parse_request({"model": "m", "instructions": system, "input": USER})


def responses_item(system):
    return openai_responses.parse_request(
        {"model": "m", "input": [{"role": "developer", "content": system}, {"role": "user", "content": USER}]}
    )


def gemini_(system):
    return gemini.parse_request(
        {
            "systemInstruction": {"parts": [{"text": system}]},
            "contents": [{"role": "user", "parts": [{"text": USER}]}],
        },
        path="/v1beta/models/gemini-2.5-pro:streamGenerateContent",
    )


def anthropic_(system):
    return anthropic.parse_request(
        {"model": "m", "max_tokens": 9, "system": system, "messages": [{"role": "user", "content": USER}]}
    )


@pytest.mark.parametrize("parse", [chat, chat_parts, responses, responses_item, gemini_, anthropic_])
def test_the_billing_line_is_dropped_in_every_style(parse):
    plain = parse(PROMPT)
    for cch in ("3f2a1", "9c0d4"):
        req = parse(f"{LINE.format(cch)}\n{PROMPT}")
        assert req.messages == plain.messages
        assert "billing" not in req.messages[0].content
