"""The fake backend's default script calls whatever shell tool a harness offers (by name, then by
schema), so `polar-mitm run` with the fake does something visible with every recipe's harness."""

import json

import pytest

from polar_mitm.fake import DEFAULT_SCRIPT, find_shell_tool, scripted_reply


def _prompt(tools: list[dict], user: str) -> str:
    """A decoded Qwen prompt declaring `tools` (one JSON per line, as the Qwen templates write it)."""
    decl = "\n".join(json.dumps({"type": "function", "function": t}) for t in tools)
    return (
        f"<|im_start|>system\nYou are an agent.\n\n# Tools\n\n<tools>\n{decl}\n</tools><|im_end|>\n"
        f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    )


def _obj(props: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": props, "required": required}


STR = {"type": "string"}
OTHER = {"name": "read_file", "parameters": _obj({"path": STR}, ["path"])}

# The shell tool each harness offers (name and the parameters that matter), as it sends it.
HARNESS_SHELL_TOOLS = {
    "claude-code": {"name": "Bash", "parameters": _obj({"command": STR, "description": STR}, ["command"])},
    "qwen-code": {"name": "run_shell_command", "parameters": _obj({"command": STR}, ["command"])},
    "cline": {
        "name": "run_commands",
        "parameters": _obj({"commands": {"type": "array", "items": STR}}, ["commands"]),
    },
    "cline-2": {
        "name": "execute_command",
        "parameters": _obj(
            {"command": STR, "requires_approval": {"type": "boolean"}}, ["command", "requires_approval"]
        ),
    },
    "kimi-cli": {
        "name": "Shell",
        "parameters": _obj({"command": STR, "timeout": {"type": "integer"}}, ["command"]),
    },
    "mini-swe-agent": {"name": "bash", "parameters": _obj({"command": STR}, ["command"])},
    "continue": {"name": "Bash", "parameters": _obj({"command": STR}, ["command"])},
    "copilot": {
        "name": "bash",
        "parameters": _obj({"command": STR, "description": STR}, ["command", "description"]),
    },
    "hermes-like": {"name": "terminal", "parameters": _obj({"command": STR}, ["command"])},
    "cursor-like": {"name": "run_terminal_cmd", "parameters": _obj({"command": STR}, ["command"])},
    # Not a known name: found by spelling, and by name and schema.
    "camel-case": {"name": "RunShellCommand", "parameters": _obj({"command": STR}, ["command"])},
    "mcp-namespaced": {"name": "mcp__sandbox__bash", "parameters": _obj({"command": STR}, ["command"])},
    "by-schema": {"name": "sandbox_exec", "parameters": _obj({"cmd": STR}, ["cmd"])},
}


@pytest.mark.parametrize("harness", sorted(HARNESS_SHELL_TOOLS))
def test_default_script_calls_the_shell_tool_each_harness_offers(harness):
    tool = HARNESS_SHELL_TOOLS[harness]
    reply = scripted_reply(DEFAULT_SCRIPT, _prompt([OTHER, tool], "Create out.txt containing hi"))
    assert reply.startswith("<tool_call>\n"), reply
    call = json.loads(reply.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert call["name"] == tool["name"]
    props = tool["parameters"]["properties"]
    key = next(k for k in ("command", "cmd", "commands") if k in props)
    command = "printf '%s\\n' 'hi' > 'out.txt'"
    assert call["arguments"][key] == ([command] if key == "commands" else command)
    # Every required parameter is there, so the harness's own validation accepts the call.
    assert set(tool["parameters"]["required"]) <= set(call["arguments"])


def test_known_names_win_over_look_alikes_and_tools_that_only_mention_commands_are_left_alone():
    bash = HARNESS_SHELL_TOOLS["mini-swe-agent"]
    lookalike = {"name": "run_tests", "parameters": _obj({"command": STR}, ["command"])}
    assert find_shell_tool([lookalike, bash]) is bash
    # A command-ish name without a command parameter, or a command parameter on a tool whose
    # name says nothing of running: no shell tool, and the script says what it would run.
    assert find_shell_tool([{"name": "run_linter", "parameters": _obj({"path": STR}, [])}]) is None
    assert find_shell_tool([{"name": "slash_menu", "parameters": _obj({"command": STR}, [])}]) is None
    reply = scripted_reply(DEFAULT_SCRIPT, _prompt([OTHER], "Create out.txt containing hi"))
    assert reply == "I would run: printf '%s\\n' 'hi' > 'out.txt'"
