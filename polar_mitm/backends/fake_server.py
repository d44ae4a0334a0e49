"""A fake SGLang policy server: SGLang's native HTTP API without a GPU or a model.

`polar-mitm fake-backend` serves it for demos and users' CI, and every test and benchmark of the
proxy talks to it, so it answers the way SGLang's HTTP server does (checked against SGLang 0.5.x:
`srt/entrypoints/http_server.py`, `srt/managers/tokenizer_manager.py`, `srt/managers/io_struct.py`,
`srt/managers/schedule_batch.py`, `srt/managers/detokenizer_manager.py`,
`srt/sampling/sampling_params.py`, `srt/entrypoints/openai/{protocol,serving_chat,sse_utils}.py`
and the generated JSON contract `sglang/api/v1/api_types.py`):

- `POST /generate` → `{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
  "weight_version", "num_retractions", ["input_token_logprobs", "output_token_logprobs",
  "output_token_logprobs_length", ("input_top_logprobs", "output_top_logprobs")], "reasoning_tokens",
  "completion_tokens", "cached_tokens", "e2e_latency", "response_sent_to_client_ts"}}`. A list of
  those for a batch (`input_ids` as a list of lists, `text` as a list, or `sampling_params.n > 1`).
  `finish_reason` is `{"type": "stop", "matched": <token id | stop string>}`,
  `{"type": "length", "length": max_new_tokens}` or
  `{"type": "abort", "message", "status_code", "err_type"}`; `None` on unfinished stream chunks.
  `output_ids` keep the matched stop token; `text` is decoded without it (and cut before a matched
  stop string) unless `no_stop_trim`. Logprob entries are `[logprob, token_id, text_or_null]`
  (text only with `return_text_in_logprobs`). With `logprob_start_len` unset (-1) the
  `input_token_logprobs` list is empty; from position k it starts with a `None` logprob.
- Streaming (`"stream": true`) is SSE, `data: {...}\\n\\n` per chunk and a final
  `data: [DONE]\\n\\n`. By default (SGLang's `incremental_streaming_output=False`) every chunk is
  CUMULATIVE: `text`, `output_ids` and `meta_info.output_token_logprobs` hold everything generated
  so far, and only the last chunk has a `finish_reason` and `e2e_latency`. `incremental_streaming_output`
  in the config switches to SGLang's delta chunks. Errors found after the stream started (SGLang
  validates inside its stream generator) arrive as a `data: {"error": {...}}` chunk, then `[DONE]`.
- Request checking: an unknown `sampling_params` key (or a wrongly typed field) is refused by
  SGLang's JSON contract gate with HTTP 400 `{"error": "unknown field `x`, expected one of …"}` (a
  plain string); a body that is not JSON is FastAPI's validation error, which SGLang turns into 400
  `{"object": "error", "message", "type": "Bad Request", "param": null, "code": 400}`; semantic
  errors (`ValueError` in SGLang: no prompt, bad temperature, prompt too long) are 400
  `{"error": {"message": ...}}`. Unknown top-level keys are ignored, as SGLang does. An
  `input_ids` entry outside the vocabulary is a 400 here (SGLang itself does not check it).
- `GET /model_info` (and the deprecated `/get_model_info`) has `model_path`, `served_model_name`,
  `tokenizer_path`, `is_generation`, `preferred_sampling_params`, `weight_version`,
  `reasoning_parser`, `tool_call_parser`, …; `POST /update_weight_version` takes
  `{"new_version", "abort_all_requests": true}` and answers `{"success", "message", "new_version"}`;
  `GET /health` and `/health_generate` are 200 with an empty body; `GET /v1/models` is OpenAI's list
  with `owned_by: "sglang"` and `max_model_len`; `POST /abort_request` takes `{"rid", "abort_all"}`.
- `POST /v1/chat/completions` renders the messages with the tokenizer's chat template, generates
  with the same engine, and answers OpenAI's shape with SGLang's extras: `reasoning_content`,
  `tool_calls` parsed from `<tool_call>` blocks (`qwen25`, ids `call_<24 hex>`, finish `tool_calls`),
  `matched_stop`, `metadata.weight_version`, and for token-exact capture `return_token_ids`
  (`choices[].prompt_token_ids` / `response_token_ids`), `return_prompt_token_ids`,
  `return_meta_info` (`choices[].meta_info`, the /generate meta_info) — those three are refused
  with streaming, as in SGLang — and `return_input_ids_in_sglext` / `return_output_ids_in_sglext`
  (`sglext.input_ids`, `sglext.output_ids`, also as a trailing stream chunk). Streams: a role chunk,
  reasoning/content/tool-call deltas, a finish chunk with `matched_stop`, the optional sglext and
  `stream_options.include_usage` chunks, then `[DONE]`.

Two models stand behind it. `scripted` (the default) picks its reply by ordered `Rule`s over the
prompt and writes it the way a Qwen model does (`<tool_call>\\n{...}\\n</tool_call>`, then
`<|im_end|>`), with deterministic float32 logprobs; `random` is a tiny seeded numpy model whose
logprobs are true log-softmax values of the distribution it samples from (after temperature and
before top-k/top-p truncation, as SGLang's sampler reports them). A `random` request with
`sampling_seed` is reproducible by itself; without one, the k-th request for a prompt draws the
k-th sample, so a group of identical requests differs and a fresh server replays the sequence.
With `json_schema` both models answer a minimal schema-valid instance (fake constrained
decoding). Admin endpoints under `/_fake/` (`fault`, `requests`, `reset`, `state`) inject faults
and show what clients sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, field_validator

from polar_mitm.backends.tokenizer import Tokenizer

SGLANG_VERSION_EMULATED = "0.5.x"

# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


class ToolCallSpec(BaseModel):
    """A tool call a rule makes verbatim; strings may use the rule's regex groups (`\\1`)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class Rule(BaseModel):
    """One scripted reply: the first rule whose `match` is found in the prompt answers.

    `in` is where to search: `last` (the decoded text of the last `<|im_start|>ROLE … <|im_end|>`
    block before the generation prompt) or `prompt` (the whole decoded prompt). The reply is built
    from `reasoning` (a `<think>` block), `text`, then `tool_call` or `shell` (a call to whichever
    shell tool the prompt declares; text if it declares none). `json: true` answers with a minimal
    instance of the request's `json_schema` (`{}` without one). Every reply string may use `\\1` /
    `\\g<name>` for the match's groups; other backslashes are kept as written.
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    match: str = ""
    where: Literal["last", "prompt"] = Field("last", alias="in")
    text: str | None = None
    reasoning: str | None = None
    tool_call: ToolCallSpec | None = None
    shell: str | None = None
    json_reply: bool = Field(False, alias="json")

    @field_validator("match")
    @classmethod
    def _compiles(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as e:
            raise ValueError(f"rule regex {v!r} does not compile: {e}") from e
        return v


DEFAULT_TEXT = "Hello from the polar-mitm fake backend."

# The built-in script, used by the README demo and by end-to-end tests of real harnesses.
DEFAULT_SCRIPT: tuple[Rule, ...] = (
    Rule(match=r"<tool_response>", text="Done. The command finished."),
    # Quotes are not part of the names: OpenCode wraps a one-argument prompt in double quotes.
    Rule(match=r"[Cc]reate ([^\s\"'`]+) containing ([^\s\"'`]+)", shell="printf '%s\\n' '\\2' > '\\1'"),
    Rule(match=r"run: (.+)", shell=r"\1"),
    Rule(match="", text=DEFAULT_TEXT),
)


def load_script(path: str | Path) -> list[Rule]:
    """Rules from a JSON file: a list of rules, or `{"rules": [...]}`."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read fake-backend script {str(path)!r}: {e}") from e
    if isinstance(data, dict):
        data = data.get("rules")
    if not isinstance(data, list):
        raise ValueError(
            f"fake-backend script {str(path)!r} must be a JSON list of rules or {{'rules': [...]}}"
        )
    return [Rule.model_validate(r) for r in data]


class FakeBackendConfig(BaseModel):
    """Everything `polar-mitm fake-backend` can be told."""

    model_config = ConfigDict(extra="forbid")

    tokenizer_path: str
    mode: Literal["scripted", "random"] = "scripted"
    script: list[Rule] | None = None  # None: DEFAULT_SCRIPT
    seed: int = 0
    weight_version: str = "0"
    token_delay: float = 0.0  # seconds between generated tokens
    first_token_delay: float = 0.0  # seconds before the first token
    model_path: str = "polar-mitm/fake"
    served_model_name: str | None = None  # default: model_path
    tool_call_parser: str | None = "qwen25"
    reasoning_parser: str | None = "qwen3"
    context_length: int = 32768
    random_vocab_size: int = 2048  # ordinary token ids the random model draws from (plus eos)
    random_eos_probability: float = 1 / 24  # at temperature 1, before truncation
    incremental_streaming_output: bool = False  # SGLang's --incremental-streaming-output
    fail_next: int = 0  # the first N generation requests answer HTTP 500
    request_log_size: int = 100
    hang_seconds: float = 3600.0  # how long a "hang" fault holds a request open

    def rules(self) -> list[Rule]:
        return list(self.script) if self.script is not None else list(DEFAULT_SCRIPT)


# --------------------------------------------------------------------------------------------
# Reading the prompt (pure)
# --------------------------------------------------------------------------------------------

_CHATML_BLOCK = re.compile(r"<\|im_start\|>([^\n<]*)\n(.*?)<\|im_end\|>", re.DOTALL)
_TOOLS_BLOCK = re.compile(r"<tools>(.*?)</tools>", re.DOTALL)

# Shell tools of the harnesses we drive, in the order we prefer them.
SHELL_TOOL_NAMES = (
    "Bash",
    "bash",
    "shell",
    "run_shell_command",
    "exec_command",
    "shell_command",
    "local_shell",
    "execute_bash",
)


