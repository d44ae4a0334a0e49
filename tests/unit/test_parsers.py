"""Output parsing: reasoning, text and tool calls in every format whose SGLang parser name we
accept, fed in arbitrary chunks; names we do not implement are refused."""

import asyncio
import random

import pytest
from click.testing import CliRunner

from polar_mitm.backends.engine_api import ModelInfo
from polar_mitm.backends.parsers import REASONING_PARSERS, TOOL_PARSERS, OutputParser
from polar_mitm.neutral import ProviderError, ReasoningDelta, TextDelta, Tool, ToolCallEvent
from polar_mitm.policy import Policy, PolicyConfig

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


# --- every accepted name, on the text format SGLang's parser of that name reads -----------------
# Formats from sglang python/sglang/srt/function_call/*_detector.py and
# python/sglang/srt/parser/reasoning_parser.py. DeepSeek's markers use U+FF5C (｜) and U+2581 (▁).

DS_V3_CALL = (
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_current_weather\n```json\n"
    '{"location": "%s"}\n```<｜tool▁call▁end｜>'
)
WEATHER = [("get_current_weather", {"location": "Tokyo"}), ("get_current_weather", {"location": "Paris"})]

# (tool parser, reasoning parser, output text, reasoning, text, [(name, arguments)])
FORMATS = [
    pytest.param("qwen25", "qwen3", SAMPLE, "I should list files.", "Let me look.",
                 [("Bash", {"command": "ls -la"}), ("Read", {"path": "a.txt"})], id="qwen25+qwen3"),
    pytest.param("qwen", "qwen3-thinking",
                 'I should list files.\n</think>\n\n<tool_call>\n{"name": "Bash", "arguments": {"command": "ls"}}\n</tool_call>',
                 "I should list files.", "", [("Bash", {"command": "ls"})], id="qwen+qwen3-thinking"),
    pytest.param("hermes", None, '<tool_call>{"name": "Bash", "arguments": {"command": "ls"}}</tool_call>',
                 "", "", [("Bash", {"command": "ls"})], id="hermes"),
    pytest.param(
        "qwen3_coder", "qwen3",
        "<think>\nI should list files.\n</think>\n\nLet me look.\n<tool_call>\n<function=Bash>\n"
        "<parameter=command>\nls -la\n</parameter>\n<parameter=description>\nList\nfiles\n</parameter>\n"
        "</function>\n</tool_call>\n<tool_call>\n<function=Read>\n<parameter=path>\na.txt\n</parameter>\n"
        "</function>\n</tool_call>",
        "I should list files.", "Let me look.",
        [("Bash", {"command": "ls -la", "description": "List\nfiles"}), ("Read", {"path": "a.txt"})],
        id="qwen3_coder+qwen3",
    ),
    pytest.param(
        "glm45", "glm45",
        "<think>I should check the weather.</think>Let me check.<tool_call>get_weather\n"
        "<arg_key>city</arg_key>\n<arg_value>北京</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
        "</tool_call><tool_call>get_time\n</tool_call>",
        "I should check the weather.", "Let me check.",
        [("get_weather", {"city": "北京", "days": 3}), ("get_time", {})],
        id="glm45+glm45",
    ),
    pytest.param(
        "glm45", "glm45",  # a tool call before </think> ends the reasoning (SGLang's Glm45Detector)
        '<think>Need the weather<tool_call>get_weather\n<arg_key>opts</arg_key>\n<arg_value>{"units": "C"}</arg_value>\n</tool_call>',
        "Need the weather", "", [("get_weather", {"opts": {"units": "C"}})],
        id="glm45-tool-call-ends-reasoning",
    ),
    pytest.param(
        "glm", None,
        "<tool_call>get_weather\\n<arg_key>city</arg_key>\\n<arg_value>Paris</arg_value>\\n</tool_call>",
        "", "", [("get_weather", {"city": "Paris"})], id="glm-literal-backslash-n",
    ),
    pytest.param(
        "glm47", "glm45",
        "<think>Two cities.</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>北京</arg_value>"
        "<arg_key>date</arg_key><arg_value>2024-06-27</arg_value></tool_call>",
        "Two cities.", "", [("get_weather", {"city": "北京", "date": "2024-06-27"})], id="glm47",
    ),
    pytest.param(
        "deepseekv3", "deepseek-r1",  # R1 may not write <think>: its output starts inside the block
        "I need the weather.\n</think>\n\nLet me check.<｜tool▁calls▁begin｜>" + DS_V3_CALL % "Tokyo"
        + "\n" + DS_V3_CALL % "Paris" + "<｜tool▁calls▁end｜>",
        "I need the weather.", "Let me check.", WEATHER, id="deepseekv3+deepseek-r1",
    ),
    pytest.param(
        "deepseek-v3", "deepseek-v3",
        "<think>Weather.</think>Checking.<｜tool▁calls▁begin｜>" + DS_V3_CALL % "Tokyo" + "<｜tool▁calls▁end｜>",
        "Weather.", "Checking.", WEATHER[:1], id="deepseek-v3+deepseek-v3",
    ),
    pytest.param(
        "deepseekv31", "deepseek-v3",
        "<think>Weather.</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_current_weather<｜tool▁sep｜>"
        '{"location": "Tokyo"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_current_weather<｜tool▁sep｜>'
        '{"location": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "Weather.", "", WEATHER, id="deepseekv31",
    ),
    pytest.param(
        "kimi_k2", "kimi_k2",
        "<think>I should check the weather before answering.</think>Let me look."
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"location": "NYC"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>'
        '{"timezone":"EST"}<|tool_call_end|><|tool_calls_section_end|>',
        "I should check the weather before answering.", "Let me look.",
        [("get_weather", {"location": "NYC"}), ("get_time", {"timezone": "EST"})], id="kimi_k2+kimi_k2",
    ),
    pytest.param(
        "kimi_k2", "kimi_k2",  # K2 may open its tool section before </think> (SGLang's KimiK2Detector)
        "<think>Check NYC\n<|tool_calls_section_begin|>\n<|tool_call_begin|> functions.get_weather:0 "
        '<|tool_call_argument_begin|> {"location": "NYC"} <|tool_call_end|>\n<|tool_calls_section_end|>',
        "Check NYC", "", [("get_weather", {"location": "NYC"})], id="kimi_k2-section-ends-reasoning",
    ),
    pytest.param("none", "kimi", "◁think▷This is Kimi reasoning◁/think▷Here's my conclusion.",
                 "This is Kimi reasoning", "Here's my conclusion.", [], id="kimi-reasoning"),
]  # fmt: skip


