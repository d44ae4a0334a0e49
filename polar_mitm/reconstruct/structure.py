"""How the conversations of one session relate: main agent, subagents, compactions, side calls.

A session (one harness run) may hold several conversations: the main agent's, those of the
subagents it spawns (Claude Code's `Agent` tool, other harnesses' task tools), a conversation
that carries on from a compacted one, and side calls (titles, summaries: turns a recipe tags).
A trainer needs to know which is which and where each came from, so every exported row gets a
`role` and a `parent_id`.

Rules, over conversations in the order their first turns were created (`link`):

1. **Side.** A conversation whose first turn is tagged (a recipe's side call) is `side`; it has
   no parent.
2. **Main.** The session's first untagged conversation is `main`.
3. **Subagent.** A later conversation that starts while a tool call of an earlier one is open
   (the turn that made the call was created before it, and the turn that answers it, the next
   one extending that turn, was not yet) is `subagent`, spawned by that call. Where several calls
   are open, one whose tool's name says it spawns agents (`Agent`, `Task`, `spawn_agent`,
   `delegate`, …) wins, then the most recent. Its parent is the conversation of the spawning turn.
   A background agent's call is answered at once ("launched"; Claude Code's default since
   2.1.33x), so where no call is open, the most recent call of a tool that spawns agents, made
   before the new conversation began in a conversation that carries on after it (it is told when
   the agent ends), spawned it.
4. **Compaction.** Otherwise, a later conversation whose first prompt contains a run of
   `COMPACTION_WINDOW` tokens an earlier turn sampled (the summary the harness pasted in) is
   `compaction`. Its parent is the conversation that was summarized: the one whose replies the
   summary's own conversation repeats (Claude Code before 2.1.33x asks for the summary in a
   request that re-renders the conversation without its tools and with another ending, so it
   extends nothing token for token, but the replies it repeats are spliced in as sampled). Where
   the summary request extends the conversation token for token instead (2.1.33x: a fork of it,
   so the summary is a branch of the conversation it summarizes), the parent is that
   conversation's newest turn before the summary that is not itself a summary (a retried
   summary request is a second branch); else the summary's conversation itself.
5. Any other later conversation is `main` again (a new task in the same process, `/clear`).

`link` is pure: the strategies give it what they know of each turn and map the parent turn it
names to the row that trains it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

ROLES = ("main", "subagent", "compaction", "side")
# Tokens of an earlier reply that must appear, in order, in a new conversation's first prompt
# for it to count as a continuation of a compacted one.
COMPACTION_WINDOW = 32
_SPAWNS = re.compile(r"agent|task|delegate|spawn|subagent", re.IGNORECASE)


@dataclass
class TurnFacts:
    """What linking needs of one turn."""

    id: str
    created_at: float
    next_at: float | None = None  # when the next turn extending this one was created (None: none)
    calls: list[tuple[str, str]] = field(default_factory=list)  # (tool call id, tool name) it made
    output: np.ndarray | None = None  # the sampled ids (for compaction), int32
    extends: str | None = None  # the turn of its conversation it extends (None: its first)


@dataclass
class Conversation:
    root: str  # the id of its first turn
    created_at: float
    tag: str | None
    prompt: np.ndarray  # its first turn's prompt ids, int32
    turns: list[TurnFacts]


@dataclass
class Link:
    role: str
    parent_turn: str | None = None  # the turn (of another conversation) it came from
    tool_call_id: str | None = None
    tool_name: str | None = None
    summary_turn: str | None = None  # compaction: the turn that sampled the summary it carries

    def meta(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.parent_turn is not None:
            out["parent_turn_id"] = self.parent_turn
        if self.summary_turn is not None:
            out["summary_turn_id"] = self.summary_turn
        if self.tool_call_id is not None:
            out["spawned_by_tool_call"] = self.tool_call_id
        if self.tool_name is not None:
            out["spawned_by_tool"] = self.tool_name
        return out


def link(conversations: Sequence[Conversation]) -> dict[str, Link]:
    """Each conversation's role and origin, by its root turn id (see the module docstring)."""
    order = sorted(conversations, key=lambda c: (c.created_at, c.root))
    out: dict[str, Link] = {}
    seen: list[Conversation] = []
    main_found = False
    for conv in order:
        if conv.tag is not None:
            out[conv.root] = Link("side")
        elif not main_found:
            out[conv.root] = Link("main")
            main_found = True
        else:
            out[conv.root] = _spawned(conv, seen) or _compacted(conv, seen) or Link("main")
        seen.append(conv)
    return out


