"""The Gemini API reads protobuf JSON: every field of a proto message by its JSON name
(`systemInstruction`) or by its proto name (`system_instruction`), as litellm sends them. A body
and its snake_case twin must read as the same neutral request (the prompt the harness sent), and
free-form values (a call's args, a function's response, schema property names) are never renamed.
"""

import logging
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polar_mitm.providers import gemini
from polar_mitm.providers.fields import InvalidRequest
from polar_mitm.store.reader import read_turns

PATH = "/v1beta/models/gemini-2.5-pro:generateContent"
HOST = "https://generativelanguage.googleapis.com"

# Keys whose values are data (google.protobuf.Value / Struct, or a map of names), written in the
# test independently of the provider's own table: the twin keeps them exactly as they are.
FREE_VALUES = {"args", "response", "parametersJsonSchema", "responseJsonSchema", "example", "default"}
NAME_MAPS = {"properties"}  # names are data, values are schemas


def snake(name: str) -> str:
    return re.sub(r"(?<!^)([A-Z])", lambda m: "_" + m.group(1).lower(), name)


def twin(value, pick):
    """`value` with each message key spelled as its proto name when pick() says so."""
    if isinstance(value, list):
        return [twin(v, pick) for v in value]
    if not isinstance(value, dict):
        return value
    out = {}
    for k, v in value.items():
        key = snake(k) if pick() else k
        if k in FREE_VALUES:
            out[key] = v
        elif k in NAME_MAPS and isinstance(v, dict):
            out[key] = {name: twin(s, pick) for name, s in v.items()}
        else:
            out[key] = twin(v, pick)
    return out


names = st.sampled_from(["file_path", "filePath", "command", "old_string", "dir_path", "maxLines", "x"])
json_leaf = st.one_of(st.text(max_size=8), st.integers(-5, 5), st.booleans(), st.none())
free_json = st.recursive(
    json_leaf,
    lambda inner: st.dictionaries(names, inner, max_size=3) | st.lists(inner, max_size=3),
    max_leaves=6,
)
schema = st.recursive(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["STRING", "INTEGER", "BOOLEAN"])},
        optional={
            "description": st.text(max_size=8),
            "maxLength": st.integers(1, 9),
            "nullable": st.booleans(),
        },
    ),
    lambda inner: (
        st.fixed_dictionaries(
            {"type": st.just("OBJECT"), "properties": st.dictionaries(names, inner, min_size=1, max_size=3)},
            optional={
                "required": st.lists(names, max_size=2),
                "propertyOrdering": st.lists(names, max_size=2),
            },
        )
        | st.fixed_dictionaries(
            {"type": st.just("ARRAY"), "items": inner}, optional={"minItems": st.integers(0, 3)}
        )
        | st.fixed_dictionaries({"anyOf": st.lists(inner, min_size=1, max_size=2)})
    ),
    max_leaves=5,
)
declaration = st.fixed_dictionaries(
    {"name": st.sampled_from(["run_shell_command", "read_file", "edit"])},
    optional={
        "description": st.text(max_size=12),
        "parameters": schema,
        "parametersJsonSchema": st.dictionaries(names, free_json, max_size=3),
    },
)
text_part = st.builds(lambda t: {"text": t}, st.text(min_size=1, max_size=12))
thought_part = st.builds(lambda t: {"text": t, "thought": True}, st.text(min_size=1, max_size=12))
call_part = st.builds(
    lambda n, a: {"functionCall": {"name": n, "args": a}},
    st.sampled_from(["run_shell_command", "read_file"]),
    st.dictionaries(names, free_json, max_size=3),
)
response_part = st.builds(
    lambda n, r: {"functionResponse": {"name": n, "response": r}},
    st.sampled_from(["run_shell_command", "read_file"]),
    st.dictionaries(names, free_json, max_size=2),
)
blob_part = st.builds(
    lambda m: {"inlineData": {"mimeType": m, "data": "AAAA"}}, st.sampled_from(["image/png"])
)
file_part = st.builds(
    lambda u: {"fileData": {"mimeType": "text/plain", "fileUri": u}}, st.sampled_from(["gs://b/f.txt"])
)
user_content = st.builds(
    lambda parts: {"role": "user", "parts": parts},
    st.lists(text_part | response_part | blob_part | file_part, min_size=1, max_size=3),
)
model_content = st.builds(
    lambda parts: {"role": "model", "parts": parts},
    st.lists(text_part | thought_part | call_part, min_size=1, max_size=3),
)
generation_config = st.fixed_dictionaries(
    {},
    optional={
        "maxOutputTokens": st.integers(1, 4096),
        "temperature": st.floats(0, 2),
        "topP": st.floats(0.01, 1),
        "topK": st.integers(1, 50),
        "stopSequences": st.lists(st.text(min_size=1, max_size=4), max_size=2),
        "responseMimeType": st.sampled_from(["text/plain", "application/json"]),
        "responseSchema": schema,
        "thinkingConfig": st.fixed_dictionaries(
            {}, optional={"thinkingBudget": st.integers(-1, 1024), "includeThoughts": st.booleans()}
        ),
    },
)
tool_config = st.fixed_dictionaries(
    {
        "functionCallingConfig": st.fixed_dictionaries(
            {"mode": st.sampled_from(["AUTO", "ANY", "NONE"])},
            optional={"allowedFunctionNames": st.lists(st.sampled_from(["read_file", "edit"]), max_size=1)},
        )
    }
)
body = st.fixed_dictionaries(
    {"contents": st.lists(user_content | model_content, min_size=1, max_size=4)},
    optional={
        "systemInstruction": st.builds(lambda ps: {"parts": ps}, st.lists(text_part, min_size=1, max_size=2)),
        "tools": st.lists(
            st.builds(lambda ds: {"functionDeclarations": ds}, st.lists(declaration, max_size=3)), max_size=2
        ),
        "generationConfig": generation_config,
        "toolConfig": tool_config,
        "safetySettings": st.just([{"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_NONE"}]),
    },
)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(body=body, picks=st.lists(st.booleans(), min_size=1, max_size=64))
def test_a_body_and_its_snake_case_twin_read_the_same(body, picks):
    it = iter(picks * 1000)
    mixed = twin(body, lambda: next(it))
    everywhere = twin(body, lambda: True)
    want = read(body)
    assert read(mixed) == want
    assert read(everywhere) == want
    assert gemini.unknown_fields(everywhere) == []
    # countTokens' wrapper is a message field too.
    assert read({"generate_content_request": everywhere}) == want


