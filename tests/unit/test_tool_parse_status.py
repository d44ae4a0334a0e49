"""Tool-call parse status: every block a tool parser reads is judged ok or by what failed, with
the sampled tokens it spans; one test per failure kind, through the real parsers."""

import pytest

from polar_mitm.backends.parsers import OutputParser
from polar_mitm.backends.tool_parsers import (
    DS_CALL_BEGIN,
    DS_CALL_END,
    DS_CALLS_BEGIN,
    DS_CALLS_END,
    DS_SEP,
    KIMI_ARGS,
    KIMI_CALL_BEGIN,
    KIMI_CALL_END,
    KIMI_SECTION_BEGIN,
    KIMI_SECTION_END,
    PARSE_FAILURES,
)
from polar_mitm.neutral import Tool

BASH = Tool(
    name="Bash",
    parameters={
        "type": "object",
        "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
        "required": ["command"],
        "additionalProperties": False,
    },
)


def status(tool_parser, text, *, per_token=True):
    """Parse `text` fed one character per "token" (so spans are exact), return the status."""
    p = OutputParser(tool_parser, None, tools=[BASH])
    for i, ch in enumerate(text):
        p.feed(ch, tokens=i + 1 if per_token else None)
    p.finish()
    return p.parse_status(), p


def kinds(st):
    return [f["kind"] for f in st["failures"]]


def test_a_good_call_is_ok_and_has_no_failures():
    st, p = status("qwen25", 'Sure. <tool_call>{"name": "Bash", "arguments": {"command": "ls"}}</tool_call>')
    assert st == {"parser": "qwen25", "calls": 1, "failures": []}
    assert p.tool_calls[0].name == "Bash"


def test_invalid_json_with_its_token_span():
    text = 'ok <tool_call>{"name": "Bash", "arguments": {"command": "ls"</tool_call> bye'
    st, p = status("qwen25", text)
    assert kinds(st) == ["invalid_json"]
    start = text.index("<tool_call>")
    end = text.index("</tool_call>") + len("</tool_call>")
    assert st["failures"][0]["span"] == [start, end]
    assert not p.tool_calls and "<tool_call>" in p.text  # the harness gets it as text, as before


def test_an_unclosed_block_cut_off_by_the_token_limit():
    st, _ = status("qwen25", 'I will run it <tool_call>{"name": "Bash", "argu')
    assert kinds(st) == ["unclosed"]


def test_a_call_without_a_name():
    st, _ = status("qwen25", '<tool_call>{"arguments": {"command": "ls"}}</tool_call>')
    assert kinds(st) == ["missing_name"]


def test_a_tool_the_request_did_not_declare():
    st, p = status("qwen25", '<tool_call>{"name": "Bsh", "arguments": {"command": "ls"}}</tool_call>')
    assert kinds(st) == ["unknown_tool"] and st["failures"][0]["name"] == "Bsh"
    assert p.tool_calls[0].name == "Bsh"  # still sent as a call: the harness answers it


@pytest.mark.parametrize(
    "args",
    [
        '{"timeout": 5}',  # a required key missing
        '{"command": 5}',  # a string written as a number
        '{"command": "ls", "cwd": "/"}',  # a key the schema forbids
        '{"command": "ls", "timeout": true}',  # a boolean is no integer
    ],
)
def test_arguments_that_do_not_fit_the_declared_schema(args):
    st, _ = status("qwen25", '<tool_call>{"name": "Bash", "arguments": ' + args + "}</tool_call>")
    assert kinds(st) == ["schema_mismatch"]


def test_arguments_that_are_a_string_but_not_json():
    st, _ = status("qwen25", '<tool_call>{"name": "Bash", "arguments": "ls -la"}</tool_call>')
    assert kinds(st) == ["invalid_json"]


def test_qwen3_coder_without_a_function_name_and_with_a_bad_value_type():
    st, _ = status("qwen3_coder", "<tool_call>\n<function=>\n</function>\n</tool_call>")
    assert kinds(st) == ["missing_name"]
    st, _ = status(
        "qwen3_coder",
        "<tool_call>\n<function=Bash>\n<parameter=command>\nls\n</parameter>\n"
        "<parameter=timeout>\nsoon\n</parameter>\n</function>\n</tool_call>",
    )
    assert kinds(st) == ["schema_mismatch"]  # "soon" is no integer


def test_glm_without_a_name():
    st, _ = status(
        "glm45", "<tool_call>\n<arg_key>command</arg_key>\n<arg_value>ls</arg_value>\n</tool_call>"
    )
    assert kinds(st) == ["missing_name"]


def test_deepseek_and_kimi_invalid_json_and_missing_names():
    ds = DS_CALLS_BEGIN + DS_CALL_BEGIN + "Bash" + DS_SEP + '{"command": ' + DS_CALL_END + DS_CALLS_END
    assert kinds(status("deepseekv31", ds)[0]) == ["invalid_json"]
    ds = DS_CALLS_BEGIN + DS_CALL_BEGIN + DS_SEP + '{"command": "ls"}' + DS_CALL_END + DS_CALLS_END
    assert kinds(status("deepseekv31", ds)[0]) == ["missing_name"]
    kimi = KIMI_SECTION_BEGIN + KIMI_CALL_BEGIN + "functions.Bash:0" + KIMI_ARGS + "{bad" + KIMI_CALL_END
    assert kinds(status("kimi_k2", kimi + KIMI_SECTION_END)[0]) == ["invalid_json"]
    kimi = KIMI_SECTION_BEGIN + KIMI_CALL_BEGIN + "???" + KIMI_ARGS + '{"command": "ls"}' + KIMI_CALL_END
    assert kinds(status("kimi_k2", kimi + KIMI_SECTION_END)[0]) == ["missing_name"]
    ok = KIMI_SECTION_BEGIN + KIMI_CALL_BEGIN + "functions.Bash:0" + KIMI_ARGS + '{"command": "ls"}'
    assert status("kimi_k2", ok + KIMI_CALL_END + KIMI_SECTION_END)[0]["failures"] == []


def test_spans_are_as_fine_as_the_chunks_and_absent_without_token_counts():
    text = 'ab <tool_call>{"name": 1}</tool_call>'
    p = OutputParser("qwen25", None, tools=[BASH])
    p.feed(text[:5], tokens=2)  # the block opens inside this chunk
    p.feed(text[5:], tokens=9)
    p.finish()
    assert p.parse_status()["failures"][0]["span"] == [0, 9]
    st, _ = status("qwen25", text, per_token=False)
    assert st["failures"][0]["span"] is None


def test_no_tool_parser_means_no_status_and_every_kind_is_named():
    p = OutputParser(None, None)
    p.feed("text")
    p.finish()
    assert p.parse_status() is None
    assert set(PARSE_FAILURES) >= {
        "invalid_json",
        "unclosed",
        "missing_name",
        "unknown_tool",
        "schema_mismatch",
    }