def chatml_messages(prompt_text: str) -> list[tuple[str, str]]:
    """(role, content) of each complete `<|im_start|>ROLE\\n…<|im_end|>` block, in order."""
    return [(m.group(1).strip(), m.group(2)) for m in _CHATML_BLOCK.finditer(prompt_text)]


def last_message_text(prompt_text: str) -> str:
    """The content of the last complete user (or tool-result) message before the generation
    prompt; the whole text if the prompt is not ChatML. Harnesses append system notes after the
    user's words (Claude Code's deferred-tool list), so trailing system blocks are skipped."""
    blocks = chatml_messages(prompt_text)
    for role, content in reversed(blocks):
        if role != "system":
            return content
    return blocks[-1][1] if blocks else prompt_text


def declared_tools(prompt_text: str) -> list[dict[str, Any]]:
    """Tools declared in the prompt's `<tools>…</tools>` block (Qwen templates: one JSON per line),
    normalized to `{"name", "parameters"}`."""
    out: list[dict[str, Any]] = []
    for block in _TOOLS_BLOCK.findall(prompt_text):
        candidates: list[Any] = []
        stripped = block.strip()
        try:
            whole = json.loads(stripped)
            candidates = whole if isinstance(whole, list) else [whole]
        except ValueError:
            for line in stripped.splitlines():
                try:
                    candidates.append(json.loads(line))
                except ValueError:
                    continue
        for c in candidates:
            if not isinstance(c, dict):
                continue
            fn = c.get("function") if isinstance(c.get("function"), dict) else c
            name = fn.get("name")
            if isinstance(name, str):
                params = fn.get("parameters") or fn.get("input_schema") or {}
                out.append({"name": name, "parameters": params if isinstance(params, dict) else {}})
    return out


def is_code_mode_exec(tool: dict[str, Any]) -> bool:
    """Codex's code mode (its default models) offers no shell tool, only `exec`: a freeform tool
    (one string, `input`, once parsed) whose input is JavaScript that can call
    `tools.exec_command({cmd})`."""
    props = (tool.get("parameters") or {}).get("properties") or {}
    return tool["name"] == "exec" and set(props) == {"input"}


def find_shell_tool(tools: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    by_name = {t["name"]: t for t in tools}
    named = next((by_name[n] for n in SHELL_TOOL_NAMES if n in by_name), None)
    return named or next((t for t in tools if is_code_mode_exec(t)), None)


def shell_arguments(tool: dict[str, Any], command: str) -> dict[str, Any]:
    """Arguments for `tool` that run `command`, in the tool's own convention: a string `command`
    (Claude Code, Gemini CLI, Qwen Code, …), a list `["bash", "-lc", cmd]` where the schema says
    array (Codex `shell`), or `cmd` where that is the parameter (Codex `exec_command`). Other
    required parameters get minimal schema-valid values. Codex's code-mode `exec` gets a script."""
    if is_code_mode_exec(tool):
        return {
            "input": f"const r = await tools.exec_command({{cmd: {json.dumps(command)}}});\ntext(r.output);"
        }
    schema = tool.get("parameters") or {}
    props = schema.get("properties") or {}
    key = "command" if "command" in props else ("cmd" if "cmd" in props else "command")
    prop = props.get(key) or {}
    value: Any = ["bash", "-lc", command] if _schema_type(prop) == "array" else command
    args: dict[str, Any] = {key: value}
    for name in schema.get("required") or []:
        if name not in args and isinstance(name, str):
            args[name] = minimal_json_instance(props.get(name) or {"type": "string"}, schema)
    return args


def expand_groups(template: str, m: re.Match[str]) -> str:
    """`template` with `\\N` and `\\g<name>` replaced by `m`'s groups; every other backslash stays
    (so a rule can write `printf '%s\\n'`)."""

    def sub(g: re.Match[str]) -> str:
        ref = g.group(1) or g.group(2)
        try:
            return m.group(int(ref) if ref.isdigit() else ref) or ""
        except (IndexError, re.error):
            return g.group(0)

    return re.sub(r"\\(\d+)|\\g<(\w+)>", sub, template)


def _expand_value(value: Any, m: re.Match[str]) -> Any:
    if isinstance(value, str):
        return expand_groups(value, m)
    if isinstance(value, list):
        return [_expand_value(v, m) for v in value]
    if isinstance(value, dict):
        return {k: _expand_value(v, m) for k, v in value.items()}
    return value


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """A tool call exactly as Qwen2.5/Qwen3 write it."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def scripted_reply(
    rules: Sequence[Rule],
    prompt_text: str,
    json_schema: dict[str, Any] | bool | None = None,
) -> str:
    """The scripted model's whole reply (without eos) to a decoded prompt.

    With a `json_schema` (constrained decoding) the reply is always a minimal valid instance.
    """
    if json_schema is not None:
        return json.dumps(minimal_json_instance(json_schema), ensure_ascii=False)
    last = last_message_text(prompt_text)
    for rule in rules:
        m = re.search(rule.match, last if rule.where == "last" else prompt_text)
        if m is None:
            continue
        parts: list[str] = []
        if rule.reasoning is not None:
            parts.append(f"<think>\n{expand_groups(rule.reasoning, m)}\n</think>\n\n")
        if rule.json_reply:
            parts.append("{}")
            return "".join(parts)
        body: list[str] = []
        if rule.text is not None:
            body.append(expand_groups(rule.text, m))
        if rule.tool_call is not None:
            body.append(format_tool_call(rule.tool_call.name, _expand_value(rule.tool_call.arguments, m)))
        elif rule.shell is not None:
            command = expand_groups(rule.shell, m)
            tool = find_shell_tool(declared_tools(prompt_text))
            if tool is not None:
                body.append(format_tool_call(tool["name"], shell_arguments(tool, command)))
            elif rule.text is None:
                body.append(f"I would run: {command}")
        parts.append("\n\n".join(body))
        return "".join(parts)
    return DEFAULT_TEXT


# --------------------------------------------------------------------------------------------
# Minimal JSON-schema instances (pure): the fake's constrained decoding
# --------------------------------------------------------------------------------------------

_FORMAT_EXAMPLES = {
    "date-time": "1970-01-01T00:00:00Z",
    "date": "1970-01-01",
    "time": "00:00:00Z",
    "email": "a@example.com",
    "uri": "https://example.com",
    "url": "https://example.com",
    "uuid": "00000000-0000-0000-0000-000000000000",
    "ipv4": "127.0.0.1",
    "ipv6": "::1",
    "hostname": "example.com",
}


def _schema_type(schema: Any) -> str | None:
    if not isinstance(schema, dict):
        return None
    t = schema.get("type")
    if isinstance(t, list):
        non_null = [x for x in t if x != "null"]
        return non_null[0] if non_null else (t[0] if t else None)
    if isinstance(t, str):
        return t
    if "properties" in schema or "required" in schema:
        return "object"
    if "items" in schema or "prefixItems" in schema:
        return "array"
    return None


def _resolve_ref(ref: str, root: dict[str, Any]) -> Any:
    if not ref.startswith("#"):
        return {}
    node: Any = root
    for part in ref.lstrip("#").strip("/").split("/"):
        if not part:
            continue
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return {}
        node = node[part]
    return node


def minimal_json_instance(schema: Any, root: Any = None, _depth: int = 0) -> Any:
    """A small value valid for `schema`: required properties only, the first enum value, `""` /
    `0` / `false` / `[]` / `null` defaults respecting simple bounds, nested objects, `$ref`,
    `anyOf`/`oneOf` (first branch) and `allOf` (merged)."""
    root = schema if root is None else root
    if _depth > 32 or schema is True or schema is None:
        return {} if _depth == 0 else None
    if not isinstance(schema, dict):
        return None
    if "$ref" in schema:
        return minimal_json_instance(_resolve_ref(schema["$ref"], root), root, _depth + 1)
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    if isinstance(schema.get("allOf"), list) and schema["allOf"]:
        merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
        for part in schema["allOf"]:
            part = _resolve_ref(part["$ref"], root) if isinstance(part, dict) and "$ref" in part else part
            if isinstance(part, dict):
                merged.setdefault("properties", {}).update(part.get("properties") or {})
                merged["required"] = list(
                    dict.fromkeys([*(merged.get("required") or []), *(part.get("required") or [])])
                )
                for k, v in part.items():
                    if k not in ("properties", "required"):
                        merged.setdefault(k, v)
        return minimal_json_instance(merged, root, _depth + 1)
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            non_null = [o for o in options if not (isinstance(o, dict) and o.get("type") == "null")]
            return minimal_json_instance((non_null or options)[0], root, _depth + 1)
    t = _schema_type(schema)
    if t == "object" or (t is None and _depth == 0):
        props = schema.get("properties") or {}
        required = [r for r in schema.get("required") or [] if isinstance(r, str)]
        names = list(required)
        min_props = schema.get("minProperties") or 0
        for name in props:
            if len(names) >= min_props:
                break
            if name not in names:
                names.append(name)
        return {n: minimal_json_instance(props.get(n, {}), root, _depth + 1) for n in names}
    if t == "array":
        count = int(schema.get("minItems") or 0)
        prefix = schema.get("prefixItems") or []
        items = schema.get("items", {})
        out = [minimal_json_instance(p, root, _depth + 1) for p in prefix[:count]]
        while len(out) < count:
            out.append(minimal_json_instance(items if isinstance(items, dict) else {}, root, _depth + 1))
        return out
    if t == "string":
        fmt = schema.get("format")
        if isinstance(fmt, str) and fmt in _FORMAT_EXAMPLES:
            return _FORMAT_EXAMPLES[fmt]
        return "a" * int(schema.get("minLength") or 0)
    if t in ("integer", "number"):
        value: float = 0
        if "minimum" in schema:
            value = max(value, schema["minimum"])
        if "exclusiveMinimum" in schema and isinstance(schema["exclusiveMinimum"], int | float):
            value = max(value, schema["exclusiveMinimum"] + 1)
        if "maximum" in schema and value > schema["maximum"]:
            value = schema["maximum"]
        if t == "integer":
            value = int(np.ceil(value))
        return value
    if t == "boolean":
        return False
    if t == "null":
        return None
    return None


# --------------------------------------------------------------------------------------------
# The two models (pure)
# --------------------------------------------------------------------------------------------


def _hash64(*parts: Any) -> int:
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


def _ids_hash(ids: Sequence[int]) -> int:
    return int.from_bytes(
        hashlib.blake2b(np.asarray(ids, dtype=np.int64).tobytes(), digest_size=8).digest(), "little"
    )


def scripted_logprob(seed: int, position: int, token_id: int) -> float:
    """A deterministic logprob in (-5, 0] that survives float32 storage exactly."""
    k = _hash64("lp", seed, position, token_id) % 4_000_000
    return float(np.float32(-k / 800_000))


def _f32(x: float) -> float:
    return float(np.float32(x))


@dataclass
class GenParams:
    """SGLang sampling parameters after its normalization (`SamplingParams.__post_init__`)."""

    max_new_tokens: int | None = 128
    stop: list[str] = field(default_factory=list)
    stop_token_ids: set[int] = field(default_factory=set)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    json_schema: Any = None  # parsed
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int = 1
    logit_bias: dict[int, float] = field(default_factory=dict)
    sampling_seed: int | None = None

    @classmethod
    def from_sglang(cls, sp: dict[str, Any], vocab_size: int) -> GenParams:
        """Normalize and verify as SGLang does; raises ValueError with SGLang's messages."""

        def get(name: str, default: Any) -> Any:
            v = sp.get(name)
            return default if v is None else v

        p = cls()
        p.max_new_tokens = sp.get("max_new_tokens", 128)
        stop = sp.get("stop")
        p.stop = [stop] if isinstance(stop, str) else list(stop or [])
        if len(p.stop) > 32:
            raise ValueError(f"at most 32 stop strings are allowed, got {len(p.stop)}")
        p.stop_token_ids = {int(t) for t in sp.get("stop_token_ids") or [] if t is not None}
        p.temperature = float(get("temperature", 1.0))
        p.top_p = float(get("top_p", 1.0))
        p.top_k = int(get("top_k", -1))
        p.min_p = float(get("min_p", 0.0))
        p.frequency_penalty = float(get("frequency_penalty", 0.0))
        p.presence_penalty = float(get("presence_penalty", 0.0))
        p.repetition_penalty = float(get("repetition_penalty", 1.0))
        p.min_new_tokens = int(get("min_new_tokens", 0))
        p.n = int(get("n", 1))
        p.ignore_eos = bool(get("ignore_eos", False))
        p.skip_special_tokens = bool(get("skip_special_tokens", True))
        p.no_stop_trim = bool(get("no_stop_trim", False))
        p.stream_interval = max(1, int(get("stream_interval", 1)))
        p.sampling_seed = sp.get("sampling_seed")
        # SGLang's verify(), in its order and words.
        if not np.isfinite(p.temperature) or p.temperature < 0.0:
            raise ValueError(f"temperature must be a non-negative finite number, got {p.temperature}.")
        if p.temperature < 1e-6:  # greedy: SGLang sets top_k = 1 and temperature = 1
            p.temperature, p.top_k = 1.0, 1
        if not 0.0 < p.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p.top_p}.")
        if not 0.0 <= p.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {p.min_p}.")
        if p.top_k < 1 and p.top_k != -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {p.top_k}.")
        if not -2.0 <= p.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}.")
        if not -2.0 <= p.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {p.presence_penalty}.")
        if not 0.0 < p.repetition_penalty <= 2.0:
            raise ValueError(
                f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {p.repetition_penalty}."
            )
        if p.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens], got {p.min_new_tokens}.")
        if p.max_new_tokens is not None:
            if p.max_new_tokens < 0:
                raise ValueError(f"max_new_tokens must be at least 0, got {p.max_new_tokens}.")
            if p.min_new_tokens > p.max_new_tokens:
                raise ValueError(
                    f"min_new_tokens must be in [0, max_new_tokens({p.max_new_tokens})], got {p.min_new_tokens}."
                )
        for key, bias in (sp.get("logit_bias") or {}).items():
            try:
                tid = int(key)
            except ValueError:
                raise ValueError(f"logit_bias must has keys in [0, {vocab_size - 1}], got {key}.") from None
            if not 0 <= tid < vocab_size:
                raise ValueError(f"logit_bias must has keys in [0, {vocab_size - 1}], got {key}.")
            p.logit_bias[tid] = float(bias)
        grammars = [sp.get(k) or None for k in ("json_schema", "regex", "ebnf", "structural_tag")]
        if sum(g is not None for g in grammars) > 1:
            raise ValueError("Only one of json_schema, regex, ebnf, or structural_tag can be set.")
        if sp.get("json_schema"):
            try:
                p.json_schema = json.loads(sp["json_schema"])
            except ValueError as e:
                raise ValueError(f"Invalid json_schema {sp['json_schema'][:200]!r}: {e}") from e
        return p


