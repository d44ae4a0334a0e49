"""Helpers shared by the tests: request constants, reading what a stream renderer sends, and
waiting for an event with a deadline."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from types import ModuleType

from polar_mitm import sse
from polar_mitm.neutral import ChatRequest, Completion, Event, ProviderError, ToolCall, Usage


def process_gone(pid: int) -> bool:
    """Whether process `pid` no longer runs: gone, or a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def open_db_at_once(path: str, barrier) -> None:
    """A spawned process's work in the test of workers opening one new database together: the
    target lives here because a spawned child imports the target's module, and this one is light
    (a test module would cost each child its whole import)."""
    from polar_mitm.store.connection import init_db

    barrier.wait()
    init_db(path)


def wait_until[T](
    predicate: Callable[[], T], timeout: float = 30, interval: float = 0.05, message: str = "the condition"
) -> T:
    """Call `predicate` every `interval` s until it returns something true, and return that; fail
    the test naming `message` (and the last value seen) after `timeout` s. One deadline loop for
    every test that waits for a process, a file or a count, so none waits a fixed time that can
    pass before the event it means, and none times out silently."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message} (last: {value!r})")
        time.sleep(interval)


async def wait_until_async[T](
    predicate: Callable[[], T | Awaitable[T]],
    timeout: float = 30,
    interval: float = 0.05,
    message: str = "the condition",
) -> T:
    """`wait_until` inside an event loop: sleeps with `asyncio.sleep` (so the servers in this loop
    keep running), and `predicate` may be a coroutine function (a status call, say)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message} (last: {value!r})")
        await asyncio.sleep(interval)


MESSAGES_URL = "https://api.anthropic.com/v1/messages"

# Claude Code's shell tool, as an Anthropic `tools` entry.
BASH = {
    "name": "Bash",
    "description": "Run a shell command",
    "input_schema": {
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "required": ["command"],
    },
}

# A reply with reasoning, text and a tool call, as the policy produces one.
COMPLETION = Completion(
    turn_id="turn_0001abcd",
    model="claude-test",
    text="I'll list the files.",
    reasoning="The user wants a listing.",
    tool_calls=[ToolCall(id="toolu_01", name="Bash", arguments={"command": "ls -la"})],
    finish_reason="tool_calls",
    usage=Usage(prompt_tokens=12, completion_tokens=9),
)


def sse_events(raw: str | bytes) -> list[tuple[str | None, dict]]:
    """(event name, data) of each SSE event whose data is a JSON object, read by the reader harvest
    mode uses (comments, keep-alives and `[DONE]` left out)."""
    return sse.json_events(raw)


async def stream_bytes(
    module: ModuleType, events: Iterable[Event], req: ChatRequest, raise_at_end: ProviderError | None = None
) -> bytes:
    """Everything a style's `render_stream` writes for these policy events (then the error, if any)."""

    async def gen():
        for e in events:
            yield e
        if raise_at_end is not None:
            raise raise_at_end

    return b"".join([chunk async for chunk in module.render_stream(gen(), req)])


# --- valid requests of every style, and the shape of their errors ---------------------------------
# Small but complete bodies (system prompt, tools, a tool call and its result, sampling): what the
# fuzz tests mutate and the bad-request tests spoil one field of. Non-streaming; Gemini's model
# and stream flag live in the path (conftest.STYLE_ENDPOINTS).

_SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}

