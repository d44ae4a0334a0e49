"""Incremental parsing of policy output text into reasoning, text and tool calls.

Parser names are SGLang's (`--tool-call-parser`, `--reasoning-parser`), and each name reads the
format SGLang's parser of that name reads: the reasoning formats are below, the tool-call formats
in `tool_parsers.py`. A name we do not implement is refused with the list of those we do, never
accepted and ignored. Text is fed as the engine streams it; a marker split across chunks is held
back until it resolves.
"""

from __future__ import annotations

import bisect
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from polar_mitm.backends.tool_parsers import (
    KIMI_SECTION_BEGIN,
    TOOL_FORMATS,
    ToolFormat,
    check_call,
    diagnose,
    tool_schemas,
)
from polar_mitm.neutral import ReasoningDelta, TextDelta, Tool, ToolCall, ToolCallEvent

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN = "<tool_call>"


@dataclass(frozen=True)
class ReasoningFormat:
    """A reasoning block's markers (SGLang `python/sglang/srt/parser/reasoning_parser.py`)."""

    open: str
    close: str
    forced: bool = False  # output starts inside the block, with or without the open marker
    tool_start: str | None = None  # a tool-call marker that also ends the block


REASONING_FORMATS: dict[str, ReasoningFormat] = {
    "qwen3": ReasoningFormat(THINK_OPEN, THINK_CLOSE),
    "qwen3-thinking": ReasoningFormat(THINK_OPEN, THINK_CLOSE, forced=True),
    "deepseek-r1": ReasoningFormat(THINK_OPEN, THINK_CLOSE, forced=True),
    "deepseek-v3": ReasoningFormat(THINK_OPEN, THINK_CLOSE),
    "glm45": ReasoningFormat(THINK_OPEN, THINK_CLOSE, tool_start=TOOL_OPEN),
    "kimi": ReasoningFormat("◁think▷", "◁/think▷"),  # U+25C1, U+25B7
    "kimi_k2": ReasoningFormat(THINK_OPEN, THINK_CLOSE, tool_start=KIMI_SECTION_BEGIN),
}

TOOL_PARSERS = frozenset(TOOL_FORMATS)
REASONING_PARSERS = frozenset(REASONING_FORMATS)
DISABLED = "none"

ParsedEvent = ReasoningDelta | TextDelta | ToolCallEvent


def _check(kind: str, name: str | None, known: frozenset[str]) -> str | None:
    if name is None or name in ("", DISABLED):
        return None
    if name not in known:
        raise ValueError(
            f"unknown {kind} parser {name!r}; supported: {', '.join(sorted(known))}, or {DISABLED!r} to disable"
        )
    return name


def check_tool_parser(name: str | None) -> str | None:
    """The tool parser name, None when disabled; ValueError naming the supported ones."""
    return _check("tool", name, TOOL_PARSERS)


def check_reasoning_parser(name: str | None) -> str | None:
    """The reasoning parser name, None when disabled; ValueError naming the supported ones."""
    return _check("reasoning", name, REASONING_PARSERS)