@dataclass
class Step:
    """One generated token: its id, its logprob, and the top alternatives [(logprob, id)]."""

    token_id: int
    logprob: float
    top: list[tuple[float, int]] = field(default_factory=list)


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x[np.isfinite(x)]) if np.isfinite(x).any() else 0.0
    z = x - m
    return z - np.log(np.sum(np.exp(z)))


def truncation_mask(logprobs: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Which tokens survive top-k, top-p and min-p (SGLang's order: top-k, then top-p, then min-p)."""
    probs = np.exp(logprobs)
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros(len(probs), dtype=bool)
    k = len(probs) if top_k < 0 else min(top_k, len(probs))
    kept = order[:k]
    if top_p < 1.0:
        p = probs[kept] / probs[kept].sum()
        cum = np.cumsum(p)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        n = int(np.searchsorted(cum - p, top_p, side="left"))
        kept = kept[: max(1, n)]
    if min_p > 0.0:
        kept = kept[probs[kept] >= min_p * probs[kept].max()]
    keep[kept] = True
    return keep


class RandomModel:
    """A tiny seeded "language model": the logits over a restricted vocabulary are a hash of
    (seed, last few token ids); eos gets a fixed share of the mass at temperature 1."""

    def __init__(
        self,
        seed: int,
        vocab_ids: Iterable[int],
        eos_id: int,
        *,
        eos_probability: float = 1 / 24,
        context_window: int = 4,
        scale: float = 3.0,
    ) -> None:
        ordinary = sorted(set(vocab_ids) - {eos_id})
        if not ordinary:
            raise ValueError("the random model needs at least one ordinary token id")
        self.seed = seed
        self.eos_id = eos_id
        self.ids = np.array([*ordinary, eos_id], dtype=np.int64)
        self.eos_index = len(ordinary)
        self.index_of = {int(t): i for i, t in enumerate(self.ids)}
        self.context_window = context_window
        self.scale = scale
        self.eos_bonus = float(np.log(eos_probability / (1 - eos_probability)))

    def logits(self, context: Sequence[int]) -> np.ndarray:
        """Raw logits (float64) over `self.ids` after `context`."""
        tail = tuple(int(t) for t in context[-self.context_window :])
        rng = np.random.default_rng(_hash64("logits", self.seed, tail))
        x = rng.standard_normal(len(self.ids)) * self.scale
        others = np.delete(x, self.eos_index)
        m = others.max()
        x[self.eos_index] = m + np.log(np.exp(others - m).sum()) + self.eos_bonus
        return x

    def distribution(
        self,
        context: Sequence[int],
        params: GenParams,
        output_counts: Counter[int] | None = None,
        n_generated: int = 0,
    ) -> np.ndarray:
        """Log-probabilities over `self.ids` that the next token is sampled from, as SGLang reports
        them: penalties and logit bias applied, divided by temperature, log-softmaxed (top-k/top-p
        truncation happens after, when sampling)."""
        x = self.logits(context)
        if output_counts:
            for tid, count in output_counts.items():
                i = self.index_of.get(tid)
                if i is None:
                    continue
                x[i] -= params.frequency_penalty * count + params.presence_penalty
                if params.repetition_penalty != 1.0:
                    x[i] = x[i] / params.repetition_penalty if x[i] > 0 else x[i] * params.repetition_penalty
        for tid, bias in params.logit_bias.items():
            i = self.index_of.get(tid)
            if i is not None:
                x[i] += bias
        if n_generated < params.min_new_tokens:
            x[self.eos_index] = -np.inf
            for tid in params.stop_token_ids:
                i = self.index_of.get(tid)
                if i is not None:
                    x[i] = -np.inf
        return log_softmax(x / params.temperature)

    def step(
        self,
        context: Sequence[int],
        params: GenParams,
        rng: np.random.Generator,
        output_counts: Counter[int],
        n_generated: int,
        top_n: int = 0,
    ) -> Step:
        lp = self.distribution(context, params, output_counts, n_generated)
        keep = truncation_mask(lp, params.top_k, params.top_p, params.min_p)
        if params.top_k == 1:
            i = int(np.argmax(lp))
        else:
            p = np.where(keep, np.exp(lp), 0.0)
            i = int(rng.choice(len(p), p=p / p.sum()))
        top: list[tuple[float, int]] = []
        if top_n > 0:
            order = np.argsort(-lp, kind="stable")[:top_n]
            top = [(_f32(lp[j]), int(self.ids[j])) for j in order]
        return Step(int(self.ids[i]), _f32(lp[i]), top)


def random_vocab(tokenizer: Tokenizer, size: int, seed: int) -> list[int]:
    """`size` ordinary token ids (printable text, no special or tag tokens), chosen by `seed`."""
    tag = re.compile(r"^<[^<>\s]+>$")
    chosen: list[int] = []
    for tid in np.random.default_rng(seed).permutation(tokenizer.vocab_size):
        tid = int(tid)
        if tid in tokenizer.eos_token_ids:
            continue
        s = tokenizer.decode([tid], skip_special_tokens=True)
        if not s or "\ufffd" in s or tag.match(s) or any(ord(c) < 32 and c not in "\n\t" for c in s):
            continue
        chosen.append(tid)
        if len(chosen) >= size:
            break
    return chosen


@dataclass
class Generation:
    """A finished generation, before detokenization."""

    output_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[float, int]]]
    finish_reason: dict[str, Any]


