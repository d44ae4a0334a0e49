"""Incremental parsing of policy output text into reasoning, text and tool calls.

Parser names follow SGLang's: tool parser `qwen25` (and aliases for the same `<tool_call>` JSON
format), reasoning parsers `qwen3` / `deepseek-r1` (`<think>…</think>`). Text is fed as the engine
streams it; partial tags at the end of a chunk are held back until they resolve.
"""

from __future__ import annotations

import json
import uuid

from polar_mitm.neutral import ReasoningDelta, TextDelta, ToolCall, ToolCallEvent

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"

TOOL_PARSERS = {"qwen25", "qwen", "qwen3", "hermes", "qwen3_coder_json"}
REASONING_PARSERS = {"qwen3", "qwen3-thinking", "deepseek-r1", "deepseek-v3", "glm45", "kimi"}

ParsedEvent = ReasoningDelta | TextDelta | ToolCallEvent


def _partial_suffix(buf: str, tag: str) -> int:
    """Length of the longest suffix of buf that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:n]):
            return n
    return 0


def new_call_id(prefix: str = "call_") -> str:
    return prefix + uuid.uuid4().hex[:24]


def parse_tool_call_json(body: str, id_prefix: str = "call_") -> ToolCall | None:
    try:
        obj = json.loads(body.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            return ToolCall(id=new_call_id(id_prefix), name=obj["name"], raw=args)
        args = parsed
    if not isinstance(args, dict):
        return ToolCall(id=new_call_id(id_prefix), name=obj["name"], raw=json.dumps(args))
    return ToolCall(id=new_call_id(id_prefix), name=obj["name"], arguments=args)


class OutputParser:
    def __init__(
        self,
        tool_parser: str | None = "qwen25",
        reasoning_parser: str | None = "qwen3",
        *,
        in_reasoning: bool = False,
        id_prefix: str = "call_",
    ):
        if tool_parser and tool_parser not in TOOL_PARSERS:
            raise ValueError(f"unknown tool parser {tool_parser!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
        if reasoning_parser and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"unknown reasoning parser {reasoning_parser!r}; known: {', '.join(sorted(REASONING_PARSERS))}"
            )
        self.tools = bool(tool_parser)
        self.id_prefix = id_prefix
        self.state = "thinking" if in_reasoning else ("start" if reasoning_parser else "text")
        self.buf = ""
        self.pending_ws = ""  # whitespace held back in text state
        self.pending_rws = ""  # whitespace held back in thinking state
        self.text_started = False
        self.reasoning = ""
        self.text = ""
        self.tool_calls: list[ToolCall] = []

    def feed(self, chunk: str) -> list[ParsedEvent]:
        self.buf += chunk
        return self._run(final=False)

    def finish(self) -> list[ParsedEvent]:
        return self._run(final=True)

    # -- state machine ---------------------------------------------------------------------

    def _run(self, final: bool) -> list[ParsedEvent]:
        out: list[ParsedEvent] = []
        while True:
            progressed = getattr(self, f"_step_{self.state}")(out, final)
            if not progressed:
                break
        return out

    def _step_start(self, out: list[ParsedEvent], final: bool) -> bool:
        stripped = self.buf.lstrip()
        if stripped.startswith(THINK_OPEN):
            self.buf = stripped[len(THINK_OPEN) :]
            self.state = "thinking"
            return True
        if not final and THINK_OPEN.startswith(stripped):
            return False  # still could be "<think>"
        self.state = "text"
        return True

    def _step_thinking(self, out: list[ParsedEvent], final: bool) -> bool:
        i = self.buf.find(THINK_CLOSE)
        if i >= 0:
            self._reason(out, self.buf[:i], final=True)
            self.buf = self.buf[i + len(THINK_CLOSE) :].lstrip()
            self.state = "text"
            return True
        keep = 0 if final else _partial_suffix(self.buf, THINK_CLOSE)
        self._reason(out, self.buf[: len(self.buf) - keep], final=final)
        self.buf = self.buf[len(self.buf) - keep :]
        return False

    def _step_text(self, out: list[ParsedEvent], final: bool) -> bool:
        if self.tools:
            i = self.buf.find(TOOL_OPEN)
            if i >= 0:
                self._emit_text(out, self.buf[:i], final=True)
                self.buf = self.buf[i + len(TOOL_OPEN) :]
                self.state = "tool"
                return True
        keep = 0 if final or not self.tools else _partial_suffix(self.buf, TOOL_OPEN)
        self._emit_text(out, self.buf[: len(self.buf) - keep], final=final)
        self.buf = self.buf[len(self.buf) - keep :]
        return False

    def _step_tool(self, out: list[ParsedEvent], final: bool) -> bool:
        i = self.buf.find(TOOL_CLOSE)
        if i < 0 and not final:
            return False
        body = self.buf[:i] if i >= 0 else self.buf
        call = parse_tool_call_json(body, self.id_prefix)
        if call is not None:
            self.tool_calls.append(call)
            out.append(ToolCallEvent(call=call))
            self.pending_ws = ""
        else:  # not a valid call: it was text after all
            self._emit_text(out, TOOL_OPEN + body + (TOOL_CLOSE if i >= 0 else ""), final=final)
        self.buf = self.buf[i + len(TOOL_CLOSE) :] if i >= 0 else ""
        self.state = "text"
        return True

    def _reason(self, out: list[ParsedEvent], s: str, final: bool = False) -> None:
        """Emit reasoning without the newlines around it (as SGLang's reasoning parsers do)."""
        s = self.pending_rws + s
        self.pending_rws = ""
        if not self.reasoning:
            s = s.lstrip()
        body = s.rstrip()
        if not final:
            self.pending_rws = s[len(body) :]
        if body:
            self.reasoning += body
            out.append(ReasoningDelta(text=body))

    def _emit_text(self, out: list[ParsedEvent], s: str, final: bool) -> None:
        """Emit text, holding back trailing whitespace until something follows it."""
        s = self.pending_ws + s
        self.pending_ws = ""
        if not self.text_started:
            s = s.lstrip()
        body = s.rstrip()
        if not final:
            self.pending_ws = s[len(body) :]
        if body:
            self.text_started = True
            self.text += body
            out.append(TextDelta(text=body))