def read(body):
    """What the body reads as: the neutral request, or the error (whose message names the field
    at fault by its JSON name, whichever spelling was sent)."""
    try:
        return gemini.parse_request(body, path=PATH)
    except InvalidRequest as e:
        return ("error", e.message)


def test_litellm_shaped_body_keeps_system_prompt_tools_and_tool_history():
    body = {
        "system_instruction": {"parts": [{"text": "You are a helpful assistant that can run bash."}]},
        "contents": [
            {"role": "user", "parts": [{"text": "List the files."}]},
            {
                "role": "model",
                "parts": [{"function_call": {"name": "bash", "args": {"command": "ls", "timeout_s": 5}}}],
            },
            {
                "role": "user",
                "parts": [
                    {"function_response": {"name": "bash", "response": {"exit_code": 0, "std_out": "a.txt"}}}
                ],
            },
        ],
        "tools": [
            {
                "function_declarations": [
                    {
                        "name": "bash",
                        "description": "Run a command",
                        "parameters": {
                            "type": "object",
                            "properties": {"command": {"type": "string"}, "timeout_s": {"type": "integer"}},
                            "required": ["command"],
                        },
                    }
                ]
            }
        ],
        "tool_config": {"function_calling_config": {"mode": "ANY", "allowed_function_names": ["bash"]}},
        "generation_config": {"max_output_tokens": 256, "temperature": 0.2, "stop_sequences": ["END"]},
    }
    req = gemini.parse_request(body, path=PATH)
    system, user, call, result = req.messages
    assert system.role == "system" and system.content.startswith("You are a helpful assistant")
    assert call.tool_calls[0].name == "bash" and call.tool_calls[0].arguments == {
        "command": "ls",
        "timeout_s": 5,
    }
    assert result.role == "tool" and "std_out" in result.content  # values are data: not renamed
    [tool] = req.tools
    assert tool.name == "bash" and set(tool.parameters["properties"]) == {"command", "timeout_s"}
    assert req.tool_choice == {"name": "bash"}
    assert (req.sampling.max_tokens, req.sampling.temperature, req.sampling.stop) == (256, 0.2, ["END"])


