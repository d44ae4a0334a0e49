"""Prompt rendering and splicing with a real Qwen-family tokenizer."""

import pytest

from polar_mitm.backends.render import conversation_hashes, render_continuation, render_full
from polar_mitm.backends.tokenizer import Tokenizer
from polar_mitm.neutral import Message, Tool, ToolCall

TOOLS = [
    Tool(
        name="Bash",
        description="Run a command",
        parameters={"type": "object", "properties": {"command": {"type": "string"}}},
    )
]


@pytest.fixture(scope="module")
def tok(qwen_tokenizer_dir):
    return Tokenizer.load(qwen_tokenizer_dir)


def conversation():
    call = ToolCall(id="toolu_1", name="Bash", arguments={"command": "echo hi > out.txt"})
    return [
        Message(role="system", content="You are a coding agent."),
        Message(role="user", content="Create out.txt containing hi"),
        Message(role="assistant", content="", tool_calls=[call]),
        Message(role="tool", content="", tool_call_id="toolu_1"),
        Message(role="user", content="<system-reminder>ok</system-reminder>"),
    ]


def sampled(tok, text):
    """What a Qwen model emits for a reply: the text, then <|im_end|>."""
    return tok.encode(text) + [tok.token_id("<|im_end|>")]


def test_splice_equals_canonical_render_when_the_model_wrote_what_the_template_writes(tok):
    msgs = conversation()
    turn1_prompt = render_full(tok, msgs[:2], TOOLS, {})
    out = sampled(
        tok, '<tool_call>\n{"name": "Bash", "arguments": {"command": "echo hi > out.txt"}}\n</tool_call>'
    )
    cont = render_continuation(tok, msgs[3:], out, {})
    spliced = turn1_prompt + out + cont
    assert spliced == render_full(tok, msgs, TOOLS, {})


def test_splice_keeps_sampled_ids_even_when_the_template_would_write_them_differently(tok):
    msgs = conversation()
    turn1_prompt = render_full(tok, msgs[:2], TOOLS, {})
    # The model used odd spacing; the template would re-serialize the JSON.
    out = sampled(
        tok, '<tool_call>\n{"name":"Bash","arguments":{"command":"echo hi > out.txt"}}\n</tool_call>'
    )
    spliced = turn1_prompt + out + render_continuation(tok, msgs[3:], out, {})
    assert spliced[: len(turn1_prompt) + len(out)] == turn1_prompt + out
    assert spliced != render_full(tok, msgs, TOOLS, {})  # canonical history differs: splicing matters


def test_continuation_after_a_truncated_reply_closes_the_turn(tok):
    msgs = conversation()
    out = tok.encode("I will")  # max_tokens hit: no <|im_end|> sampled
    cont = render_continuation(tok, [Message(role="user", content="go on")], out, {})
    assert tok.decode(cont).startswith("<|im_end|>\n<|im_start|>user\ngo on")
    assert msgs  # conversation unused beyond shape


def test_hashes_ignore_ids_and_whitespace_but_not_content():
    a = conversation()
    b = [m.model_copy(deep=True) for m in a]
    b[2].tool_calls[0].id = "toolu_other"
    b[1].content = "Create out.txt containing hi\n"
    assert conversation_hashes(a, TOOLS) == conversation_hashes(b, TOOLS)
    b[1].content = "Create out.txt containing bye"
    assert conversation_hashes(a, TOOLS)[2] != conversation_hashes(b, TOOLS)[2]
    assert conversation_hashes(a, TOOLS)[1] == conversation_hashes(b, TOOLS)[1]