class Engine:
    """Both models plus SGLang's stop logic, over one tokenizer."""

    def __init__(self, config: FakeBackendConfig, tokenizer: Tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.rules = config.rules()
        im_end = tokenizer.token_id("<|im_end|>")
        if im_end is None and not tokenizer.eos_token_ids:
            raise ValueError(f"tokenizer {tokenizer.path!r} has no eos token; the fake backend needs one")
        self.reply_eos = im_end if im_end is not None else min(tokenizer.eos_token_ids)
        self.eos_ids = frozenset(tokenizer.eos_token_ids) | {self.reply_eos}
        self._random: RandomModel | None = None
        think_end = tokenizer.token_id("</think>")
        self.think_end_id = think_end if config.reasoning_parser else None

    @property
    def random_model(self) -> RandomModel:
        if self._random is None:
            vocab = random_vocab(self.tokenizer, self.config.random_vocab_size, self.config.seed)
            self._random = RandomModel(
                self.config.seed, vocab, self.reply_eos, eos_probability=self.config.random_eos_probability
            )
        return self._random

    def reply_ids(self, prompt_ids: Sequence[int], params: GenParams) -> list[int]:
        """The scripted reply's token ids, eos included."""
        prompt_text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        text = scripted_reply(self.rules, prompt_text, params.json_schema)
        return [*self.tokenizer.encode(text), self.reply_eos]

    def generate(
        self, prompt_ids: Sequence[int], params: GenParams, *, top_n: int = 0, draw: int = 0
    ) -> Generation:
        """Generate to the end; `draw` picks the random model's sampling stream for this prompt
        (see `FakeBackendState.next_draw`)."""
        max_new = params.max_new_tokens
        if max_new is None:
            max_new = max(0, self.config.context_length - len(prompt_ids))
        if max_new == 0:
            return Generation([], [], [], {"type": "length", "length": 0})
        forced: list[int] | None = None
        if self.config.mode == "scripted":
            forced = self.reply_ids(prompt_ids, params)
        elif params.json_schema is not None:
            # Constrained decoding leaves one legal token per step: its logprob is 0.
            forced = [
                *self.tokenizer.encode(json.dumps(minimal_json_instance(params.json_schema))),
                self.reply_eos,
            ]
        rng = np.random.default_rng(
            [
                self.config.seed & 0xFFFFFFFF,
                draw & 0xFFFFFFFFFFFFFFFF,
                _ids_hash(prompt_ids),
            ]
        )
        stop_tails = [len(self.tokenizer.encode(s)) + 1 for s in params.stop]
        tail_len = max(stop_tails, default=0)
        out: list[int] = []
        lps: list[float] = []
        tops: list[list[tuple[float, int]]] = []
        counts: Counter[int] = Counter()
        context = list(prompt_ids)
        while True:
            i = len(out)
            if forced is not None:
                tid = forced[i % len(forced)]
                if self.config.mode == "scripted":
                    step = Step(
                        tid, scripted_logprob(self.config.seed, i, tid), self._scripted_top(tid, i, top_n)
                    )
                else:
                    step = Step(tid, 0.0, [(0.0, tid)] if top_n else [])
            else:
                step = self.random_model.step(context, params, rng, counts, i, top_n)
            out.append(step.token_id)
            lps.append(step.logprob)
            tops.append(step.top)
            counts[step.token_id] += 1
            context.append(step.token_id)
            finish = self._check_finished(out, params, tail_len, max_new)
            if finish is not None:
                return Generation(out, lps, tops, finish)

    def _check_finished(
        self, out: list[int], params: GenParams, tail_len: int, max_new: int
    ) -> dict[str, Any] | None:
        # SGLang's order (Req.update_finish_state): stop strings, then stop tokens / eos, then length.
        if params.stop:
            tail = self.tokenizer.decode(out[-tail_len:])
            for s in params.stop:
                if s and s in tail:
                    return {"type": "stop", "matched": s}
        last = out[-1]
        if not params.ignore_eos and (last in params.stop_token_ids or last in self.eos_ids):
            return {"type": "stop", "matched": last}
        if len(out) >= max_new:
            return {"type": "length", "length": max_new}
        return None

    def _scripted_top(self, tid: int, position: int, top_n: int) -> list[tuple[float, int]]:
        if top_n <= 0:
            return []
        lp = scripted_logprob(self.config.seed, position, tid)
        rest = max(1e-12, 1.0 - float(np.exp(lp)))
        top = [(lp, tid)]
        vocab = max(2, self.tokenizer.vocab_size)
        for j in range(top_n - 1):
            alt = (tid + 1 + _hash64("alt", self.config.seed, position, j) % (vocab - 1)) % vocab
            top.append((_f32(max(-1e4, np.log(rest) - (j + 1) * np.log(2.0))), int(alt)))
        top.sort(key=lambda t: -t[0])
        return top

    # --- detokenization, as SGLang's detokenizer does it --------------------------------------

    def output_text(self, gen: Generation, params: GenParams) -> str:
        ids = gen.output_ids
        matched = gen.finish_reason.get("matched")
        if isinstance(matched, int) and not params.no_stop_trim and ids:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
        if isinstance(matched, str):
            pos = text.find(matched)
            if pos != -1:
                text = text[: pos + len(matched)] if params.no_stop_trim else text[:pos]
        return text

    def partial_text(self, ids: Sequence[int], params: GenParams) -> str | None:
        """Text of an unfinished generation, or None while it ends inside a possible stop string
        (SGLang holds such chunks back)."""
        text = self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens).rstrip("\ufffd")
        for s in params.stop:
            if any(text.endswith(s[:n]) for n in range(1, len(s) + 1)):
                return None
        return text

    def reasoning_tokens(self, output_ids: Sequence[int]) -> int:
        if self.think_end_id is None or self.think_end_id not in output_ids:
            return 0
        return list(output_ids).index(self.think_end_id) + 1


# --------------------------------------------------------------------------------------------
# SGLang's request contract (the generated JSON gate in front of /generate)
# --------------------------------------------------------------------------------------------

SAMPLING_PARAM_FIELDS: dict[str, str] = {
    "max_new_tokens": "i64",
    "stop": "str_or_list",
    "stop_token_ids": "i64_list",
    "stop_regex": "str_or_list",
    "temperature": "f64",
    "top_p": "f64",
    "top_k": "i64",
    "min_p": "f64",
    "frequency_penalty": "f64",
    "presence_penalty": "f64",
    "repetition_penalty": "f64",
    "min_new_tokens": "i64",
    "n": "i64",
    "json_schema": "str",
    "regex": "str",
    "ebnf": "str",
    "structural_tag": "str",
    "ignore_eos": "bool",
    "skip_special_tokens": "bool",
    "spaces_between_special_tokens": "bool",
    "no_stop_trim": "bool",
    "stream_interval": "i64",
    "logit_bias": "f64_map",
    "sampling_seed": "i64",
    "custom_params": "any",
    "beam_width": "i64",
    "watermark": "map",
    "choice": "str_list",
}

# Top-level /generate fields we check the type of; unknown top-level keys are ignored by SGLang.
GENERATE_FIELDS: dict[str, str] = {
    "rid": "str_or_list",
    "text": "str_or_list",
    "input_ids": "ids",
    "stream": "bool",
    "return_logprob": "bool_or_list",
    "logprob_start_len": "i64_or_list",
    "top_logprobs_num": "i64_or_list",
    "token_ids_logprob": "ids",
    "return_text_in_logprobs": "bool",
    "return_prompt_token_ids": "bool",
}


class ContractError(ValueError):
    """A body SGLang's JSON contract refuses: HTTP 400 `{"error": "<message>"}`."""


def _unexpected(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    if isinstance(v, list):
        return "sequence"
    if isinstance(v, dict):
        return "map"
    return type(v).__name__


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_kind(v: Any, kind: str) -> None:
    if v is None or kind == "any":
        return
    expected = {
        "i64": "i64",
        "f64": "f64",
        "bool": "a boolean",
        "str": "a string",
        "map": "a map",
        "f64_map": "a map",
        "i64_list": "a sequence",
        "str_list": "a sequence",
        "ids": "a sequence",
        "str_or_list": "a string or a sequence of strings",
        "bool_or_list": "a boolean or a sequence of booleans",
        "i64_or_list": "an integer or a sequence of integers",
    }[kind]
    ok: bool
    if kind == "i64":
        ok = _is_int(v)
    elif kind == "f64":
        ok = isinstance(v, int | float) and not isinstance(v, bool)
    elif kind == "bool":
        ok = isinstance(v, bool)
    elif kind == "str":
        ok = isinstance(v, str)
    elif kind in ("map", "f64_map"):
        ok = isinstance(v, dict)
        if ok and kind == "f64_map":
            for x in v.values():
                _check_kind(x, "f64")
    elif kind == "i64_list":
        ok = isinstance(v, list)
        if ok:
            for x in v:
                _check_kind(x, "i64")
    elif kind == "str_list":
        ok = isinstance(v, list) and all(isinstance(x, str) for x in v)
    elif kind == "ids":
        ok = isinstance(v, list)
        # Fast path: a flat list of ints (the common 64k-token prompt) is checked in C.
        if ok and not all(type(x) is int for x in v):
            for x in v:
                if isinstance(x, list):
                    for y in x:
                        _check_kind(y, "i64")
                else:
                    _check_kind(x, "i64")
    elif kind == "str_or_list":
        ok = isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))
    elif kind == "bool_or_list":
        ok = isinstance(v, bool) or (isinstance(v, list) and all(isinstance(x, bool) for x in v))
    else:  # i64_or_list
        ok = _is_int(v) or (isinstance(v, list) and all(_is_int(x) for x in v))
    if not ok:
        raise ContractError(f"invalid type: {_unexpected(v)}, expected {expected}")