VALID_REQUESTS: dict[str, dict] = {
    "anthropic": {
        "model": "claude-sonnet-4-5",
        "max_tokens": 256,
        "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Create out.txt containing hi"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "plan", "signature": "sig"},
                    {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"},
                    {"type": "text", "text": "go on"},
                ],
            },
        ],
        "tools": [{"name": "Bash", "description": "run", "input_schema": _SCHEMA}],
        "tool_choice": {"type": "auto"},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "temperature": 1,
        "stop_sequences": ["STOP"],
    },
    "openai-chat": {
        "model": "gpt-4o",
        "max_tokens": 256,
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "You are Qwen Code."}]},
            {"role": "user", "content": [{"type": "text", "text": "Create out.txt containing hi"}]},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "use the shell",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "run_shell_command", "arguments": '{"command":"ls"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "Exit Code: 0"}]},
            {"role": "function", "name": "run_shell_command", "content": "done"},
        ],
        "tools": [
            {
                "type": "function",
                "function": {"name": "run_shell_command", "description": "Run", "parameters": _SCHEMA},
            }
        ],
        "tool_choice": "auto",
        "temperature": 0.7,
        "stop": "STOP",
    },
    "openai-responses": {
        "model": "gpt-5.5",
        "instructions": "You are Codex.",
        "store": False,
        "reasoning": {"effort": "medium"},
        "tool_choice": "auto",
        "max_output_tokens": 256,
        "tools": [
            {"type": "function", "name": "exec_command", "description": "Run", "parameters": _SCHEMA},
            {"type": "custom", "name": "apply_patch", "description": "Edit files"},
        ],
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "Be careful."}],
            },
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Create out.txt"}],
            },
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "write it"}]},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "exec_command",
                "arguments": '{"command": "ls"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "ok"},
            {"type": "message", "role": "user", "content": "and now?"},
        ],
    },
    "gemini": {
        "contents": [
            {"role": "user", "parts": [{"text": "Create out.txt containing hi"}]},
            {
                "role": "model",
                "parts": [{"functionCall": {"name": "run_shell_command", "args": {"command": "ls"}}}],
            },
            {
                "role": "user",
                "parts": [{"functionResponse": {"name": "run_shell_command", "response": {"output": "ok"}}}],
            },
        ],
        "systemInstruction": {"role": "user", "parts": [{"text": "You are a CLI agent."}]},
        "tools": [
            {
                "functionDeclarations": [
                    {"name": "run_shell_command", "description": "Run", "parametersJsonSchema": _SCHEMA}
                ]
            }
        ],
        "toolConfig": {"functionCallingConfig": {"mode": "AUTO"}},
        "generationConfig": {"temperature": 1, "topP": 0.95, "maxOutputTokens": 256},
    },
}


def error_message(style: str, status: int, content_type: str, raw: bytes) -> str:
    """The message of an error answer, after checking that it is JSON in `style`'s own error
    shape (what that provider's SDK parses); fails the test otherwise."""
    import json

    assert content_type.startswith("application/json"), (status, content_type, raw[:300])
    body = json.loads(raw)
    if style == "anthropic":
        assert body["type"] == "error" and isinstance(body["error"]["type"], str), body
        return body["error"]["message"]
    err = body["error"]
    if style == "gemini":
        assert err["code"] == status and isinstance(err["status"], str), body
    else:  # both OpenAI styles
        assert isinstance(err["type"], str) and "param" in err and "code" in err, body
    assert isinstance(err["message"], str), body
    return err["message"]


def stored_bytes(db: str | Path) -> bytes:
    """What a store holds, for a check that a secret is not in it: the database file and its
    -wal/-shm files as bytes, and every turn's request text and headers as the readers return
    them (request text is stored zstd-compressed, where a raw scan would not see a secret)."""
    import json
    import sqlite3

    from polar_mitm.store.requests import RequestReader

    path = Path(db)
    raw = b"".join(p.read_bytes() for p in sorted(path.parent.glob(path.name + "*")))
    con = sqlite3.connect(path)
    try:
        reader = RequestReader(con)
        ids = [tid for (tid,) in con.execute("SELECT id FROM turns ORDER BY seq")]
        texts = [(reader.request(tid) or "") + json.dumps(reader.headers(tid)) for tid in ids]
    finally:
        con.close()
    return raw + "\n".join(texts).encode("utf-8", "surrogatepass")


# A shell line that makes one Anthropic model call through the proxy (a harness's one turn).
MODEL_CALL = (
    "python3 - <<'EOF'\n"
    "import json, urllib.request\n"
    "req = urllib.request.Request('https://api.anthropic.com/v1/messages', data=json.dumps({"
    "'model': 'm', 'max_tokens': 8, 'messages': [{'role': 'user', 'content': 'say hi'}]}).encode(),"
    " headers={'content-type': 'application/json', 'x-api-key': 'k', 'anthropic-version': '2023-06-01'})\n"
    "urllib.request.urlopen(req).read()\n"
    "EOF\n"
)


def descendants(root: int) -> set[int]:
    """`root` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo += children.get(pid, [])
    return found