def _spawned(conv: Conversation, earlier: Sequence[Conversation]) -> Link | None:
    t = conv.created_at
    best: tuple[bool, float, TurnFacts, tuple[str, str]] | None = None
    for other in earlier:
        if other.tag is not None:
            continue
        for turn in other.turns:
            if not turn.calls or turn.created_at >= t or (turn.next_at is not None and turn.next_at <= t):
                continue
            call = next((c for c in turn.calls if _SPAWNS.search(c[1])), turn.calls[0])
            key = (bool(_SPAWNS.search(call[1])), turn.created_at, turn, call)
            if best is None or key[:2] > best[:2]:
                best = key
    if best is None:
        return _spawned_in_background(conv, earlier)
    _, _, turn, (call_id, name) = best
    return Link("subagent", turn.id, call_id, name)


def _spawned_in_background(conv: Conversation, earlier: Sequence[Conversation]) -> Link | None:
    t = conv.created_at
    best: tuple[float, TurnFacts, tuple[str, str]] | None = None
    for other in earlier:
        if other.tag is not None or not any(u.created_at > t for u in other.turns):
            continue
        for turn in other.turns:
            if turn.created_at >= t or (best is not None and turn.created_at <= best[0]):
                continue
            call = next((c for c in reversed(turn.calls) if _SPAWNS.search(c[1])), None)
            if call is not None:
                best = (turn.created_at, turn, call)
    if best is None:
        return None
    _, turn, (call_id, name) = best
    return Link("subagent", turn.id, call_id, name)


def _compacted(conv: Conversation, earlier: Sequence[Conversation]) -> Link | None:
    prompt = np.ascontiguousarray(conv.prompt, dtype="<i4").tobytes()
    for other in reversed(earlier):
        for turn in reversed(other.turns):
            if turn.created_at < conv.created_at and _carries(prompt, turn):
                source = _repeats(other, [c for c in earlier if c is not other]) or _forked_from(
                    other, turn, prompt
                )
                return Link("compaction", source or turn.id, summary_turn=turn.id)
    return None


def _carries(prompt: bytes, turn: TurnFacts) -> bool:
    """Whether `prompt` holds a window of `turn`'s reply, from its middle, token-aligned."""
    if turn.output is None or len(turn.output) < COMPACTION_WINDOW:
        return False
    mid = (len(turn.output) - COMPACTION_WINDOW) // 2
    window = np.ascontiguousarray(turn.output[mid : mid + COMPACTION_WINDOW], dtype="<i4").tobytes()
    return _contains_aligned(prompt, window)


def _forked_from(conv: Conversation, summary: TurnFacts, prompt: bytes) -> str | None:
    """Where `summary` is a branch of `conv` that the conversation went past (a turn after the
    fork that `summary` does not extend), the newest such turn before it that is no summary the
    prompt carries; None where `summary` extends the whole conversation."""
    by_id = {u.id: u for u in conv.turns}
    line: set[str] = set()
    at: str | None = summary.id
    while at is not None and at not in line:
        line.add(at)
        at = by_id[at].extends if at in by_id else None
    past = [
        u
        for u in conv.turns
        if u.id not in line and u.created_at < summary.created_at and not _carries(prompt, u)
    ]
    return max(past, key=lambda u: u.created_at).id if past else None


# A reply shorter than this says too little to tell which conversation a prompt repeats.
_REPEAT_MIN = 4


def _repeats(conv: Conversation, earlier: Sequence[Conversation]) -> str | None:
    """The newest earlier turn whose reply `conv`'s first prompt repeats whole (its stop token
    aside, which a template may render differently), if any."""
    prompt = np.ascontiguousarray(conv.prompt, dtype="<i4").tobytes()
    best: TurnFacts | None = None
    for other in earlier:
        for turn in other.turns:
            if turn.output is None or len(turn.output) <= _REPEAT_MIN or turn.created_at >= conv.created_at:
                continue
            if best is not None and turn.created_at <= best.created_at:
                continue
            reply = np.ascontiguousarray(turn.output[:-1], dtype="<i4").tobytes()
            if _contains_aligned(prompt, reply):
                best = turn
    return best.id if best is not None else None


def _contains_aligned(haystack: bytes, needle: bytes) -> bool:
    """Whether `needle` occurs in `haystack` at an offset that is a whole token (4 bytes)."""
    at = haystack.find(needle)
    while at != -1:
        if at % 4 == 0:
            return True
        at = haystack.find(needle, at + 1)
    return False