def check_sampling_params(sp: Any) -> None:
    """SGLang's contract for one `sampling_params` object: unknown keys are refused."""
    if not isinstance(sp, dict):
        raise ContractError(f"invalid type: {_unexpected(sp)}, expected struct SamplingParams")
    for key, value in sp.items():
        kind = SAMPLING_PARAM_FIELDS.get(key)
        if kind is None:
            listed = ", ".join(f"`{f}`" for f in SAMPLING_PARAM_FIELDS)
            raise ContractError(f"unknown field `{key}`, expected one of {listed}")
        _check_kind(value, kind)


def check_generate_body(body: Any) -> None:
    if not isinstance(body, dict):
        raise ContractError(f"invalid type: {_unexpected(body)}, expected struct GenerateRequest")
    for key, kind in GENERATE_FIELDS.items():
        if key in body:
            _check_kind(body[key], kind)
    sp = body.get("sampling_params")
    if isinstance(sp, list):
        for one in sp:
            check_sampling_params(one)
    elif sp is not None:
        check_sampling_params(sp)


# --------------------------------------------------------------------------------------------
# Output parsing for /v1/chat/completions (SGLang's qwen25 tool parser + qwen3 reasoning parser)
# --------------------------------------------------------------------------------------------

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_BLOCK = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)


@dataclass
class ParsedOutput:
    reasoning: str | None
    content: str
    tool_calls: list[tuple[str, str]]  # (name, arguments JSON)


