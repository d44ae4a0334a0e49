"""The fake SGLang server: its pure parts (rules, replies, JSON instances, the random model, the
output parser, the request contract) and its HTTP API, checked against SGLang's shapes."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from polar_mitm import sse
from polar_mitm.backends.parsers import OutputParser
from polar_mitm.backends.tokenizer import Tokenizer
from polar_mitm.fake import (
    DEFAULT_TEXT,
    STATE,
    ContractError,
    FakeBackendConfig,
    GenParams,
    RandomModel,
    Rule,
    check_generate_body,
    declared_tools,
    expand_groups,
    last_message_text,
    load_script,
    minimal_json_instance,
    parse_output,
    scripted_logprob,
    scripted_reply,
    shell_arguments,
    start_fake_backend,
    truncation_mask,
)
from tests.support.helpers import wait_until_async
from tests.support.strategies import json_values

# --- helpers -------------------------------------------------------------------------------------

BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "Bash",
        "description": "Executes a given bash command",
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "The command to execute"},
                "timeout": {"type": "number"},
                "description": {"type": "string"},
            },
            "required": ["command"],
        },
    },
}
READ_TOOL = {
    "type": "function",
    "function": {
        "name": "Read",
        "description": "Reads a file",
        "parameters": {
            "type": "object",
            "properties": {"file_path": {"type": "string"}},
            "required": ["file_path"],
        },
    },
}
CODEX_SHELL_TOOL = {
    "type": "function",
    "function": {
        "name": "shell",
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "array", "items": {"type": "string"}},
                "workdir": {"type": "string"},
            },
            "required": ["command"],
        },
    },
}


def chatml(*messages: tuple[str, str], tools: list[dict] | None = None) -> str:
    """A Qwen-style prompt text, without a tokenizer."""
    out = []
    system = ""
    if tools:
        system = "# Tools\n\n<tools>\n" + "\n".join(json.dumps(t) for t in tools) + "\n</tools>"
    if system:
        out.append(f"<|im_start|>system\n{system}<|im_end|>\n")
    for role, content in messages:
        out.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    return "".join(out)


def sse_events(body: str) -> list[str]:
    return [e.data for e in sse.parse(body)]


@pytest.fixture
async def fake(tiny_tokenizer_dir: Path):
    """Start fake servers on 127.0.0.1: `url, state = await fake(**config)`."""
    runners = []

    async def start(**kw: Any):
        kw.setdefault("tokenizer_path", str(tiny_tokenizer_dir))
        runner, url = await start_fake_backend(FakeBackendConfig(**kw))
        runners.append(runner)
        return url, runner.app[STATE]

    yield start
    for r in runners:
        await r.cleanup()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s


@pytest.fixture
def tiny(tiny_tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.load(tiny_tokenizer_dir)


def prompt_ids(tok: Tokenizer, text: str, tools: list[dict] | None = None) -> list[int]:
    return tok.encode(tok.render([{"role": "user", "content": text}], tools=tools))


async def post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with http.post(url, json=body) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text


async def stream(http: aiohttp.ClientSession, url: str, body: Any) -> list[str]:
    async with http.post(url, json=body) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        return sse_events(await r.text())


# --- pure: prompts, rules, replies -----------------------------------------------------------------


def test_last_message_is_the_last_block_before_the_generation_prompt():
    text = chatml(("system", "sys"), ("user", "first"), ("assistant", "reply"), ("user", "run: ls -la"))
    assert last_message_text(text) == "run: ls -la"
    assert last_message_text("plain prompt") == "plain prompt"
    # OpenClaw sends the task, then its context block as a user message of its own.
    task = chatml(("system", "sys"), ("user", "Create out.txt containing hi"), ("user", "<<<CONTEXT>>>"))
    assert last_message_text(task) == "Create out.txt containing hi\n<<<CONTEXT>>>"


def test_expand_groups_keeps_other_backslashes():
    import re

    m = re.search(r"[Cc]reate (\S+) containing (\S+)", "Create a.txt containing hi")
    assert expand_groups(r"printf '%s\n' '\2' > '\1'", m) == "printf '%s\\n' 'hi' > 'a.txt'"


def test_default_script_shell_call_for_claude_code_like_tools():
    text = chatml(("user", "Please create hello.txt containing world"), tools=[READ_TOOL, BASH_TOOL])
    reply = scripted_reply([Rule.model_validate(r.model_dump(by_alias=True)) for r in _default_rules()], text)
    assert reply.startswith("<tool_call>\n") and reply.endswith("\n</tool_call>")
    call = json.loads(reply[len("<tool_call>\n") : -len("\n</tool_call>")])
    assert call == {"name": "Bash", "arguments": {"command": "printf '%s\\n' 'world' > 'hello.txt'"}}


def _default_rules() -> list[Rule]:
    return FakeBackendConfig(tokenizer_path="x").rules()


def test_default_script_codex_shell_takes_a_list_and_tool_results_end_the_turn():
    rules = _default_rules()
    text = chatml(("user", "run: ls -la /tmp"), tools=[CODEX_SHELL_TOOL])
    call = json.loads(scripted_reply(rules, text).split("\n")[1])
    assert call == {"name": "shell", "arguments": {"command": ["bash", "-lc", "ls -la /tmp"]}}
    after = chatml(
        ("user", "run: ls"), ("user", "<tool_response>\nfile\n</tool_response>"), tools=[CODEX_SHELL_TOOL]
    )
    assert scripted_reply(rules, after) == "Done. The command finished."
    assert scripted_reply(rules, chatml(("user", "hi"))) == DEFAULT_TEXT
    # No shell tool declared: a text reply.
    assert "ls" in scripted_reply(rules, chatml(("user", "run: ls"), tools=[READ_TOOL]))
    assert "<tool_call>" not in scripted_reply(rules, chatml(("user", "run: ls"), tools=[READ_TOOL]))


def test_shell_arguments_fill_required_parameters_and_cmd_convention():
    tool = {
        "name": "run_shell_command",
        "parameters": {
            "properties": {"command": {"type": "string"}, "description": {"type": "string"}},
            "required": ["command", "description"],
        },
    }
    assert shell_arguments(tool, "ls") == {"command": "ls", "description": ""}
    exec_tool = {
        "name": "exec_command",
        "parameters": {"properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
    }
    assert shell_arguments(exec_tool, "ls") == {"cmd": "ls"}


def test_declared_tools_reads_the_qwen_tools_block(tiny: Tokenizer):
    text = tiny.render([{"role": "user", "content": "x"}], tools=[BASH_TOOL, READ_TOOL])
    assert [t["name"] for t in declared_tools(text)] == ["Bash", "Read"]


def test_custom_rules_explicit_tool_call_reasoning_and_load(tmp_path: Path):
    path = tmp_path / "script.json"
    path.write_text(
        json.dumps(
            {
                "rules": [
                    {
                        "match": r"weather in (\w+)",
                        "reasoning": "Need weather for \\1.",
                        "tool_call": {"name": "get_weather", "arguments": {"city": "\\1", "days": 2}},
                    },
                    {"match": "system secret", "in": "prompt", "text": "found it"},
                ]
            }
        )
    )
    rules = load_script(path)
    reply = scripted_reply(rules, chatml(("user", "what is the weather in Paris?")))
    assert reply.startswith("<think>\nNeed weather for Paris.\n</think>\n\n<tool_call>\n")
    assert '"arguments": {"city": "Paris", "days": 2}' in reply
    assert scripted_reply(rules, chatml(("system", "system secret"), ("user", "hi"))) == "found it"
    assert scripted_reply(rules, chatml(("user", "nothing"))) == DEFAULT_TEXT
    with pytest.raises(ValueError):
        Rule(match="(unclosed")


# --- pure: JSON instances ----------------------------------------------------------------------------


def test_minimal_json_instance_gemini_router_schema():
    schema = {
        "type": "object",
        "properties": {
            "reasoning": {"type": "string", "description": "why"},
            "model_choice": {"type": "string", "enum": ["flash", "pro"]},
            "optional": {"type": "integer"},
        },
        "required": ["reasoning", "model_choice"],
    }
    assert minimal_json_instance(schema) == {"reasoning": "", "model_choice": "flash"}


def test_minimal_json_instance_nested_refs_bounds_and_unions():
    schema = {
        "$defs": {
            "Point": {
                "type": "object",
                "properties": {"x": {"type": "number", "minimum": 2}},
                "required": ["x"],
            }
        },
        "type": "object",
        "properties": {
            "p": {"$ref": "#/$defs/Point"},
            "tags": {"type": "array", "items": {"type": "string", "minLength": 2}, "minItems": 2},
            "flag": {"type": "boolean"},
            "maybe": {"anyOf": [{"type": "null"}, {"type": "integer", "exclusiveMinimum": 3}]},
            "kind": {"const": "fixed"},
            "when": {"type": "string", "format": "date-time"},
            "both": {
                "allOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]}, {"required": ["b"]}]
            },
            "n": {"type": ["null", "integer"]},
        },
        "required": ["p", "tags", "flag", "maybe", "kind", "when", "both", "n"],
    }
    assert minimal_json_instance(schema) == {
        "p": {"x": 2},
        "tags": ["aa", "aa"],
        "flag": False,
        "maybe": 4,
        "kind": "fixed",
        "when": "1970-01-01T00:00:00Z",
        "both": {"a": 1, "b": None},
        "n": 1,
    }
    assert minimal_json_instance({}) == {}
    assert minimal_json_instance({"type": "array"}) == []


def test_minimal_json_instance_answers_gemini_clis_classifier_with_a_score_it_accepts():
    # Gemini CLI 0.61's router schema, as it sends it (upper-case types are lowered by the provider):
    # the 1-100 range is only in the description, and the CLI prints a 50-line stack trace for 0.
    schema = {
        "type": "object",
        "properties": {
            "complexity_reasoning": {"type": "string", "description": "Brief explanation for the score."},
            "complexity_score": {"type": "integer", "description": "Complexity score from 1-100."},
        },
        "required": ["complexity_reasoning", "complexity_score"],
    }
    assert minimal_json_instance(schema) == {"complexity_reasoning": "", "complexity_score": 1}


@pytest.mark.parametrize(
    ("schema", "value"),
    [
        ({"type": "integer"}, 1),
        ({"type": "number"}, 1),
        ({"type": "integer", "minimum": 5}, 5),
        ({"type": "integer", "minimum": -3}, 1),
        ({"type": "integer", "exclusiveMinimum": 1}, 2),
        ({"type": "integer", "exclusiveMinimum": 1.5}, 2),
        ({"type": "integer", "minimum": 1, "exclusiveMinimum": True}, 2),  # draft 4
        ({"type": "integer", "maximum": 0}, 0),
        ({"type": "integer", "exclusiveMaximum": 1}, 0),
        ({"type": "integer", "minimum": -10, "maximum": -4}, -4),
        ({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}, 0.5),
        ({"type": "number", "minimum": 0.25, "maximum": 0.75}, 0.75),
        ({"type": "integer", "minimum": 1, "maximum": 100}, 1),
        ({"type": "integer", "minimum": 7, "multipleOf": 5}, 10),
        ({"type": "string", "minLength": 3, "maxLength": 5}, "aaa"),
        ({"type": "string", "enum": ["b", "c"]}, "b"),
        ({"type": "integer", "enum": [0, 3]}, 0),
        ({"type": "array", "items": {"type": "integer", "minimum": 2}, "minItems": 2}, [2, 2]),
    ],
)
def test_minimal_json_instance_honours_bounds(schema, value):
    got = minimal_json_instance(schema)
    assert got == value and type(got) is type(value)


# A harness's tool schema, or a request's json_schema, may be any JSON: the fake answers anyway.
ODD_SCHEMAS = [
    {"type": "object", "properties": {"command": {"type": "string"}}, "required": [["command"]]},
    {"type": "object", "properties": [None], "required": ["command", "x"]},
    {"type": "object", "properties": "user", "required": 5},
    {"$ref": 7, "allOf": [{"properties": [["a"]], "required": [{"b": 1}]}]},
    {"type": ["null", ["string"]], "prefixItems": 3, "minItems": 2},
]


@pytest.mark.parametrize("schema", ODD_SCHEMAS)
def test_odd_tool_schemas_get_a_shell_call_not_a_crash(schema):
    for name in ("Bash", "exec"):
        tool = {"type": "function", "function": {"name": name, "parameters": schema}}
        reply = scripted_reply(
            [Rule(match="run: (.+)", shell=r"\1")], chatml(("user", "run: ls"), tools=[tool])
        )
        assert reply.startswith("<tool_call>\n") or "I would run: ls" in reply
    minimal_json_instance(schema)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(schema=json_values, where=st.sampled_from(["schema", "properties", "required", "command"]))
@example(  # a shell tool with other required parameters, each with bounds of its own
    schema={
        "type": "object",
        "properties": {"command": {"type": "string"}, "cwd": {"type": "string", "minLength": 3},
                       "timeout": {"type": "integer", "minimum": 5}, "env": {"type": "object"}},
        "required": ["command", "cwd", "timeout"],
    },
    where="schema",
)  # fmt: skip
def test_the_scripted_model_answers_whatever_the_tool_schema(schema, where):
    params: Any = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
    if where == "schema":
        params = schema
    elif where == "command":
        params["properties"]["command"] = schema
    else:
        params[where] = schema
    for name in ("Bash", "exec"):
        tool = {"type": "function", "function": {"name": name, "parameters": params}}
        reply = scripted_reply(
            [Rule(match="run: (.+)", shell=r"\1")], chatml(("user", "run: ls"), tools=[tool])
        )
        assert_runs_ls_with(name, params, reply)
    json.dumps(minimal_json_instance(schema))
    answer = scripted_reply([], "x", json_schema=schema if isinstance(schema, dict) else None)
    if isinstance(schema, dict):
        json.loads(answer)  # constrained decoding answers JSON, whatever the schema


def _admits_an_instance(schema: Any) -> bool:
    """Whether `schema` is a JSON Schema (its metaschema accepts it) that the fake knows an
    instance of (its `minimal_json_instance` validates). Only then can a value be held to it: a
    generated schema may admit nothing (`{"enum": []}`) or loop (a `$ref` to itself)."""
    if not isinstance(schema, dict):
        return False
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
        jsonschema.validate(minimal_json_instance(schema), schema)
    except (jsonschema.SchemaError, jsonschema.ValidationError, RecursionError, TypeError, ValueError):
        return False
    return True


def assert_runs_ls_with(name: str, params: Any, reply: str) -> None:
    """The scripted reply to "run: ls" with one tool `name` offered: a call the proxy's own parser
    reads, to that tool, running `ls` in one of the shell conventions, with every other parameter
    the schema requires and nothing else, each valid under its own schema where that is one the
    fake knows an instance of. A tool not recognised as a shell gets text."""
    parser = OutputParser("qwen25", None)
    parser.feed(reply)
    parser.finish()
    if not parser.tool_calls:
        assert name != "Bash", reply  # Claude Code's shell tool is always recognised
        assert reply == "I would run: ls"
        return
    [call] = parser.tool_calls
    assert call.name == name and isinstance(call.arguments, dict), reply
    args = call.arguments
    key = next(k for k in ("command", "cmd", "commands", "input") if k in args)
    assert {
        "command": lambda v: v in ("ls", ["bash", "-lc", "ls"]),
        "cmd": lambda v: v == "ls",
        "commands": lambda v: v in ("ls", ["ls"]),
        "input": lambda v: 'tools.exec_command({cmd: "ls"})' in v,
    }[key](args[key]), args
    if key == "input":  # Codex's code-mode exec: one script, nothing else
        assert list(args) == ["input"], args
        return
    schema = params if isinstance(params, dict) else {}
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = (
        [r for r in schema.get("required", []) if isinstance(r, str)]
        if isinstance(schema.get("required"), list)
        else []
    )
    assert set(args) == {key, *required}, (params, args)
    for other in set(required) - {key}:
        if _admits_an_instance(props.get(other)):
            jsonschema.validate(args[other], props[other])


# --- pure: models --------------------------------------------------------------------------------


def test_scripted_logprobs_are_deterministic_float32_in_range():
    values = [scripted_logprob(7, pos, tid) for pos in range(50) for tid in (1, 99, 151645)]
    assert all(-5 < v <= 0 for v in values)
    assert all(float(np.float32(v)) == v for v in values)
    assert values == [scripted_logprob(7, pos, tid) for pos in range(50) for tid in (1, 99, 151645)]
    assert values != [scripted_logprob(8, pos, tid) for pos in range(50) for tid in (1, 99, 151645)]


def test_random_model_logprobs_are_a_real_log_softmax():
    model = RandomModel(3, range(10, 500), eos_id=2)
    rng = np.random.default_rng(0)
    for temperature in (1.0, 0.7, 1.5):
        params = GenParams(temperature=temperature, top_p=0.9, top_k=50)
        context = [5, 6, 7]
        lp = model.distribution(context, params)
        assert abs(np.exp(lp).sum() - 1.0) < 1e-9
        # The reported logprob is the distribution's (after temperature, before truncation).
        step = model.step(context, params, rng, Counter(), 0, top_n=5)
        i = model.index_of[step.token_id]
        assert step.logprob == float(np.float32(lp[i]))
        assert truncation_mask(lp, 50, 0.9, 0.0)[i]
        assert [t for _, t in step.top][0] == int(model.ids[np.argmax(lp)])
    # Temperature changes the reported distribution: it is not the raw log-softmax.
    a = model.distribution([1], GenParams(temperature=1.0))
    b = model.distribution([1], GenParams(temperature=0.5))
    assert not np.allclose(a, b)
    # min_new_tokens masks eos.
    masked = model.distribution([1], GenParams(min_new_tokens=3), n_generated=0)
    assert masked[model.eos_index] == -np.inf and abs(np.exp(masked).sum() - 1) < 1e-9


def test_truncation_mask():
    lp = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    assert truncation_mask(lp, 2, 1.0, 0.0).tolist() == [True, True, False, False]
    assert truncation_mask(lp, -1, 0.8, 0.0).tolist() == [True, True, False, False]
    assert truncation_mask(lp, -1, 0.5, 0.0).tolist() == [True, False, False, False]
    assert truncation_mask(lp, -1, 1.0, 0.25).tolist() == [True, True, True, False]


def test_gen_params_follow_sglang_normalization():
    greedy = GenParams.from_sglang({"temperature": 0}, 100)
    assert (greedy.temperature, greedy.top_k) == (1.0, 1)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        GenParams.from_sglang({"top_p": 0}, 100)
    with pytest.raises(ValueError, match="temperature must be a non-negative"):
        GenParams.from_sglang({"temperature": -1}, 100)
    with pytest.raises(ValueError, match="Only one of json_schema"):
        GenParams.from_sglang({"json_schema": "{}", "regex": "a"}, 100)


def test_contract_refuses_unknown_and_mistyped_sampling_params():
    check_generate_body(
        {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3, "stop": ["x"]}, "extra": 1}
    )
    with pytest.raises(ContractError, match="unknown field `max_tokens`, expected one of `max_new_tokens`"):
        check_generate_body({"input_ids": [1], "sampling_params": {"max_tokens": 3}})
    with pytest.raises(ContractError, match='invalid type: string "3", expected i64'):
        check_generate_body({"input_ids": [1], "sampling_params": {"max_new_tokens": "3"}})
    with pytest.raises(ContractError, match="invalid type: map, expected a string"):
        check_generate_body({"input_ids": [1], "sampling_params": {"json_schema": {"type": "object"}}})


def test_parse_output_reasoning_tool_calls_and_prefixes():
    text = '<think>\nplan\n</think>\n\nLet me run it.\n<tool_call>\n{"name": "Bash", "arguments": {"command": "ls"}}\n</tool_call>'
    final = parse_output(text, reasoning=True, tools=True, final=True)
    assert final.reasoning == "plan"
    assert final.content == "Let me run it."
    assert final.tool_calls == [("Bash", '{"command": "ls"}')]
    # Prefixes grow monotonically and hold back partial tags.
    prev_r, prev_c = "", ""
    for n in range(len(text) + 1):
        p = parse_output(text[:n], reasoning=True, tools=True, final=False)
        assert (p.reasoning or "").startswith(prev_r) and p.content.startswith(prev_c)
        assert "<" not in p.content and "</think" not in (p.reasoning or "")
        prev_r, prev_c = p.reasoning or "", p.content
    # Without tools in the request, tool-call text stays content.
    assert "<tool_call>" in parse_output(text, reasoning=True, tools=False, final=True).content


# --- HTTP: /generate -------------------------------------------------------------------------------


async def test_generate_non_stream_shape_and_eos(fake, http, tiny):
    url, _ = await fake()
    ids = prompt_ids(tiny, "hi")
    status, out = await post(http, url + "/generate", {"input_ids": ids, "return_logprob": True})
    assert status == 200
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    eos = tiny.token_id("<|im_end|>")
    assert out["text"] == DEFAULT_TEXT
    assert out["output_ids"][-1] == eos and "<|im_end|>" not in out["text"]
    assert out["output_ids"] == tiny.encode(DEFAULT_TEXT) + [eos]
    assert meta["finish_reason"] == {"type": "stop", "matched": eos}
    assert meta["prompt_tokens"] == len(ids)
    assert meta["completion_tokens"] == len(out["output_ids"])
    assert meta["weight_version"] == "0"
    assert meta["input_token_logprobs"] == []
    assert meta["output_token_logprobs_length"] == len(out["output_ids"])
    for (lp, tid, text), oid in zip(meta["output_token_logprobs"], out["output_ids"], strict=True):
        assert isinstance(lp, float) and -5 < lp <= 0 and tid == oid and text is None
    for key in ("id", "cached_tokens", "e2e_latency", "num_retractions", "reasoning_tokens"):
        assert key in meta


async def test_generate_text_input_logprob_text_and_input_logprobs(fake, http, tiny):
    url, _ = await fake()
    body = {
        "text": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        "return_logprob": True,
        "return_text_in_logprobs": True,
        "logprob_start_len": 2,
        "top_logprobs_num": 3,
        "rid": "my-rid",
    }
    status, out = await post(http, url + "/generate", body)
    assert status == 200
    meta = out["meta_info"]
    assert meta["id"] == "my-rid"
    n_prompt = meta["prompt_tokens"]
    assert len(meta["input_token_logprobs"]) == n_prompt - 2
    assert meta["input_token_logprobs"][0][0] is None
    assert meta["output_token_logprobs"][-1][2] == "<|im_end|>"
    tops = meta["output_top_logprobs"]
    assert len(tops) == len(out["output_ids"]) and all(len(row) == 3 for row in tops)
    for row, (lp, tid, _) in zip(tops, meta["output_token_logprobs"], strict=True):
        assert [lp, tid] in [r[:2] for r in row]
        assert sum(np.exp(r[0]) for r in row) <= 1 + 1e-6


async def test_generate_stream_is_cumulative_and_matches_non_stream(fake, http, tiny):
    for mode in ("scripted", "random"):
        url, _ = await fake(mode=mode, seed=11)
        body = {
            "input_ids": prompt_ids(tiny, "hello there"),
            "return_logprob": True,
            # A sampling_seed makes a random-mode request reproducible by itself.
            "sampling_params": {"max_new_tokens": 40, "sampling_seed": 3},
        }
        _, whole = await post(http, url + "/generate", body)
        events = await stream(http, url + "/generate", {**body, "stream": True})
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert len(chunks) == len(whole["output_ids"])  # one chunk per token (stream_interval 1)
        for n, c in enumerate(chunks, start=1):
            assert len(c["output_ids"]) == n == len(c["meta_info"]["output_token_logprobs"])
            assert c["output_ids"] == whole["output_ids"][:n]
            assert (c["meta_info"]["finish_reason"] is None) == (n < len(chunks))
        last = chunks[-1]
        assert last["output_ids"] == whole["output_ids"]
        assert last["text"] == whole["text"]
        assert last["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"]
        assert last["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
        assert "e2e_latency" in last["meta_info"] and "e2e_latency" not in chunks[0]["meta_info"]


async def test_generate_incremental_streaming_output(fake, http, tiny):
    url, _ = await fake(incremental_streaming_output=True)
    body = {"input_ids": prompt_ids(tiny, "hi"), "return_logprob": True}
    _, whole = await post(http, url + "/generate", body)
    chunks = [json.loads(e) for e in (await stream(http, url + "/generate", {**body, "stream": True}))[:-1]]
    assert sum((c["output_ids"] for c in chunks), []) == whole["output_ids"]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert (
        sum((c["meta_info"]["output_token_logprobs"] for c in chunks), [])
        == whole["meta_info"]["output_token_logprobs"]
    )


async def test_generate_reply_has_real_sglangs_header_and_weight_spans(fake, http, tiny):
    """What real SGLang 0.5.23 was seen to send (tests/e2e/test_real_sglang.py, docs/engines.md):
    `Content-Type: application/json` without a charset; the last output's `weight_versions`
    spans (one per weight version that sampled tokens) and `dp_rank`."""
    url, _ = await fake()
    body = {"input_ids": prompt_ids(tiny, "hi"), "sampling_params": {"max_new_tokens": 3}}
    async with http.post(url + "/generate", json=body) as r:
        assert r.headers["Content-Type"] == "application/json"
        out = await r.json()
    n = len(out["output_ids"])
    assert out["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": n}]
    assert out["meta_info"]["dp_rank"] is None
    chunks = [json.loads(e) for e in (await stream(http, url + "/generate", {**body, "stream": True}))[:-1]]
    assert ["weight_versions" in c["meta_info"] for c in chunks] == [False] * (len(chunks) - 1) + [True]


async def test_generate_errors_in_sglang_shapes(fake, http, tiny):
    url, _ = await fake()
    ids = prompt_ids(tiny, "hi")
    status, out = await post(
        http, url + "/generate", {"input_ids": ids, "sampling_params": {"max_tokens": 5}}
    )
    assert status == 400 and isinstance(out["error"], str) and "unknown field `max_tokens`" in out["error"]
    async with http.post(
        url + "/generate", data=b"{not json", headers={"Content-Type": "application/json"}
    ) as r:
        assert r.status == 400
        err = await r.json()
        assert err["object"] == "error" and err["code"] == 400 and err["type"] == "Bad Request"
    # Real SGLang (0.5.23, observed) parses no body without `Content-Type: application/json`.
    good = json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}).encode()
    for headers in ({}, {"Content-Type": "text/plain"}):
        async with http.post(url + "/generate", data=good, headers=headers) as r:
            err = await r.json()
            assert r.status == 400 and err["type"] == "Bad Request", err
            assert "Input should be a dictionary" in err["message"]
    status, out = await post(http, url + "/generate", {"input_ids": [1, tiny.vocab_size + 5]})
    assert status == 400 and "out-of-vocabulary" in out["error"]["message"]
    status, out = await post(http, url + "/generate", {"sampling_params": {}})
    assert (
        status == 400
        and out["error"]["message"] == "Either text, input_ids or input_embeds should be provided."
    )
    status, out = await post(http, url + "/generate", {"input_ids": ids, "sampling_params": {"top_p": 2}})
    assert status == 400 and "top_p must be in (0, 1]" in out["error"]["message"]
    # Streamed: SGLang validates inside the stream, so the error is an event and the status is 200.
    events = await stream(
        http, url + "/generate", {"input_ids": ids, "stream": True, "sampling_params": {"top_p": 2}}
    )
    assert json.loads(events[0])["error"]["code"] == 400 and events[-1] == "[DONE]"


async def test_generate_max_new_tokens_is_a_length_finish_without_eos(fake, http, tiny):
    url, _ = await fake()
    body = {"input_ids": prompt_ids(tiny, "hi"), "sampling_params": {"max_new_tokens": 3}}
    _, out = await post(http, url + "/generate", body)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert out["output_ids"] == tiny.encode(DEFAULT_TEXT)[:3]
    assert tiny.token_id("<|im_end|>") not in out["output_ids"]
    _, zero = await post(http, url + "/generate", {**body, "sampling_params": {"max_new_tokens": 0}})
    assert zero["output_ids"] == [] and zero["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


async def test_generate_stop_strings_and_stop_token_ids(fake, http, tiny):
    url, _ = await fake()
    ids = prompt_ids(tiny, "hi")
    _, out = await post(http, url + "/generate", {"input_ids": ids, "sampling_params": {"stop": ["fake"]}})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "fake"}
    assert out["text"] == "Hello from the polar-mitm "
    assert "fake" in tiny.decode(out["output_ids"]) and "fake" not in tiny.decode(out["output_ids"][:-1])
    _, kept = await post(
        http, url + "/generate", {"input_ids": ids, "sampling_params": {"stop": "fake", "no_stop_trim": True}}
    )
    assert kept["text"] == "Hello from the polar-mitm fake"
    reply = tiny.encode(DEFAULT_TEXT)
    _, tok_stop = await post(
        http, url + "/generate", {"input_ids": ids, "sampling_params": {"stop_token_ids": [reply[2]]}}
    )
    assert tok_stop["output_ids"] == reply[:3]
    assert tok_stop["meta_info"]["finish_reason"] == {"type": "stop", "matched": reply[2]}
    assert tok_stop["text"] == tiny.decode(reply[:2])
    # ignore_eos keeps generating to the length limit.
    _, long = await post(
        http,
        url + "/generate",
        {"input_ids": ids, "sampling_params": {"ignore_eos": True, "max_new_tokens": 50}},
    )
    assert long["meta_info"]["finish_reason"]["type"] == "length" and len(long["output_ids"]) == 50


async def test_generate_scripted_shell_tool_call_for_claude_code_tools(fake, http, tiny):
    url, _ = await fake()
    ids = prompt_ids(tiny, "Create notes.md containing hello", tools=[BASH_TOOL, READ_TOOL])
    _, out = await post(
        http, url + "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 500}}
    )
    parsed = parse_output(out["text"], reasoning=True, tools=True, final=True)
    assert parsed.tool_calls == [("Bash", json.dumps({"command": "printf '%s\\n' 'hello' > 'notes.md'"}))]
    assert out["output_ids"][0] == tiny.token_id("<tool_call>")  # the tag is one token, as Qwen emits it


async def test_generate_json_schema_replies_are_schema_valid(fake, http, tiny):
    schema = {
        "type": "object",
        "properties": {
            "reasoning": {"type": "string"},
            "model_choice": {"type": "string", "enum": ["flash", "pro"]},
        },
        "required": ["reasoning", "model_choice"],
    }
    for mode in ("scripted", "random"):
        url, _ = await fake(mode=mode)
        body = {
            "input_ids": prompt_ids(tiny, "route this"),
            "return_logprob": True,
            "sampling_params": {"json_schema": json.dumps(schema), "max_new_tokens": 200},
        }
        _, out = await post(http, url + "/generate", body)
        assert json.loads(out["text"]) == {"reasoning": "", "model_choice": "flash"}
        assert out["meta_info"]["finish_reason"]["type"] == "stop"


async def test_random_mode_is_deterministic_and_reports_log_softmax(fake, http, tiny):
    body = {
        "input_ids": prompt_ids(tiny, "anything"),
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 30, "temperature": 0.8, "top_p": 0.95},
    }
    url_a, state_a = await fake(mode="random", seed=5)
    url_b, _ = await fake(mode="random", seed=5)
    url_c, _ = await fake(mode="random", seed=6)
    _, a = await post(http, url_a + "/generate", body)
    _, a2 = await post(http, url_a + "/generate", body)
    _, b = await post(http, url_b + "/generate", body)
    _, b2 = await post(http, url_b + "/generate", body)
    _, c = await post(http, url_c + "/generate", body)
    # A fresh server with the same seed replays the same sequence of samples...
    assert (a["output_ids"], a2["output_ids"]) == (b["output_ids"], b2["output_ids"])
    assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
    # ...while repeated requests for one prompt (a GRPO group) are different samples.
    assert a["output_ids"] != a2["output_ids"]
    assert a["output_ids"] != c["output_ids"]
    # Each reported logprob is log-softmax(logits / T) at the chosen token, recomputed here.
    model = state_a.engine.random_model
    params = GenParams.from_sglang(body["sampling_params"], tiny.vocab_size)
    context = list(body["input_ids"])
    counts: Counter[int] = Counter()
    for n, (lp, tid, _) in enumerate(a["meta_info"]["output_token_logprobs"]):
        dist = model.distribution(context, params, counts, n)
        assert abs(np.exp(dist).sum() - 1.0) < 1e-9
        assert lp == float(np.float32(dist[model.index_of[tid]]))
        context.append(tid)
        counts[tid] += 1
    # With a sampling_seed every request is reproducible; another seed samples differently.
    seeded = [
        await post(
            http,
            url_a + "/generate",
            {**body, "sampling_params": {**body["sampling_params"], "sampling_seed": s}},
        )
        for s in (9, 9, 10)
    ]
    assert seeded[0][1]["output_ids"] == seeded[1][1]["output_ids"] != seeded[2][1]["output_ids"]


async def test_generate_batch_and_n(fake, http, tiny):
    url, _ = await fake()
    ids = prompt_ids(tiny, "hi")
    _, outs = await post(
        http, url + "/generate", {"input_ids": [ids, ids], "sampling_params": {"max_new_tokens": 2}}
    )
    assert isinstance(outs, list) and len(outs) == 2 and all(len(o["output_ids"]) == 2 for o in outs)
    _, outs = await post(
        http, url + "/generate", {"input_ids": ids, "sampling_params": {"n": 3, "max_new_tokens": 2}}
    )
    assert isinstance(outs, list) and len(outs) == 3


# --- HTTP: info endpoints and weight versions ---------------------------------------------------------


async def test_model_info_health_models_and_weight_version(fake, http, tiny, tiny_tokenizer_dir):
    url, _ = await fake(model_path="org/policy", weight_version="step-0")
    async with http.get(url + "/model_info") as r:
        info = await r.json()
    assert info["model_path"] == "org/policy"
    assert info["tokenizer_path"] == str(tiny_tokenizer_dir)
    assert info["is_generation"] is True
    assert (info["tool_call_parser"], info["reasoning_parser"], info["weight_version"]) == (
        "qwen25",
        "qwen3",
        "step-0",
    )
    for path in ("/health", "/health_generate"):
        async with http.get(url + path) as r:
            assert r.status == 200 and await r.read() == b""
    async with http.get(url + "/v1/models") as r:
        models = await r.json()
    assert models["object"] == "list" and models["data"][0]["id"] == "org/policy"
    assert models["data"][0]["owned_by"] == "sglang"
    async with http.get(url + "/get_server_info") as r:
        assert (await r.json())["tokenizer_path"] == str(tiny_tokenizer_dir)
    status, upd = await post(http, url + "/update_weight_version", {"new_version": "step-7"})
    assert status == 200 and upd == {
        "success": True,
        "message": "Weight version updated to step-7",
        "new_version": "step-7",
    }
    _, out = await post(http, url + "/generate", {"input_ids": prompt_ids(tiny, "hi")})
    assert out["meta_info"]["weight_version"] == "step-7"
    async with http.get(url + "/model_info") as r:
        assert (await r.json())["weight_version"] == "step-7"


async def test_cached_tokens_follow_shared_prefixes(fake, http, tiny):
    url, _ = await fake()
    ids = prompt_ids(tiny, "first question")
    _, a = await post(http, url + "/generate", {"input_ids": ids})
    _, b = await post(http, url + "/generate", {"input_ids": ids + [5, 6, 7]})
    assert a["meta_info"]["cached_tokens"] == 0
    assert b["meta_info"]["cached_tokens"] == len(ids)


# --- HTTP: /v1/chat/completions -----------------------------------------------------------------------


async def test_chat_non_stream_tool_call_and_token_ids(fake, http, tiny):
    url, _ = await fake()
    body = {
        "model": "anything",
        "messages": [{"role": "user", "content": "run: echo hi"}],
        "tools": [BASH_TOOL],
        "logprobs": True,
        "return_token_ids": True,
        "return_meta_info": True,
    }
    status, out = await post(http, url + "/v1/chat/completions", body)
    assert status == 200 and out["object"] == "chat.completion" and out["model"] == "anything"
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["matched_stop"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) == 29
    assert call["function"]["name"] == "Bash"
    assert json.loads(call["function"]["arguments"]) == {"command": "echo hi"}
    assert choice["message"]["content"] == ""
    expected_prompt = tiny.encode(tiny.render(body["messages"], tools=body["tools"]))
    assert choice["prompt_token_ids"] == expected_prompt
    assert choice["response_token_ids"][-1] == tiny.token_id("<|im_end|>")
    assert len(choice["logprobs"]["content"]) == len(choice["response_token_ids"])
    assert choice["meta_info"]["output_token_logprobs"][0][1] == choice["response_token_ids"][0]
    assert out["usage"]["completion_tokens"] == len(choice["response_token_ids"])
    assert out["metadata"] == {"weight_version": "0"}


async def test_chat_reasoning_and_plain_text(fake, http):
    rules = [Rule(match="think", reasoning="pondering", text="answer"), Rule(text="plain")]
    url, _ = await fake(script=rules)
    _, out = await post(
        http, url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "think"}]}
    )
    msg = out["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("pondering", "answer")
    assert "tool_calls" not in msg
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["reasoning_tokens"] > 0
    _, out = await post(http, url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert out["choices"][0]["message"] == {
        "role": "assistant",
        "content": "plain",
        "reasoning_content": None,
    }


async def test_chat_stream_tool_calls_usage_and_sglext(fake, http, tiny):
    rules = [Rule(match="go", reasoning="plan", text="Running it.", shell="ls -la")]
    url, _ = await fake(script=rules)
    body = {
        "messages": [{"role": "user", "content": "go"}],
        "tools": [BASH_TOOL],
        "stream": True,
        "logprobs": True,
        "stream_options": {"include_usage": True},
        "return_output_ids_in_sglext": True,
    }
    events = await stream(http, url + "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"reasoning_content": None, "role": "assistant", "content": ""}
    reasoning = "".join(
        c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks if c["choices"]
    )
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert reasoning.strip() == "plan" and content.strip() == "Running it."
    calls: dict[int, dict[str, str]] = {}
    for c in chunks:
        for tc in (c["choices"][0]["delta"].get("tool_calls") or []) if c["choices"] else []:
            slot = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            slot["name"] += tc["function"]["name"] or ""
            slot["arguments"] += tc["function"]["arguments"] or ""
    assert calls == {0: {"name": "Bash", "arguments": json.dumps({"command": "ls -la"})}}
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["finish_reason"] for c in finish] == ["tool_calls"]
    n_logprobs = sum(
        len((c["choices"][0].get("logprobs") or {}).get("content", [])) for c in chunks if c["choices"]
    )
    sglext = next(c["sglext"] for c in chunks if "sglext" in c)
    assert n_logprobs == len(sglext["output_ids"][0])
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(sglext["output_ids"][0])
    # The non-streamed answer to the same request parses the same.
    _, whole = await post(http, url + "/v1/chat/completions", {**body, "stream": False})
    message = whole["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("plan", "Running it.")
    assert whole["sglext"]["output_ids"] == sglext["output_ids"]


async def test_chat_refuses_token_ids_with_streaming_and_bad_bodies(fake, http):
    url, _ = await fake()
    body = {"messages": [{"role": "user", "content": "x"}], "stream": True, "return_token_ids": True}
    status, out = await post(http, url + "/v1/chat/completions", body)
    assert (
        status == 400
        and out["object"] == "error"
        and "return_token_ids is not supported with streaming" in out["message"]
    )
    status, out = await post(http, url + "/v1/chat/completions", {"model": "m"})
    assert status == 400 and out["type"] == "Bad Request"


# --- faults and the request log -----------------------------------------------------------------------


async def test_faults_http500_garbage_abort_and_request_log(fake, http, tiny):
    url, state = await fake(fail_next=1)
    body = {"input_ids": prompt_ids(tiny, "hi"), "sampling_params": {"max_new_tokens": 64}}
    status, out = await post(http, url + "/generate", body)
    assert status == 500 and "error" in out
    status, _ = await post(http, url + "/generate", body)
    assert status == 200
    await post(http, url + "/_fake/fault", {"mode": "garbage", "count": 1})
    async with http.post(url + "/generate", json=body) as r:
        assert r.status == 200
        with pytest.raises(ValueError):
            json.loads(await r.text(errors="replace"))
    await post(http, url + "/_fake/fault", {"mode": "abort", "path": "/generate"})
    _, aborted = await post(http, url + "/generate", body)
    assert aborted["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "Aborted",
        "status_code": None,
        "err_type": None,
    }
    assert 0 < len(aborted["output_ids"]) < len(tiny.encode(DEFAULT_TEXT)) + 1
    async with http.get(url + "/_fake/requests?last=2") as r:
        log = await r.json()
    assert log["count"] == 4 and log["counts"]["/generate"] == 4
    assert [e["body"] for e in log["requests"]] == [body, body]
    assert state.request_count == 4


async def test_fault_drop_midstream_cuts_the_stream(fake, http, tiny):
    url, _ = await fake()
    body = {"input_ids": prompt_ids(tiny, "hi"), "stream": True}
    await post(http, url + "/_fake/fault", {"mode": "drop_midstream"})
    received = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(url + "/generate", json=body) as r:
            async for data in r.content.iter_any():
                received += data
    assert received.startswith(b"data: ") and b"[DONE]" not in received
    await post(http, url + "/_fake/fault", {"mode": "drop_midstream"})
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(url + "/generate", json={**body, "stream": False}) as r:
            await r.read()


async def test_fault_hang_holds_the_request_until_the_client_gives_up(fake, http, tiny):
    url, _ = await fake()
    await post(http, url + "/_fake/fault", {"mode": "hang"})
    with pytest.raises(asyncio.TimeoutError):
        async with http.post(
            url + "/generate", json={"input_ids": [1, 2]}, timeout=aiohttp.ClientTimeout(total=0.5)
        ):
            pass
    status, _ = await post(http, url + "/generate", {"input_ids": [1, 2]})
    assert status == 200


async def test_abort_request_and_weight_update_abort_in_flight_streams(fake, http, tiny):
    url, state = await fake(token_delay=0.02)
    body = {
        "input_ids": prompt_ids(tiny, "hi"),
        "stream": True,
        "rid": "slow",
        "sampling_params": {"ignore_eos": True, "max_new_tokens": 500},
    }

    async def abort_soon(path: str, payload: dict[str, Any]) -> None:
        await wait_until_async(lambda: "slow" in state.in_flight, timeout=10, message="the stream in flight")
        await asyncio.sleep(0.1)  # a few tokens out
        await post(http, url + path, payload)

    for path, payload in (
        ("/abort_request", {"rid": "slow"}),
        ("/update_weight_version", {"new_version": "v2"}),
    ):
        task = asyncio.create_task(abort_soon(path, payload))
        events = await stream(http, url + "/generate", body)
        await task
        last = json.loads(events[-2])
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(last["output_ids"]) < 500


# --- the real Qwen tokenizer --------------------------------------------------------------------------


async def test_qwen_tokenizer_end_to_end(qwen_tokenizer_dir, http):
    tok = Tokenizer.load(qwen_tokenizer_dir)
    runner, url = await start_fake_backend(FakeBackendConfig(tokenizer_path=str(qwen_tokenizer_dir)))
    try:
        ids = prompt_ids(tok, "Create a.txt containing b", tools=[BASH_TOOL])
        _, out = await post(http, url + "/generate", {"input_ids": ids, "return_logprob": True})
        assert out["output_ids"][0] == 151657 and out["output_ids"][-2:] == [151658, 151645]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 151645}
        assert '"command": "printf' in out["text"]
    finally:
        await runner.cleanup()