def test_a_field_given_in_both_spellings_is_refused():
    with pytest.raises(InvalidRequest, match="systemInstruction: given twice"):
        gemini.parse_request(
            {"contents": [], "systemInstruction": {"parts": []}, "system_instruction": {"parts": []}},
            path=PATH,
        )
    with pytest.raises(InvalidRequest, match=r"generationConfig.maxOutputTokens: given twice"):
        gemini.parse_request(
            {"contents": [], "generation_config": {"maxOutputTokens": 1, "max_output_tokens": 2}}, path=PATH
        )


def test_a_body_with_nothing_to_rename_is_read_as_it_came():
    body = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}], "generationConfig": {"topK": 3}}
    assert gemini.json_names(body) is body


def test_unknown_top_level_fields_in_every_style():
    from polar_mitm.providers import anthropic, openai_chat, openai_responses

    assert gemini.unknown_fields({"contents": [], "cached_content": "c", "futureField": 1}) == ["futureField"]
    assert anthropic.unknown_fields({"model": "m", "messages": [], "context_management": {}}) == [
        "context_management"
    ]
    # What Claude Code sends every turn changes nothing the policy sees; other forms are said.
    claude_code = {
        "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "diagnostics": {"previous_message_id": "msg_18ed56a45e8067da273d1820"},  # 2.1.33x
        "fallbacks": [{"model": "claude-opus-5"}],  # 2.1.33x, /compact's summary request
        "safeguards": [{"type": "dangerous_tool_use", "classifier_context": {"v": 1}}],  # auto mode
    }
    assert anthropic.unknown_fields({"model": "m", **claude_code}) == []
    assert anthropic.unknown_fields({"model": "m", "diagnostics": {"previous_message_id": None}}) == []
    assert anthropic.unknown_fields({"model": "m", "diagnostics": {"prompt_hint": "x"}}) == ["diagnostics"]
    changes_prompt = {
        "output_config": {"effort": "high", "task_budget": 5},
        "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
    }
    assert anthropic.unknown_fields(changes_prompt) == ["output_config", "context_management"]
    # A structured output format is read: the engine's constrained decoding enforces it.
    schema = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}
    req = anthropic.parse_request(
        {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "x"}],
         "output_config": {"format": {"type": "json_schema", "schema": schema}}, "thinking": {"type": "enabled", "budget_tokens": 9}}
    )  # fmt: skip
    assert req.sampling.json_schema == schema and req.thinking is False
    assert openai_chat.unknown_fields({"model": "m", "messages": [], "user": "u", "audio": {}}) == ["audio"]
    assert openai_responses.unknown_fields({"model": "m", "input": [], "prompt": {"id": "p"}}) == ["prompt"]


async def test_snake_case_through_the_proxy_stores_the_whole_prompt_and_says_unknown_fields_once(
    make_stack, caplog
):
    stack = await make_stack()
    body = {
        "system_instruction": {"parts": [{"text": "SYSTEM-PROMPT-MARKER: you run shell commands."}]},
        "contents": [{"role": "user", "parts": [{"text": "Create out.txt"}]}],
        "tools": [
            {
                "function_declarations": [
                    {
                        "name": "run_shell_command",
                        "description": "TOOL-DESCRIPTION-MARKER",
                        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
                    }
                ]
            }
        ],
        "generation_config": {"max_output_tokens": 64},
        "brand_new_field": {"x": 1},
    }
    with caplog.at_level(logging.WARNING, logger="polar_mitm"):
        async with stack.client() as c:
            for _ in range(2):
                r = await c.post(HOST + PATH, json=body, headers={"x-goog-api-key": "k"})
                assert r.status_code == 200, r.text
    said = [r for r in caplog.records if "brand_new_field" in r.getMessage()]
    assert len(said) == 1  # once per session, not per request
    turns = list(read_turns(stack.db))
    assert len(turns) == 2
    tok = await stack.proxy.policy.tokenizer()
    prompt = tok.decode(turns[0].prompt_ids)
    assert "SYSTEM-PROMPT-MARKER" in prompt and "TOOL-DESCRIPTION-MARKER" in prompt
