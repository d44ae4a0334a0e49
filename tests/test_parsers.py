"""Output parsing: reasoning, text and qwen25 tool calls, fed in arbitrary chunks."""

import pytest

from polar_mitm.backends.parsers import OutputParser
from polar_mitm.neutral import ReasoningDelta, TextDelta, ToolCallEvent

SAMPLE = (
    "<think>\nI should list files.\n</think>\n\nLet me look.\n"
    '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls -la"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "Read", "arguments": {"path": "a.txt"}}\n</tool_call>'
)


def run(text: str, sizes: int) -> OutputParser:
    p = OutputParser("qwen25", "qwen3")
    events = []
    for i in range(0, len(text), sizes):
        events += p.feed(text[i : i + sizes])
    events += p.finish()
    p.events = events
    return p


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_chunking_does_not_change_the_result(size):
    p = run(SAMPLE, size)
    assert p.reasoning == "I should list files."
    assert p.text == "Let me look."
    assert [(c.name, c.arguments) for c in p.tool_calls] == [
        ("Bash", {"command": "ls -la"}),
        ("Read", {"path": "a.txt"}),
    ]
    assert "".join(e.text for e in p.events if isinstance(e, TextDelta)) == "Let me look."
    assert "".join(e.text for e in p.events if isinstance(e, ReasoningDelta)) == p.reasoning
    assert sum(isinstance(e, ToolCallEvent) for e in p.events) == 2


def test_plain_text_keeps_inner_whitespace_and_angle_brackets():
    p = run("a < b and <tool is not a tag\n\nnext line  ", 1)
    assert p.text == "a < b and <tool is not a tag\n\nnext line"
    assert p.tool_calls == []


def test_invalid_tool_json_falls_back_to_text():
    p = run("<tool_call>\nnot json\n</tool_call>", 4)
    assert p.tool_calls == []
    assert "not json" in p.text


def test_unclosed_tool_call_at_end_is_parsed_when_valid():
    p = run('<tool_call>\n{"name": "Bash", "arguments": {"command": "pwd"}}\n', 5)
    assert [c.name for c in p.tool_calls] == ["Bash"]


def test_generation_prompt_that_opens_reasoning():
    p = OutputParser("qwen25", "qwen3", in_reasoning=True)
    p.feed("deep thought</think>\n\nanswer")
    p.finish()
    assert (p.reasoning, p.text) == ("deep thought", "answer")


def test_no_parsers_means_everything_is_text():
    p = OutputParser(None, None)
    p.feed("<think>x</think><tool_call>{}</tool_call>")
    p.finish()
    assert p.text == "<think>x</think><tool_call>{}</tool_call>"


def test_tool_call_ids_use_the_provider_prefix():
    p = OutputParser("qwen25", None, id_prefix="toolu_")
    p.feed('<tool_call>{"name": "X", "arguments": {}}</tool_call>')
    p.finish()
    assert p.tool_calls[0].id.startswith("toolu_")


def test_unknown_parser_names_are_refused():
    with pytest.raises(ValueError, match="unknown tool parser"):
        OutputParser("nope", None)


@pytest.mark.parametrize("size", [1, 3, 100])
def test_reasoning_keeps_inner_blank_lines_and_drops_the_outer_ones(size):
    p = run("<think>\n\nstep one\n\nstep two\n\n</think>\n\nanswer", size)
    assert p.reasoning == "step one\n\nstep two"
    assert "".join(e.text for e in p.events if isinstance(e, ReasoningDelta)) == p.reasoning
    assert p.text == "answer"