def _held_back(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def parse_output(
    text: str, *, reasoning: bool, tools: bool, final: bool, hold: bool | None = None
) -> ParsedOutput:
    """Split generated text into reasoning, content and complete tool calls, as SGLang's qwen3
    reasoning parser and qwen25 tool parser do.

    `final` strips the parts the way SGLang's non-streaming parse does. `hold` (default: not
    `final`) treats the text as a prefix of a growing text: partial tags at its end are held back,
    so that on a growing text the parts only ever grow.
    """
    hold = (not final) if hold is None else hold
    reasoning_text: str | None = None
    rest = text
    split = False
    if reasoning:
        lead = text.lstrip()
        if lead.startswith(THINK_OPEN) or (final and THINK_CLOSE in text):
            split = True
            body = lead[len(THINK_OPEN) :] if lead.startswith(THINK_OPEN) else lead
            if THINK_CLOSE in body:
                reasoning_text, rest = body.split(THINK_CLOSE, 1)
                rest = rest.lstrip()
            else:
                reasoning_text = body[: len(body) - _held_back(body, THINK_CLOSE)] if hold else body
                rest = ""
            reasoning_text = reasoning_text.strip() if final else reasoning_text.lstrip()
        elif hold and lead and THINK_OPEN.startswith(lead):
            return ParsedOutput(None, "", [])
    calls: list[tuple[str, str]] = []
    if tools:
        idx = rest.find(TOOL_OPEN)
        if idx != -1:
            split = True
            for body in _TOOL_BLOCK.findall(rest):
                try:
                    obj = json.loads(body.strip())
                except ValueError:
                    continue
                if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                    args = obj.get("arguments", obj.get("parameters", {}))
                    args_json = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
                    calls.append((obj["name"], args_json))
            rest = rest[:idx]
        elif hold:
            rest = rest[: len(rest) - _held_back(rest, TOOL_OPEN)]
    if final and split:
        rest = rest.strip()
    if final and not reasoning_text:
        reasoning_text = None
    return ParsedOutput(reasoning_text, rest, calls)


# --------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------

FaultMode = Literal["http500", "garbage", "hang", "drop_midstream", "abort"]


class Fault(BaseModel):
    """`POST /_fake/fault` body: the next `count` generation requests (optionally only those on
    `path`) fail this way. `http500`: HTTP 500 with an SGLang error body; `garbage`: HTTP 200 with
    a body that is not JSON (or an SSE event that is not); `hang`: no answer until the server stops
    (or `hang_seconds`); `drop_midstream`: the connection is cut half-way through the body or
    stream; `abort`: the generation ends half-way with SGLang's graceful abort finish reason."""

    model_config = ConfigDict(extra="forbid")

    mode: FaultMode
    count: int = 1
    path: str | None = None


@dataclass
class _InFlight:
    rid: str
    aborted: bool = False


@dataclass
class FakeBackendState:
    """What one fake server remembers; tests reach it as `app[STATE]`."""

    config: FakeBackendConfig
    tokenizer: Tokenizer
    engine: Engine
    weight_version: str
    request_count: int = 0
    counts: Counter[str] = field(default_factory=Counter)
    requests: deque[dict[str, Any]] = field(default_factory=deque)
    faults: list[Fault] = field(default_factory=list)
    in_flight: dict[str, _InFlight] = field(default_factory=dict)
    prompt_cache: deque[np.ndarray] = field(default_factory=lambda: deque(maxlen=64))
    draws: Counter[int] = field(default_factory=Counter)  # samples drawn so far, per prompt
    shutting_down: asyncio.Event = field(default_factory=asyncio.Event)
    started_at: float = field(default_factory=time.time)

    def take_fault(self, path: str) -> FaultMode | None:
        for f in self.faults:
            if f.count > 0 and (f.path is None or f.path == path):
                f.count -= 1
                self.faults = [x for x in self.faults if x.count > 0]
                return f.mode
        return None

    def next_draw(self, prompt_ids: Sequence[int], params: GenParams, sample_index: int) -> int:
        """Which sampling stream a generation uses. With `sampling_seed` a request is reproducible
        by itself (as in SGLang); without, the k-th sample of a prompt takes the k-th stream, so a
        group of identical requests differs while a fresh server replays the same sequence."""
        if params.sampling_seed is not None:
            return _hash64("sampling_seed", params.sampling_seed, sample_index)
        key = _ids_hash(prompt_ids)
        self.draws[key] += 1
        return self.draws[key] - 1

    def cached_tokens(self, prompt_ids: Sequence[int]) -> int:
        """A radix cache's hit: the longest prefix shared with a recent prompt (at most len - 1)."""
        ids = np.asarray(prompt_ids, dtype=np.int64)
        best = 0
        for old in self.prompt_cache:
            n = min(len(old), len(ids))
            if n <= best:
                continue
            diff = np.nonzero(old[:n] != ids[:n])[0]
            best = max(best, int(diff[0]) if len(diff) else n)
        self.prompt_cache.append(ids)
        return min(best, max(0, len(ids) - 1))


STATE = web.AppKey("polar_mitm_fake_state", FakeBackendState)

_ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(text=_dumps(obj), status=status, content_type="application/json")


def _sse(obj: Any) -> bytes:
    return b"data: " + _dumps(obj).encode() + b"\n\n"


def _bad_request_validation(message: str) -> web.Response:
    """SGLang's RequestValidationError handler: FastAPI's 422 turned into a 400 ErrorResponse."""
    return _json(
        {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}, 400
    )


def _openai_error(message: str, status: int = 400, err_type: str = "BadRequestError") -> web.Response:
    """SGLang's OpenAIServingBase.create_error_response."""
    return _json(
        {"object": "error", "message": message, "type": err_type, "param": None, "code": status}, status
    )


async def _read_json(request: web.Request) -> tuple[Any, bytes, web.Response | None]:
    """(parsed body, raw body, error response if it is not JSON)."""
    raw = await request.read()
    try:
        body = json.loads(raw) if raw else None
    except (ValueError, UnicodeDecodeError) as e:
        return None, raw, _bad_request_validation(f"1 validation error:\n  JSON decode error: {e}")
    if body is None:
        return None, raw, _bad_request_validation("1 validation error:\n  body: Field required")
    return body, raw, None


@dataclass
class _Item:
    """One generation of a (possibly batched) request."""

    rid: str
    prompt_ids: list[int]
    params: GenParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False
    sample_index: int = 0
    index: int = 0
    cached_tokens: int = 0


class _Server:
    """Request handlers; all state lives in `FakeBackendState`."""

    def __init__(self, state: FakeBackendState) -> None:
        self.s = state

    # --- bookkeeping --------------------------------------------------------------------------

    def _log(self, request: web.Request, raw: bytes) -> None:
        # Raw text, parsed only when read: a parsed 30k-token prompt costs ~1 MB of Python ints.
        s = self.s
        s.request_count += 1
        s.counts[request.path] += 1
        s.requests.append(
            {
                "n": s.request_count,
                "method": request.method,
                "path": request.path,
                "body": raw.decode("utf-8", errors="replace"),
                "time": time.time(),
            }
        )
        while len(s.requests) > s.config.request_log_size:
            s.requests.popleft()

    async def _fault_response(self, fault: FaultMode, stream: bool) -> web.Response | None:
        """The response that replaces a normal one, or None for faults that act during generation."""
        if fault == "http500":
            return _json(
                {"error": {"message": "Internal server error (injected by the polar-mitm fake backend)"}}, 500
            )
        if fault == "garbage":
            if stream:
                return web.Response(body=b"data: {garbage\n\n", content_type="text/event-stream")
            return web.Response(body=b"\x00{not json at all\xff", content_type="application/json")
        if fault == "hang":
            try:
                await asyncio.wait_for(self.s.shutting_down.wait(), timeout=self.s.config.hang_seconds)
            except TimeoutError:
                pass
            return _json({"error": {"message": "hang fault released"}}, 503)
        return None

    # --- generation over time -----------------------------------------------------------------

    def _start(self, item: _Item) -> Generation:
        item.cached_tokens = self.s.cached_tokens(item.prompt_ids)
        self.s.in_flight[item.rid] = _InFlight(item.rid)
        draw = self.s.next_draw(item.prompt_ids, item.params, item.sample_index)
        return self.s.engine.generate(item.prompt_ids, item.params, top_n=item.top_logprobs_num, draw=draw)

    async def _steps(
        self, item: _Item, gen: Generation, fault: FaultMode | None
    ) -> AsyncIterator[tuple[int, dict[str, Any] | None]]:
        """(tokens so far, finish reason or None) as the tokens are "generated": honors the delays,
        aborts, `stream_interval` and the abort / drop_midstream faults."""
        cfg = self.s.config
        flight = self.s.in_flight[item.rid]
        n = len(gen.output_ids)
        cut = n // 2 if fault in ("abort", "drop_midstream") else None
        if n == 0:
            yield 0, gen.finish_reason
            return
        for k in range(1, n + 1):
            delay = cfg.first_token_delay if k == 1 else cfg.token_delay
            if delay > 0:
                await asyncio.sleep(delay)
            if flight.aborted or (fault == "abort" and cut is not None and k > cut):
                yield k - 1, dict(_ABORTED)
                return
            if fault == "drop_midstream" and cut is not None and k > cut:
                raise ConnectionResetError("drop_midstream fault")
            if k == n:
                yield k, gen.finish_reason
            elif k % item.params.stream_interval == 0:
                yield k, None

    def _output(
        self, item: _Item, gen: Generation, k: int, finish: dict[str, Any] | None, started: float
    ) -> dict[str, Any] | None:
        """The cumulative /generate output after k tokens; None while SGLang would hold it back."""
        engine = self.s.engine
        ids = gen.output_ids[:k]
        if finish is None:
            text = engine.partial_text(ids, item.params)
            if text is None:
                return None
        elif finish["type"] == "abort":
            text = engine.tokenizer.decode(ids, skip_special_tokens=item.params.skip_special_tokens)
        else:
            text = engine.output_text(gen, item.params)
        meta: dict[str, Any] = {
            "id": item.rid,
            "finish_reason": finish,
            "prompt_tokens": len(item.prompt_ids),
            "weight_version": self.s.weight_version,
            "num_retractions": 0,
        }
        if item.return_logprob:
            meta["input_token_logprobs"] = self._input_logprobs(item)
            meta["output_token_logprobs"] = [
                [gen.logprobs[i], gen.output_ids[i], self._token_text(item, gen.output_ids[i])]
                for i in range(k)
            ]
            meta["output_token_logprobs_length"] = k
            if item.top_logprobs_num > 0:
                meta["input_top_logprobs"] = self._input_top_logprobs(item)
                meta["output_top_logprobs"] = [
                    [[lp, tid, self._token_text(item, tid)] for lp, tid in gen.top_logprobs[i]]
                    for i in range(k)
                ]
        meta["reasoning_tokens"] = engine.reasoning_tokens(ids)
        meta["completion_tokens"] = k
        meta["cached_tokens"] = item.cached_tokens
        if finish is not None:
            meta["e2e_latency"] = time.perf_counter() - started
            meta["response_sent_to_client_ts"] = time.time()
        out: dict[str, Any] = {"text": text, "output_ids": list(ids), "meta_info": meta}
        if item.return_prompt_token_ids:
            out["prompt_token_ids"] = list(item.prompt_ids)
        return out

    def _token_text(self, item: _Item, tid: int) -> str | None:
        if not item.return_text_in_logprobs:
            return None
        return self.s.tokenizer.decode([tid], skip_special_tokens=False)

    def _prompt_logprob(self, pos: int, tid: int) -> float:
        return scripted_logprob(self.s.config.seed ^ 0x5EED, pos, tid)

    def _input_logprobs(self, item: _Item) -> list[list[Any]]:
        # From logprob_start_len on; the first entry has no logprob (nothing precedes it).
        start = item.logprob_start_len
        if start < 0:
            return []
        return [
            [None if pos == start else self._prompt_logprob(pos, tid), tid, self._token_text(item, tid)]
            for pos, tid in enumerate(item.prompt_ids)
            if pos >= start
        ]

    def _input_top_logprobs(self, item: _Item) -> list[Any]:
        start = item.logprob_start_len
        if start < 0:
            return []
        return [
            None if pos == start else [[self._prompt_logprob(pos, tid), tid, self._token_text(item, tid)]]
            for pos, tid in enumerate(item.prompt_ids)
            if pos >= start
        ]

    async def _run_to_end(self, item: _Item, fault: FaultMode | None) -> dict[str, Any]:
        started = time.perf_counter()
        gen = self._start(item)
        try:
            last: dict[str, Any] | None = None
            async for k, finish in self._steps(item, gen, fault):
                if finish is not None:
                    last = self._output(item, gen, k, finish, started)
            assert last is not None
            return last
        finally:
            self.s.in_flight.pop(item.rid, None)

    # --- /generate ----------------------------------------------------------------------------

    def _items(self, body: dict[str, Any]) -> tuple[list[_Item], bool]:
        """A /generate body as generations, and whether the answer is a list; raises ValueError
        with SGLang's messages."""
        tok = self.s.tokenizer
        input_ids, text = body.get("input_ids"), body.get("text")
        if input_ids is not None:
            batch = bool(input_ids) and isinstance(input_ids[0], list)
            prompts = [list(p) for p in input_ids] if batch else [list(input_ids)]
        elif text is not None:
            batch = isinstance(text, list)
            prompts = [tok.encode(t) for t in (text if batch else [text])]
        else:
            raise ValueError("Either text, input_ids or input_embeds should be provided.")
        for p in prompts:
            self._check_prompt(p)

        def per(name: str, i: int, default: Any) -> Any:
            v = body.get(name)
            if isinstance(v, list):
                v = v[i] if i < len(v) else None
            return default if v is None else v

        sps, rids = body.get("sampling_params"), body.get("rid")
        items: list[_Item] = []
        for i, prompt in enumerate(prompts):
            sp = (sps[i] if i < len(sps) else {}) if isinstance(sps, list) else (sps or {})
            params = GenParams.from_sglang(sp, tok.vocab_size)
            max_new = params.max_new_tokens
            if max_new is not None and max_new + len(prompt) > self.s.config.context_length:
                raise ValueError(
                    "Requested token count exceeds the model's maximum context length of "
                    f"{self.s.config.context_length} tokens. You requested a total of {max_new + len(prompt)} "
                    f"tokens: {len(prompt)} tokens from the input messages and {max_new} tokens for the "
                    "completion. Please reduce the number of tokens in the input messages or the completion "
                    "to fit within the limit."
                )
            return_logprob = bool(per("return_logprob", i, False))
            start = int(per("logprob_start_len", i, -1))
            if return_logprob and start > len(prompt):
                raise ValueError(
                    f"logprob_start_len={start} is higher than the number of input tokens "
                    f"{len(prompt)}. Please use a smaller logprob_start_len."
                )
            rid = (
                rids[i]
                if isinstance(rids, list) and i < len(rids)
                else (f"{rids}_{i}" if batch and rids else rids)
            )
            for j in range(params.n):
                if not isinstance(rid, str):
                    this_rid = uuid.uuid4().hex
                else:
                    this_rid = rid if params.n == 1 else f"{rid}_{j}"
                items.append(
                    _Item(
                        rid=this_rid,
                        prompt_ids=prompt,
                        params=params,
                        return_logprob=return_logprob,
                        logprob_start_len=start if return_logprob else -1,
                        top_logprobs_num=int(per("top_logprobs_num", i, 0)) if return_logprob else 0,
                        return_text_in_logprobs=bool(body.get("return_text_in_logprobs") or False),
                        return_prompt_token_ids=bool(body.get("return_prompt_token_ids") or False),
                        sample_index=j,
                        index=len(items),
                    )
                )
        return items, batch or len(items) > 1

    def _check_prompt(self, prompt: Sequence[int]) -> None:
        vocab = self.s.tokenizer.vocab_size
        if not prompt:
            raise ValueError("input_ids cannot be empty.")
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(
                f"input_ids contains out-of-vocabulary token id {bad}; valid range is [0, {vocab})."
            )
        if len(prompt) >= self.s.config.context_length:
            raise ValueError(
                f"The input ({len(prompt)} tokens) is longer than the model's context length "
                f"({self.s.config.context_length} tokens)."
            )

    async def _stream_item(self, item: _Item, fault: FaultMode | None, tagged: bool) -> AsyncIterator[bytes]:
        started = time.perf_counter()
        gen = self._start(item)
        incremental = self.s.config.incremental_streaming_output
        sent_ids, sent_text = 0, ""
        try:
            async for k, finish in self._steps(item, gen, fault):
                out = self._output(item, gen, k, finish, started)
                if out is None:
                    continue
                if incremental:  # SGLang's --incremental-streaming-output: output-side deltas only
                    text = out["text"]
                    out["text"] = text[len(sent_text) :] if text.startswith(sent_text) else text
                    out["output_ids"] = out["output_ids"][sent_ids:]
                    meta = out["meta_info"]
                    for key in ("output_token_logprobs", "output_top_logprobs"):
                        if key in meta:
                            meta[key] = meta[key][sent_ids:]
                    sent_ids, sent_text = k, text
                if tagged:
                    out["index"] = item.index
                yield _sse(out)
        finally:
            self.s.in_flight.pop(item.rid, None)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body, raw, err = await _read_json(request)
        self._log(request, raw)
        if err is not None:
            return err
        try:
            check_generate_body(body)
        except ContractError as e:
            return _json({"error": str(e)}, 400)
        stream = bool(body.get("stream"))
        fault = self.s.take_fault(request.path)
        if fault is not None and (replaced := await self._fault_response(fault, stream)) is not None:
            return replaced
        if not stream:
            try:
                items, batch = self._items(body)
            except ValueError as e:
                return _json({"error": {"message": str(e)}}, 400)
            if fault == "drop_midstream":
                return await self._drop_body(request, items[0])
            outs = [await self._run_to_end(item, fault) for item in items]
            return _json(outs if batch else outs[0])
        # SGLang validates a streamed request inside its stream: errors arrive as an SSE event.
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        try:
            try:
                items, batch = self._items(body)
            except ValueError as e:
                error = {"message": str(e), "type": "invalid_request_error", "code": 400, "retryable": False}
                await resp.write(_sse({"error": error}))
            else:
                for item in items:
                    async with contextlib.aclosing(self._stream_item(item, fault, tagged=batch)) as chunks:
                        async for chunk in chunks:
                            await resp.write(chunk)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            _drop(request)
        return resp

    async def _drop_body(self, request: web.Request, item: _Item) -> web.StreamResponse:
        data = _dumps(await self._run_to_end(item, None)).encode()
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = len(data)
        await resp.prepare(request)
        await resp.write(data[: len(data) // 2])
        _drop(request)
        return resp

    # --- /v1/chat/completions -----------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body, raw, err = await _read_json(request)
        self._log(request, raw)
        if err is not None:
            return err
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
            return _bad_request_validation(
                "1 validation error:\n  messages: Field required (a non-empty list)"
            )
        stream = bool(body.get("stream"))
        fault = self.s.take_fault(request.path)
        if fault is not None and (replaced := await self._fault_response(fault, stream)) is not None:
            return replaced
        if stream:
            for flag in ("return_prompt_token_ids", "return_token_ids", "return_meta_info"):
                if body.get(flag):
                    return _openai_error(
                        f"{flag} is not supported with streaming. Please set stream=false when using {flag}=true."
                    )
        try:
            item, tools_active = self._chat_item(body)
        except (ValueError, TypeError) as e:
            return _openai_error(str(e))
        model = str(body.get("model") or "default")
        if not stream:
            if fault == "drop_midstream":
                return await self._drop_body(request, item)
            out = await self._run_to_end(item, fault)
            return _json(self._chat_response(body, item, out, model, tools_active))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        try:
            async with contextlib.aclosing(
                self._chat_stream(body, item, fault, model, tools_active)
            ) as chunks:
                async for chunk in chunks:
                    await resp.write(chunk)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            _drop(request)
        return resp

    def _chat_item(self, body: dict[str, Any]) -> tuple[_Item, bool]:
        """The chat request as one generation (ChatCompletionRequest.to_sampling_params)."""
        tok = self.s.tokenizer
        tools = body.get("tools") or None
        tool_choice = body.get("tool_choice") or ("auto" if tools else "none")
        tools_active = bool(tools) and tool_choice != "none" and self.s.config.tool_call_parser is not None
        if body.get("input_ids") is not None:
            prompt_ids = [int(t) for t in body["input_ids"]]
        else:
            messages = [_template_message(m) for m in body["messages"]]
            kwargs = dict(body.get("chat_template_kwargs") or {})
            try:
                prompt = tok.render(messages, tools=tools if tool_choice != "none" else None, **kwargs)
            except Exception as e:  # a template that refuses the messages is the caller's bad request
                raise ValueError(f"Failed to apply the chat template: {e}") from e
            prompt_ids = tok.encode(prompt)
        self._check_prompt(prompt_ids)
        sp: dict[str, Any] = {
            "max_new_tokens": body.get("max_completion_tokens") or body.get("max_tokens"),
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "top_k": body.get("top_k"),
            "min_p": body.get("min_p"),
            "stop": body.get("stop"),
            "stop_token_ids": body.get("stop_token_ids"),
            "frequency_penalty": body.get("frequency_penalty"),
            "presence_penalty": body.get("presence_penalty"),
            "repetition_penalty": body.get("repetition_penalty"),
            "min_new_tokens": body.get("min_tokens"),
            "n": body.get("n"),
            "ignore_eos": body.get("ignore_eos"),
            "no_stop_trim": body.get("no_stop_trim"),
            # SGLang keeps special tokens in the text when tools are in play.
            "skip_special_tokens": False if tools_active else body.get("skip_special_tokens"),
            "logit_bias": body.get("logit_bias"),
            "sampling_seed": body.get("seed"),
        }
        if sp["max_new_tokens"] is None:
            sp.pop("max_new_tokens")
            sp["max_new_tokens"] = None  # the rest of the context, as SGLang does
        rf = body.get("response_format")
        if isinstance(rf, dict) and rf.get("type") == "json_schema":
            js = rf.get("json_schema") or {}
            sp["json_schema"] = json.dumps(js.get("schema", {}))
        elif isinstance(rf, dict) and rf.get("type") == "json_object":
            sp["json_schema"] = '{"type": "object"}'
        params = GenParams.from_sglang(
            {k: v for k, v in sp.items() if v is not None or k == "max_new_tokens"}, tok.vocab_size
        )
        if params.n != 1:
            raise ValueError("the fake backend's /v1/chat/completions supports n=1 only")
        logprobs = bool(body.get("logprobs"))
        item = _Item(
            rid=str(body.get("rid") or uuid.uuid4().hex),
            prompt_ids=prompt_ids,
            params=params,
            return_logprob=logprobs or bool(body.get("return_meta_info")),
            top_logprobs_num=int(body.get("top_logprobs") or 0) if logprobs else 0,
            return_text_in_logprobs=True,
            return_prompt_token_ids=bool(
                body.get("return_prompt_token_ids")
                or body.get("return_token_ids")
                or body.get("return_input_ids_in_sglext")
            ),
        )
        return item, tools_active

    def _parse(
        self, text: str, tools_active: bool, body: dict[str, Any], *, final: bool, hold: bool
    ) -> ParsedOutput:
        reasoning = (
            self.s.config.reasoning_parser is not None and body.get("separate_reasoning", True) is not False
        )
        return parse_output(text, reasoning=reasoning, tools=tools_active, final=final, hold=hold)

    def _choice_logprobs(self, entries: list[list[Any]], tops: list[Any] | None) -> dict[str, Any]:
        content = []
        for i, (lp, tid, text) in enumerate(entries):
            token = text if text is not None else self.s.tokenizer.decode([tid])
            top = []
            for tlp, ttid, ttext in tops[i] if tops and i < len(tops) and tops[i] else []:
                t = ttext if ttext is not None else self.s.tokenizer.decode([ttid])
                top.append({"token": t, "bytes": list(t.encode()), "logprob": tlp})
            content.append(
                {"token": token, "bytes": list(token.encode()), "logprob": lp, "top_logprobs": top}
            )
        return {"content": content}

    @staticmethod
    def _usage(meta: dict[str, Any]) -> dict[str, Any]:
        prompt, completion = meta["prompt_tokens"], meta["completion_tokens"]
        reasoning = meta.get("reasoning_tokens", 0)
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": None,
            "reasoning_tokens": reasoning,
            "completion_tokens_details": {"reasoning_tokens": reasoning} if reasoning else None,
        }

    @staticmethod
    def _sglext(body: dict[str, Any], item: _Item, output_ids: list[int]) -> dict[str, Any] | None:
        want_in, want_out = (
            bool(body.get("return_input_ids_in_sglext")),
            bool(body.get("return_output_ids_in_sglext")),
        )
        if not (want_in or want_out):
            return None
        return {
            "routed_experts": None,
            "cached_tokens_details": None,
            "spec_tokens_details": None,
            "input_ids": list(item.prompt_ids) if want_in else None,
            "output_ids": [list(output_ids)] if want_out else None,
        }

    def _chat_response(
        self, body: dict[str, Any], item: _Item, out: dict[str, Any], model: str, tools_active: bool
    ) -> dict[str, Any]:
        meta = out["meta_info"]
        finish = dict(meta["finish_reason"])
        parsed = self._parse(out["text"], tools_active, body, final=True, hold=False)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": parsed.content,
            "reasoning_content": parsed.reasoning,
        }
        if parsed.tool_calls:
            message["tool_calls"] = [
                {"id": _call_id(), "index": i, "type": "function", "function": {"name": n, "arguments": a}}
                for i, (n, a) in enumerate(parsed.tool_calls)
            ]
            if finish["type"] == "stop":
                finish = {"type": "tool_calls", "matched": None}
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": (
                self._choice_logprobs(meta["output_token_logprobs"], meta.get("output_top_logprobs"))
                if body.get("logprobs")
                else None
            ),
            "finish_reason": finish["type"],
            "matched_stop": finish.get("matched"),
        }
        if body.get("return_prompt_token_ids") or body.get("return_token_ids"):
            choice["prompt_token_ids"] = out.get("prompt_token_ids")
        if body.get("return_token_ids"):
            choice["response_token_ids"] = out["output_ids"]
        if body.get("return_meta_info"):
            choice["meta_info"] = meta
        response: dict[str, Any] = {
            "id": meta["id"],
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": self._usage(meta),
            "metadata": {"weight_version": meta["weight_version"]},
        }
        if (sglext := self._sglext(body, item, out["output_ids"])) is not None:
            response["sglext"] = sglext
        return response

    async def _chat_stream(
        self, body: dict[str, Any], item: _Item, fault: FaultMode | None, model: str, tools_active: bool
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        head = {"id": item.rid, "object": "chat.completion.chunk", "created": created, "model": model}
        opts = body.get("stream_options")
        include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))

        def delta_chunk(
            delta: dict[str, Any], logprobs: Any = None, finish: str | None = None, matched: Any = None
        ) -> bytes:
            # sse_utils.build_sse_content: `reasoning_content` always present, role/content when set.
            d = {"reasoning_content": delta.get("reasoning_content")}
            d.update({k: delta[k] for k in ("role", "content") if delta.get(k) is not None})
            choice = {
                "index": 0,
                "delta": d,
                "logprobs": logprobs,
                "finish_reason": finish,
                "matched_stop": matched,
            }
            return _sse({**head, "choices": [choice]})

        def model_chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            # ChatCompletionStreamResponse.model_dump_json(): every field, nulls included.
            return _sse({**head, "choices": choices, "usage": extra.pop("usage", None), **extra})

        started = time.perf_counter()
        gen = self._start(item)
        prev = ParsedOutput(None, "", [])
        sent_lp = 0
        last: dict[str, Any] | None = None
        try:
            async for k, finish in self._steps(item, gen, fault):
                out = self._output(item, gen, k, finish, started)
                if out is None:
                    continue
                if last is None:
                    yield delta_chunk({"role": "assistant", "content": ""})
                last = out
                lp = None
                if body.get("logprobs") and k > sent_lp:
                    meta = out["meta_info"]
                    tops = meta.get("output_top_logprobs")
                    lp = self._choice_logprobs(
                        meta["output_token_logprobs"][sent_lp:k], tops[sent_lp:k] if tops else None
                    )
                    sent_lp = k
                cur = self._parse(out["text"], tools_active, body, final=False, hold=finish is None)
                if new := (cur.reasoning or "")[len(prev.reasoning or "") :]:
                    yield delta_chunk({"reasoning_content": new}, logprobs=lp)
                    lp = None
                if cur.content.startswith(prev.content) and (new := cur.content[len(prev.content) :]):
                    yield delta_chunk({"content": new}, logprobs=lp)
                    lp = None
                for i in range(len(prev.tool_calls), len(cur.tool_calls)):
                    name, args = cur.tool_calls[i]
                    for call in (
                        {
                            "id": _call_id(),
                            "index": i,
                            "type": "function",
                            "function": {"name": name, "arguments": ""},
                        },
                        {
                            "id": None,
                            "index": i,
                            "type": "function",
                            "function": {"name": None, "arguments": args},
                        },
                    ):
                        delta = {
                            "role": None,
                            "content": None,
                            "reasoning_content": None,
                            "tool_calls": [call],
                        }
                        choice = {
                            "index": 0,
                            "delta": delta,
                            "logprobs": lp,
                            "finish_reason": None,
                            "matched_stop": None,
                        }
                        yield model_chunk([choice])
                        lp = None
                if lp is not None:
                    yield delta_chunk({}, logprobs=lp)
                if cur.content.startswith(prev.content):
                    prev = cur
                else:
                    prev = ParsedOutput(cur.reasoning, prev.content, cur.tool_calls)
        finally:
            self.s.in_flight.pop(item.rid, None)
        assert last is not None
        meta = last["meta_info"]
        finish = meta["finish_reason"]
        ftype = "tool_calls" if prev.tool_calls and finish["type"] == "stop" else finish["type"]
        yield delta_chunk({}, finish=ftype, matched=None if ftype == "tool_calls" else finish.get("matched"))
        if (sglext := self._sglext(body, item, last["output_ids"])) is not None:
            yield model_chunk([], sglext=sglext)
        if include_usage:
            yield model_chunk([], usage=self._usage(meta))

    # --- info and control endpoints -----------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        cfg = self.s.config
        return _json(
            {
                "model_path": cfg.model_path,
                "served_model_name": cfg.served_model_name or cfg.model_path,
                "tokenizer_path": cfg.tokenizer_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.s.weight_version,
                "load_format": "dummy",
                "reasoning_parser": cfg.reasoning_parser,
                "tool_call_parser": cfg.tool_call_parser,
                "disaggregation_mode": "null",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "polar_mitm_fake",
                "architectures": ["PolarMitmFakeForCausalLM"],
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        cfg = self.s.config
        return _json(
            {
                "model_path": cfg.model_path,
                "tokenizer_path": cfg.tokenizer_path,
                "served_model_name": cfg.served_model_name or cfg.model_path,
                "context_length": cfg.context_length,
                "tool_call_parser": cfg.tool_call_parser,
                "reasoning_parser": cfg.reasoning_parser,
                "weight_version": self.s.weight_version,
                "incremental_streaming_output": cfg.incremental_streaming_output,
                "random_seed": cfg.seed,
                "fake_mode": cfg.mode,
                "startup_time": self.s.started_at,
                "internal_states": [{}],
                "version": f"polar-mitm-fake (emulating sglang {SGLANG_VERSION_EMULATED})",
                "frontend": "python",
            }
        )

    async def models(self, request: web.Request) -> web.Response:
        name = self.s.config.served_model_name or self.s.config.model_path
        card = {
            "id": name,
            "object": "model",
            "created": int(self.s.started_at),
            "owned_by": "sglang",
            "root": name,
            "parent": None,
            "max_model_len": self.s.config.context_length,
        }
        return _json({"object": "list", "data": [card]})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body, raw, err = await _read_json(request)
        self._log(request, raw)
        if err is not None:
            return err
        if not isinstance(body, dict) or not isinstance(body.get("new_version"), str):
            return _bad_request_validation("1 validation error:\n  new_version: Field required (a string)")
        if body.get("abort_all_requests", True):  # SGLang's default aborts running requests
            for flight in self.s.in_flight.values():
                flight.aborted = True
        version = body["new_version"]
        self.s.weight_version = version
        return _json(
            {"success": True, "message": f"Weight version updated to {version}", "new_version": version}
        )

    async def abort_request(self, request: web.Request) -> web.Response:
        body, raw, err = await _read_json(request)
        self._log(request, raw)
        if err is not None:
            return err
        body = body if isinstance(body, dict) else {}
        rid = str(body.get("rid") or "")
        for key, flight in self.s.in_flight.items():
            if body.get("abort_all") or (rid and key.startswith(rid)):
                flight.aborted = True
        return web.Response(status=200)

    async def flush_cache(self, request: web.Request) -> web.Response:
        self.s.prompt_cache.clear()
        return web.Response(
            text="Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
            "requests, the operation will not be performed.)\n"
        )

    # --- /_fake admin -------------------------------------------------------------------------

    async def fake_fault(self, request: web.Request) -> web.Response:
        try:
            fault = Fault.model_validate(await request.json())
        except (ValueError, TypeError) as e:
            return _json({"error": {"message": f"bad fault: {e}"}}, 400)
        if fault.count > 0:
            self.s.faults.append(fault)
        return _json({"success": True, "pending": [f.model_dump() for f in self.s.faults]})

    async def fake_requests(self, request: web.Request) -> web.Response:
        reqs, parsed = list(self.s.requests), []
        last = request.query.get("last", "")
        if last.isdigit():
            reqs = reqs[len(reqs) - int(last) :] if int(last) else []
        for r in reqs:
            try:
                r = r | {"body": json.loads(r["body"])}
            except ValueError:
                pass
            parsed.append(r)
        return _json({"count": self.s.request_count, "counts": dict(self.s.counts), "requests": parsed})

    async def fake_reset(self, request: web.Request) -> web.Response:
        s = self.s
        s.requests.clear()
        s.counts.clear()
        s.request_count = 0
        s.faults.clear()
        s.prompt_cache.clear()
        s.draws.clear()
        s.weight_version = s.config.weight_version
        return _json({"success": True})

    async def fake_state(self, request: web.Request) -> web.Response:
        return _json(
            {
                "mode": self.s.config.mode,
                "weight_version": self.s.weight_version,
                "request_count": self.s.request_count,
                "in_flight": sorted(self.s.in_flight),
                "pending_faults": [f.model_dump() for f in self.s.faults],
            }
        )


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _template_message(m: Any) -> dict[str, Any]:
    """An OpenAI chat message as Hugging Face chat templates expect it."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ValueError("each message must be an object with a string `role`")
    out = dict(m)
    if out["role"] == "developer":
        out["role"] = "system"
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = "".join(
            p.get("text", "")
            for p in content
            if isinstance(p, dict) and p.get("type") in ("text", "input_text")
        )
    elif content is None:
        out["content"] = ""
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        fixed = []
        for c in calls:
            c = dict(c)
            fn = dict(c.get("function") or {})
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    pass
            c["function"] = fn
            fixed.append(c)
        out["tool_calls"] = fixed
    return out


def _drop(request: web.Request) -> None:
    """Cut the connection without finishing the response (a backend crash, seen from outside)."""
    transport = request.transport
    if transport is not None:
        transport.abort()


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


def create_app(config: FakeBackendConfig) -> web.Application:
    """The fake server as an aiohttp application (state at `app[STATE]`)."""
    tokenizer = Tokenizer.load(config.tokenizer_path)
    state = FakeBackendState(
        config=config,
        tokenizer=tokenizer,
        engine=Engine(config, tokenizer),
        weight_version=config.weight_version,
    )
    if config.fail_next > 0:
        state.faults.append(Fault(mode="http500", count=config.fail_next))
    server = _Server(state)
    app = web.Application(client_max_size=1024**3)
    app[STATE] = state
    r = app.router
    r.add_post("/generate", server.generate)
    r.add_put("/generate", server.generate)
    r.add_post("/v1/chat/completions", server.chat)
    r.add_get("/health", server.health)
    r.add_get("/health_generate", server.health)
    r.add_get("/model_info", server.model_info)
    r.add_get("/get_model_info", server.model_info)
    r.add_get("/server_info", server.server_info)
    r.add_get("/get_server_info", server.server_info)
    r.add_get("/v1/models", server.models)
    r.add_post("/update_weight_version", server.update_weight_version)
    r.add_post("/abort_request", server.abort_request)
    r.add_route("*", "/flush_cache", server.flush_cache)
    r.add_post("/_fake/fault", server.fake_fault)
    r.add_get("/_fake/requests", server.fake_requests)
    r.add_post("/_fake/reset", server.fake_reset)
    r.add_get("/_fake/state", server.fake_state)

    async def on_shutdown(app: web.Application) -> None:
        app[STATE].shutting_down.set()

    app.on_shutdown.append(on_shutdown)
    return app


async def start_fake_backend(
    config: FakeBackendConfig, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, str]:
    """Start the server in the running event loop; returns the runner (`await runner.cleanup()`
    stops it) and the base URL."""
    runner = web.AppRunner(create_app(config), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound_host, bound_port = runner.addresses[0][:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    return runner, f"http://{shown}:{bound_port}"


def serve(config: FakeBackendConfig, host: str = "127.0.0.1", port: int = 30000) -> None:
    """Run the server until interrupted; prints its URL once it is listening."""

    async def main() -> None:
        runner, url = await start_fake_backend(config, host, port)
        print(f"polar-mitm fake backend ({config.mode}) listening on {url}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
