"""The scripted model's script (pure): the ordered `Rule`s a reply is picked by, and what turns the
chosen rule into the exact text a Qwen model would write.

Reading a decoded ChatML prompt (its messages, and the tools its `<tools>` block declares), finding
the harness's shell tool and writing its arguments in that tool's own convention, expanding a
rule's regex groups, and formatting tool calls as `<tool_call>\\n{...}\\n</tool_call>`.
`scripted_logprob` is the deterministic float32 logprob the scripted model reports per token.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from polar_mitm.fake.json_schema import _schema_type, minimal_json_instance
from polar_mitm.fake.model import _hash64

# --------------------------------------------------------------------------------------------
# Rules
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
    "Shell",
    "run_shell_command",
    "execute_command",
    "run_command",
    "run_commands",
    "exec_command",
    "shell_command",
    "local_shell",
    "execute_bash",
    "terminal",
    "run_terminal_cmd",
    "run_in_terminal",
)
# A tool name that says it runs commands, for shell tools of harnesses not listed above.
_SHELL_WORDS = re.compile(r"bash|shell|terminal|command|cmd|exec", re.IGNORECASE)


def chatml_messages(prompt_text: str) -> list[tuple[str, str]]:
    """(role, content) of each complete `<|im_start|>ROLE\\n…<|im_end|>` block, in order."""
    return [(m.group(1).strip(), m.group(2)) for m in _CHATML_BLOCK.finditer(prompt_text)]


def last_message_text(prompt_text: str) -> str:
    """What the harness sent since the model last spoke: the user (or tool-result) messages after
    the last assistant message, joined; the whole text if the prompt is not ChatML. Harnesses put
    more than the user's words there (Claude Code appends its deferred-tool list as a system
    block, skipped; OpenClaw sends its context block as a user message of its own after the
    task), and the task must be found wherever it is."""
    blocks = chatml_messages(prompt_text)
    new: list[str] = []
    for role, content in reversed(blocks):
        if role == "assistant":
            break
        if role != "system":
            new.append(content)
    if new:
        return "\n".join(reversed(new))
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
            function = c.get("function")
            fn = function if isinstance(function, dict) else c
            name = fn.get("name")
            if isinstance(name, str):
                params = fn.get("parameters") or fn.get("input_schema") or {}
                out.append({"name": name, "parameters": params if isinstance(params, dict) else {}})
    return out


def is_code_mode_exec(tool: dict[str, Any]) -> bool:
    """Codex's code mode (its default models) offers no shell tool, only `exec`: a freeform tool
    (one string, `input`, once parsed) whose input is JavaScript that can call
    `tools.exec_command({cmd})`."""
    params = tool.get("parameters")
    props = params.get("properties") if isinstance(params, dict) else None
    return tool["name"] == "exec" and isinstance(props, dict) and set(props) == {"input"}


def find_shell_tool(tools: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The tool the harness runs shell commands with, by name, then by schema: a known name (in
    our order), the same name in another case or spelling (`RunCommand`, `run-shell-command`,
    `mcp__x__bash`), then any tool whose name says it runs commands and whose parameters have a
    `command` or `cmd`. Codex's code-mode `exec` last."""
    by_name = {t["name"]: t for t in tools}
    named = next((by_name[n] for n in SHELL_TOOL_NAMES if n in by_name), None)
    if named is not None:
        return named

    def squashed(name: str) -> str:
        return re.sub(r"[^a-z]", "", name.lower())

    loose = {squashed(t["name"].rsplit("__", 1)[-1].rsplit(".", 1)[-1]): t for t in reversed(tools)}
    named = next((loose[squashed(n)] for n in SHELL_TOOL_NAMES if squashed(n) in loose), None)
    if named is not None:
        return named
    for t in tools:
        params = t.get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        if _SHELL_WORDS.search(t["name"]) and isinstance(props, dict) and ({"command", "cmd"} & set(props)):
            return t
    return next((t for t in tools if is_code_mode_exec(t)), None)


def shell_arguments(tool: dict[str, Any], command: str) -> dict[str, Any]:
    """Arguments for `tool` that run `command`, in the tool's own convention: a string `command`
    (Claude Code, Gemini CLI, Qwen Code, …), a list `["bash", "-lc", cmd]` where the schema says
    array (Codex `shell`), `cmd` where that is the parameter (Codex `exec_command`), or a list of
    command lines `[cmd]` for a `commands` array (Cline's `run_commands`). Other
    required parameters get minimal schema-valid values. Codex's code-mode `exec` gets a script."""
    if is_code_mode_exec(tool):
        return {
            "input": f"const r = await tools.exec_command({{cmd: {json.dumps(command)}}});\ntext(r.output);"
        }
    # A harness's schema may be anything JSON: what is not the expected shape counts as absent.
    parameters, properties = tool.get("parameters"), None
    schema = parameters if isinstance(parameters, dict) else {}
    properties = schema.get("properties")
    props = properties if isinstance(properties, dict) else {}
    key = next((k for k in ("command", "cmd", "commands") if k in props), "command")
    is_array = _schema_type(props.get(key)) == "array"
    # An array `command` is an argv (Codex); an array `commands` is a list of command lines (Cline).
    value: Any = ([command] if key == "commands" else ["bash", "-lc", command]) if is_array else command
    args: dict[str, Any] = {key: value}
    listed = schema.get("required")
    required = listed if isinstance(listed, list) else []
    for name in required:
        if isinstance(name, str) and name not in args:
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
# The scripted model's logprobs
# --------------------------------------------------------------------------------------------


def scripted_logprob(seed: int, position: int, token_id: int) -> float:
    """A deterministic logprob in (-5, 0] that survives float32 storage exactly."""
    k = _hash64("lp", seed, position, token_id) % 4_000_000
    return float(np.float32(-k / 800_000))