def parse(tool_parser, reasoning_parser, chunks, **kw):
    p = OutputParser(tool_parser, reasoning_parser, **kw)
    events = [e for c in chunks for e in p.feed(c)] + p.finish()
    calls = [(c.name, c.arguments) for c in p.tool_calls]
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == p.reasoning
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == p.text
    assert [(e.call.name, e.call.arguments) for e in events if isinstance(e, ToolCallEvent)] == calls
    return p.reasoning, p.text, calls


def splits(text: str, seed: int = 0):
    """The text whole, cut at every position (markers split included), char by char, and cut at random."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)
    rnd = random.Random(seed)
    for _ in range(30):
        cuts = sorted(rnd.sample(range(1, len(text)), min(len(text) - 1, rnd.randint(2, 12))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize(("tool_parser", "reasoning_parser", "text", "reasoning", "answer", "calls"), FORMATS)
def test_each_format_gives_the_same_result_however_the_text_is_cut(
    tool_parser, reasoning_parser, text, reasoning, answer, calls
):
    for chunks in splits(text):
        assert parse(tool_parser, reasoning_parser, chunks) == (reasoning, answer, calls), chunks


def test_every_accepted_name_has_a_format_test():
    tested = {p.values[0] for p in FORMATS} | {p.values[1] for p in FORMATS}
    assert TOOL_PARSERS <= tested and REASONING_PARSERS <= tested


def test_kimi_reasoning_markers_are_not_text():
    """The bug: `kimi` was accepted, and ◁think▷…◁/think▷ came out as the answer."""
    assert parse(None, "kimi", ["◁think", "▷hmm◁/th", "ink▷\n\nyes"]) == ("hmm", "yes", [])


def test_text_mentioning_markers_stays_text():
    assert parse("kimi_k2", "kimi_k2", ["a <|tool_call <think> b"]) == ("", "a <|tool_call <think> b", [])
    assert parse("deepseekv3", None, ["x <｜tool▁call y"]) == ("", "x <｜tool▁call y", [])
    assert parse("glm45", None, ["<tool_call>\n<arg_key>k</arg_key></tool_call>"])[2] == []


# --- values of the XML-ish formats ----------------------------------------------------------------

CODER = (
    "<tool_call>\n<function=Bash>\n<parameter=command>\nls\n</parameter>\n<parameter=timeout>\n30\n"
    '</parameter>\n<parameter=background>\nfalse\n</parameter>\n<parameter=env>\n{"A": 1}\n</parameter>\n'
    "<parameter=note>\nnull\n</parameter>\n</function>\n</tool_call>"
)
BASH_TOOL = Tool(
    name="Bash",
    parameters={
        "type": "object",
        "properties": {
            "command": {"type": "string"},
            "timeout": {"type": "number"},
            "background": {"type": "boolean"},
            "env": {"type": "object"},
            "note": {"type": ["string", "null"]},
        },
    },
)


def test_qwen3_coder_values_are_text_unless_the_schema_types_them():
    untyped = {"command": "ls", "timeout": "30", "background": "false", "env": '{"A": 1}', "note": None}
    assert parse("qwen3_coder", None, [CODER])[2] == [("Bash", untyped)]
    typed = {"command": "ls", "timeout": 30, "background": False, "env": {"A": 1}, "note": None}
    assert parse("qwen3_coder", None, [CODER], tools=[BASH_TOOL])[2] == [("Bash", typed)]


def test_glm_values_are_json_when_they_parse_and_strings_when_the_schema_says_so():
    text = (
        "<tool_call>Bash\n<arg_key>command</arg_key>\n<arg_value>123</arg_value>\n"
        "<arg_key>timeout</arg_key>\n<arg_value>30</arg_value>\n<arg_key>env</arg_key>\n"
        "<arg_value>{\"A\": 1}</arg_value>\n<arg_key>flags</arg_key>\n<arg_value>['-l', '-a']</arg_value>\n"
        "<arg_key>path</arg_key>\n<arg_value>/tmp/a b</arg_value>\n</tool_call>"
    )
    untyped = {"command": 123, "timeout": 30, "env": {"A": 1}, "flags": ["-l", "-a"], "path": "/tmp/a b"}
    assert parse("glm45", None, [text])[2] == [("Bash", untyped)]
    assert parse("glm45", None, [text], tools=[BASH_TOOL])[2] == [("Bash", {**untyped, "command": "123"})]


def test_a_call_cut_off_mid_value_is_not_run():
    cut = "<tool_call>\n<function=Bash>\n<parameter=command>\nrm -rf /tmp/bu"
    assert parse("qwen3_coder", None, [cut]) == ("", cut, [])
    assert (
        parse("glm45", None, ["<tool_call>Bash\n<arg_key>command</arg_key>\n<arg_value>rm -rf /tmp/bu"])[2]
        == []
    )
    # A closed function is complete even when </tool_call> never came (SGLang reads it too).
    closed = "<tool_call>\n<function=Bash>\n<parameter=command>\nls\n</parameter>\n</function>\n"
    assert parse("qwen3_coder", None, [closed])[2] == [("Bash", {"command": "ls"})]


def test_json_formats_take_an_unclosed_call_whose_arguments_are_complete():
    kimi = '<|tool_calls_section_begin|><|tool_call_begin|>functions.Bash:0<|tool_call_argument_begin|>{"command": "ls"}'
    assert parse("kimi_k2", None, [kimi])[2] == [("Bash", {"command": "ls"})]
    assert parse("kimi_k2", None, [kimi[:-1]])[2] == []


def test_invalid_calls_in_a_section_fall_back_to_text():
    text = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\nnot json\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    _, answer, calls = parse("deepseekv3", None, [text])
    assert calls == [] and "not json" in answer


# --- names --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3", "qwen3_coder_json", "pythonic", "kimi"])
def test_tool_parser_names_we_do_not_implement_are_refused_with_the_supported_ones(name):
    with pytest.raises(ValueError, match=f"unknown tool parser '{name}'; supported: .*qwen3_coder"):
        OutputParser(name, None)


def test_reasoning_parser_names_we_do_not_implement_are_refused_with_the_supported_ones():
    with pytest.raises(ValueError, match="unknown reasoning parser 'gpt-oss'; supported: .*kimi_k2"):
        OutputParser(None, "gpt-oss")


def test_none_disables_both():
    p = OutputParser("none", "none")
    p.feed("<think>x</think><tool_call>{}</tool_call>")
    p.finish()
    assert (p.reasoning, p.text, p.tool_calls) == ("", "<think>x</think><tool_call>{}</tool_call>", [])


def test_cli_refuses_an_unknown_parser_before_starting():
    from polar_mitm.cli import main

    r = CliRunner().invoke(main, ["run", "--tool-parser", "bogus", "--", "true"])
    assert r.exit_code == 2
    assert "Invalid value for '--tool-parser': unknown tool parser 'bogus'; supported:" in r.output
    assert "kimi_k2" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["run", "--reasoning-parser", "kimi-k2", "--", "true"])
    assert r.exit_code == 2 and "unknown reasoning parser 'kimi-k2'" in r.output


def test_a_parser_the_server_reports_that_we_do_not_implement_is_a_provider_error():
    policy = Policy(PolicyConfig(reasoning_parser="qwen3"), store=None)

    async def model_info():
        return ModelInfo(tool_call_parser="pythonic")

    policy.discovery.model_info = model_info
    with pytest.raises(ProviderError, match="unknown tool parser 'pythonic'") as e:
        asyncio.run(policy.parsers())
    assert (e.value.kind, e.value.status) == ("api_error", 500)
    assert asyncio.run(Policy(PolicyConfig(tool_parser="none", reasoning_parser="kimi"), None).parsers()) == (
        None,
        "kimi",
    )


@pytest.mark.parametrize("stream", [False, True])
async def test_the_harness_gets_its_own_error_shape_for_a_parser_we_do_not_implement(make_stack, stream):
    from tests.support.helpers import BASH, MESSAGES_URL

    stack = await make_stack(backend={"tool_call_parser": "pythonic"})
    body = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}], "tools": [BASH]}
    async with stack.client() as c:
        r = await c.post(MESSAGES_URL, json={**body, "stream": stream})
    assert r.status_code == 500
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert "unknown tool parser 'pythonic'; supported:" in error["error"]["message"]