def _partial_suffix(buf: str, tag: str) -> int:
    """Length of the longest suffix of buf that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:n]):
            return n
    return 0


def _held(buf: str, tags: Sequence[str]) -> int:
    return max((_partial_suffix(buf, t) for t in tags), default=0)


def _first(buf: str, tags: Sequence[str]) -> tuple[int, str]:
    """The earliest of tags in buf: (index, tag), or (-1, "")."""
    found = [(i, t) for t in tags if (i := buf.find(t)) >= 0]
    return min(found) if found else (-1, "")


def new_call_id(prefix: str = "call_") -> str:
    return prefix + uuid.uuid4().hex[:24]


def _tool_call(name: str, args: dict | str, id_prefix: str) -> ToolCall:
    if isinstance(args, str):
        return ToolCall(id=new_call_id(id_prefix), name=name, raw=args)
    return ToolCall(id=new_call_id(id_prefix), name=name, arguments=args)


class OutputParser:
    """Splits streamed policy text into reasoning, text and tool calls.

    `in_reasoning`: the prompt already opened the reasoning block. `tools`: the request's tools,
    whose schemas type the values of the XML-ish tool-call formats (qwen3_coder, glm45)."""

    def __init__(
        self,
        tool_parser: str | None = "qwen25",
        reasoning_parser: str | None = "qwen3",
        *,
        in_reasoning: bool = False,
        id_prefix: str = "call_",
        tools: Sequence[Tool] | None = None,
    ):
        tool_parser = check_tool_parser(tool_parser)
        reasoning_parser = check_reasoning_parser(reasoning_parser)
        self.tool_parser = tool_parser
        self.tool_format: ToolFormat | None = TOOL_FORMATS[tool_parser] if tool_parser else None
        self.reasoning_format = REASONING_FORMATS[reasoning_parser] if reasoning_parser else None
        self.schemas = tool_schemas(tools)
        self.id_prefix = id_prefix
        rf = self.reasoning_format
        self.state = "text" if rf is None else ("opened" if in_reasoning or rf.forced else "start")
        self.in_section = False  # inside DeepSeek's or Kimi's tool-call section
        self.buf = ""
        self.pending_ws = ""  # whitespace held back in text state
        self.pending_rws = ""  # whitespace held back in thinking state
        self.text_started = False
        self.reasoning = ""
        self.text = ""
        self.tool_calls: list[ToolCall] = []
        # Every tool-call block seen: (verdict: "ok" or one of PARSE_FAILURES, tool name or None,
        # first char, end char) in the text fed; and (chars fed, tokens fed) after each chunk, to
        # turn those into token spans (`parse_status`).
        self.blocks: list[tuple[str, str | None, int, int]] = []
        self.fed = 0
        self._block_start = 0
        self._marks: list[tuple[int, int]] = []

    def feed(self, chunk: str, tokens: int | None = None) -> list[ParsedEvent]:
        """Parse the next text; `tokens`: how many sampled tokens it ends at (for token spans)."""
        self.buf += chunk
        self.fed += len(chunk)
        if tokens is not None:
            self._marks.append((self.fed, tokens))
        return self._run(final=False)

    def parse_status(self) -> dict | None:
        """What the tool parser made of this output, for the turn's record: None where no tool
        parser read it; else `{"parser", "calls", "failures": [{"kind", "name", "span"}]}`, with
        `span` the sampled tokens [start, end) of each failed block, as fine as the chunks the text
        came in (exact when each chunk is one token; null when no token counts were given)."""
        if self.tool_format is None:
            return None
        failures = [
            {"kind": kind, "name": name, "span": self._token_span(start, end)}
            for kind, name, start, end in self.blocks
            if kind != "ok"
        ]
        return {"parser": self.tool_parser, "calls": len(self.tool_calls), "failures": failures}

    def _token_span(self, start: int, end: int) -> list[int] | None:
        if not self._marks:
            return None
        chars = [c for c, _ in self._marks]
        # The chunk holding `start` begins where the one before it ended.
        i = bisect.bisect_right(chars, start) - 1
        j = min(bisect.bisect_left(chars, end), len(chars) - 1)
        return [self._marks[i][1] if i >= 0 else 0, self._marks[j][1]]

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
        """Output that may open with a reasoning block."""
        return self._open_marker(final, otherwise="text")

    def _step_opened(self, out: list[ParsedEvent], final: bool) -> bool:
        """Output that starts inside the block; an echoed open marker is dropped."""
        return self._open_marker(final, otherwise="thinking")

    def _open_marker(self, final: bool, otherwise: str) -> bool:
        assert self.reasoning_format is not None
        open_ = self.reasoning_format.open
        stripped = self.buf.lstrip()
        if stripped.startswith(open_):
            self.buf = stripped[len(open_) :]
            self.state = "thinking"
            return True
        if not final and open_.startswith(stripped):
            return False  # still could be the open marker
        self.state = otherwise
        return True

    def _step_thinking(self, out: list[ParsedEvent], final: bool) -> bool:
        assert self.reasoning_format is not None
        rf = self.reasoning_format
        ends = (rf.close, rf.tool_start) if rf.tool_start else (rf.close,)
        i, end = _first(self.buf, ends)
        if i >= 0:
            self._reason(out, self.buf[:i], final=True)
            # A tool-call marker ends the block implicitly and stays for the tool parser.
            self.buf = self.buf[i + len(end) :].lstrip() if end == rf.close else self.buf[i:]
            self.state = "text"
            return True
        keep = 0 if final else _held(self.buf, ends)
        self._reason(out, self.buf[: len(self.buf) - keep], final=final)
        self.buf = self.buf[len(self.buf) - keep :]
        return False

    def _step_text(self, out: list[ParsedEvent], final: bool) -> bool:
        fmt = self.tool_format
        if fmt:
            i, opener = _first(self.buf, fmt.openers)
            if i >= 0:
                self._emit_text(out, self.buf[:i], final=True)
                self._block_start = self.fed - len(self.buf) + i  # the buffer is the stream's tail
                self.buf = self.buf[i + len(opener) :]
                self.in_section = opener == fmt.section_open
                self.state = "section" if self.in_section else "tool"
                return True
        keep = 0 if final or not fmt else _held(self.buf, fmt.openers)
        self._emit_text(out, self.buf[: len(self.buf) - keep], final=final)
        self.buf = self.buf[len(self.buf) - keep :]
        return False

    def _step_section(self, out: list[ParsedEvent], final: bool) -> bool:
        """Between the calls of a section: only call markers and the section's end count."""
        fmt = self.tool_format
        assert fmt is not None and fmt.section_close is not None
        i, marker = _first(self.buf, (fmt.call_open, fmt.section_close))
        if i < 0:
            if not final:
                return False
            leftover, self.buf = self.buf.strip(), ""
            if leftover:  # a section cut off mid-way: show what was there
                self._emit_text(out, leftover, final=True)
            self.state = "text"
            return True
        if marker == fmt.call_open:
            self._block_start = self.fed - len(self.buf) + i
        self.buf = self.buf[i + len(marker) :]
        if marker == fmt.call_open:
            self.state = "tool"
        else:
            self.state, self.in_section = "text", False
        return True

    def _step_tool(self, out: list[ParsedEvent], final: bool) -> bool:
        fmt = self.tool_format
        assert fmt is not None
        i = self.buf.find(fmt.call_close)
        if i < 0 and not final:
            return False
        body = self.buf[:i] if i >= 0 else self.buf
        end = self.fed - len(self.buf) + (i + len(fmt.call_close) if i >= 0 else len(self.buf))
        calls = fmt.decode(body, self.schemas, i >= 0)
        if calls:
            for name, args in calls:
                call = _tool_call(name, args, self.id_prefix)
                self.tool_calls.append(call)
                out.append(ToolCallEvent(call=call))
                verdict = check_call(name, args, self.schemas) or "ok"
                self.blocks.append((verdict, name, self._block_start, end))
            self.pending_ws = ""
        else:  # not a valid call: it was text after all
            self.blocks.append((diagnose(fmt, body, i >= 0), None, self._block_start, end))
            self._emit_text(out, fmt.call_open + body + (fmt.call_close if i >= 0 else ""), final=final)
        self.buf = self.buf[i + len(fmt.call_close) :] if i >= 0 else ""
        self.state = "section" if self.in_section else "text"
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
