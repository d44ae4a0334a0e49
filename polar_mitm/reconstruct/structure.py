"""How the conversations of one session relate: main agent, subagents, compactions, side calls.

A session (one harness run) may hold several conversations: the main agent's, those of the
subagents it spawns (Claude Code's `Agent` tool, other harnesses' task tools), a conversation
that carries on from a compacted one, and side calls (titles, summaries: turns a recipe tags).
A prompt may also stop extending its history token for token while the conversation goes on
(a tool loaded mid-session grows `tools`; a harness that moves a context message to the end):
that is the same conversation, not a new one. A trainer needs to know which is which and where
each came from, so every exported row gets a `role` and a `parent_id`, and both strategies take
them from this one pass.

Rules, over conversations in the order their first turns were created (`link`), each from
evidence, strongest first:

1. **Side.** A conversation whose first turn is tagged (a recipe's side call) is `side`; it has
   no parent.
2. **Main.** The session's first untagged conversation is `main`.
3. **Continuation.** A later conversation whose first request carries the result of an earlier
   turn's tool call (the call's id in a tool-result message), or whose first prompt repeats an
   earlier calling reply whole (its stop token aside; a text reply repeated is a summary
   carried, rule 5), continues that turn's conversation: it takes that conversation's role and
   parent (`continues_turn_id` in the metadata), and the call counts as answered. Of several
   conversations, the one whose last turn before it is carried wins (a fork's continuation also
   carries older history of its parent), else the newest turn carried; where that holds for
   conversations of different roles or parents, the evidence is ambiguous: the conversation is
   `main` with no parent and the break kind `ambiguous_continuation` is counted. Not a
   continuation where that conversation made an agent call, at or after the turn carried, whose
   result the request does not carry (a forked subagent carries its parent's history up to the
   call that spawned it, whether that call is still open or was answered at once): rule 4
   decides then.
4. **Subagent, by an agent call.** A conversation that starts while a call of a tool whose name
   says it spawns agents (`Agent`, `Task`, `spawn_agent`, `delegate`, …) is open (the turn that
   made it was created before, and nothing answered it yet) is `subagent`, spawned by the most
   recent such call; its parent is the spawning turn. A background agent's call is answered at
   once ("launched"; Claude Code's default since 2.1.33x), so where no such call is open, the
   most recent agent call made before the new conversation began, in a conversation that carries
   on after it (it is told when the agent ends), spawned it.
5. **Compaction.** A conversation whose first prompt contains a run of `COMPACTION_WINDOW` tokens
   that an earlier text reply (a turn that made no tool call: a summary) sampled is
   `compaction`. Its parent is the conversation that was summarized: the one whose replies the
   summary's own conversation repeats (Claude Code before 2.1.33x asks for the summary in a
   request that re-renders the conversation without its tools and with another ending), else,
   where the summary is a branch of the conversation that went past it (2.1.33x forks the
   conversation; a retried summary request is a second branch; a refused request, never stored,
   leaves the call before it unanswered), the conversation's newest turn before the summary
   that is not itself a summary; else the summary's own turn. This comes before rule 6 because
   a request the gateway refused ("prompt is too long") is never stored, so the call before it
   looks open forever.
6. **Subagent, by any open call.** Only then may another open call spawn: where exactly one
   conversation has calls open, the most recent of them. Open calls in several conversations
   are ambiguous: `main`, no parent, break kind `ambiguous_spawn`.
7. Any other later conversation is `main` again (a new task in the same process, `/clear`).

`link` is pure: the strategies give it what they know of each turn and map the parent turn it
names to the row that trains it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

ROLES = ("main", "subagent", "compaction", "side")
# Break kinds `link` reports where the evidence does not decide a role (counted in `stats`).
AMBIGUOUS = ("ambiguous_continuation", "ambiguous_spawn")
# Tokens of an earlier reply that must appear, in order, in a new conversation's first prompt
# for it to count as a continuation of a compacted one.
COMPACTION_WINDOW = 32
_SPAWNS = re.compile(r"agent|task|delegate|spawn|subagent", re.IGNORECASE)
_NEVER = float("inf")


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
    # The tool call ids whose results its first request carries (from the stored request).
    results: frozenset[str] = frozenset()


@dataclass
class Link:
    role: str
    parent_turn: str | None = None  # the turn (of another conversation) it came from
    tool_call_id: str | None = None
    tool_name: str | None = None
    summary_turn: str | None = None  # compaction: the turn that sampled the summary it carries
    continues: str | None = None  # a continuation: the turn of the conversation it carries on
    ambiguous: str | None = None  # the break kind, where the evidence decided nothing

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
        if self.continues is not None:
            out["continues_turn_id"] = self.continues
        if self.ambiguous is not None:
            out["structure"] = self.ambiguous
        return out


def link(conversations: Sequence[Conversation]) -> dict[str, Link]:
    """Each conversation's role and origin, by its root turn id (see the module docstring)."""
    order = sorted(conversations, key=lambda c: (c.created_at, c.root))
    out: dict[str, Link] = {}
    seen: list[Conversation] = []
    # When a turn's calls were answered from another conversation (a continuation carried their
    # result or repeated the reply): they are not open after that.
    answered: dict[str, float] = {}
    main_found = False
    for conv in order:
        if conv.tag is not None:
            found = Link("side")
        elif not main_found:
            found = Link("main")
            main_found = True
        else:
            found = (
                _continued(conv, seen, out, answered)
                or _spawned(conv, seen, answered, agents=True)
                or _compacted(conv, seen)
                or _spawned(conv, seen, answered, agents=False)
                or Link("main")
            )
        out[conv.root] = found
        seen.append(conv)
    return out


def _open(turn: TurnFacts, t: float, answered: dict[str, float]) -> bool:
    """Whether `turn`'s calls were still unanswered when something began at `t`."""
    return (
        bool(turn.calls)
        and turn.created_at < t
        and (turn.next_at is None or turn.next_at > t)
        and answered.get(turn.id, _NEVER) > t
    )


def _continued(
    conv: Conversation,
    earlier: Sequence[Conversation],
    links: dict[str, Link],
    answered: dict[str, float],
) -> Link | None:
    t = conv.created_at
    carried: list[tuple[TurnFacts, Conversation]] = []
    for other in earlier:
        if other.tag is not None:
            continue
        for turn in other.turns:
            if turn.created_at < t and any(c[0] in conv.results for c in turn.calls):
                carried.append((turn, other))
    if not carried:
        repeated = _repeated_turn(conv, earlier)
        if repeated is None:
            return None
        carried = [repeated]
    # Per conversation, the newest turn carried; "live" where that is the conversation's newest
    # turn before `conv` (the request goes on from its last call). A conversation that carries
    # another's history (a fork) carries older turns of it too: only live candidates compete.
    newest: dict[str, tuple[TurnFacts, Conversation]] = {}
    for turn, other in carried:
        if other.root not in newest or turn.created_at > newest[other.root][0].created_at:
            newest[other.root] = (turn, other)
    live = [
        (turn, other)
        for turn, other in newest.values()
        if turn.created_at == max(u.created_at for u in other.turns if u.created_at < t)
    ]
    pool = live or list(newest.values())
    if len(live) > 1 and len({_origin(links[o.root]) for _, o in live}) > 1:
        return Link("main", ambiguous="ambiguous_continuation")
    turn, other = max(pool, key=lambda p: p[0].created_at)
    if _forked_after(other, turn, conv):
        return None  # a forked subagent repeats the history of the conversation that spawned it
    for u, _ in carried:
        answered[u.id] = min(answered.get(u.id, _NEVER), t)
    base = links[other.root]
    return Link(
        base.role,
        base.parent_turn,
        base.tool_call_id,
        base.tool_name,
        base.summary_turn,
        continues=turn.id,
    )


def _origin(found: Link) -> tuple[str, str | None]:
    return found.role, found.parent_turn


def _forked_after(other: Conversation, carried: TurnFacts, conv: Conversation) -> bool:
    """Whether `other` made an agent call, at or after the newest turn `conv` carries and before
    `conv` began, whose result `conv` does not carry: then `conv` is a fork that agent call made
    (it carries the history up to it), answered or not, rather than `other` going on."""
    return any(
        carried.created_at <= u.created_at < conv.created_at
        and any(_SPAWNS.search(name) and cid not in conv.results for cid, name in u.calls)
        for u in other.turns
    )


def _repeated_turn(
    conv: Conversation, earlier: Sequence[Conversation]
) -> tuple[TurnFacts, Conversation] | None:
    """The newest earlier turn (not a side call's) that made a tool call and whose reply `conv`'s
    first prompt repeats whole, searched newest first (a moved-context harness repeats the turn
    just before). A text reply repeated is no such evidence: a compacted conversation carries its
    summary whole."""
    prompt = np.ascontiguousarray(conv.prompt, dtype="<i4").tobytes()
    candidates = [
        (turn, other)
        for other in earlier
        if other.tag is None
        for turn in other.turns
        if turn.calls and turn.created_at < conv.created_at
    ]
    candidates.sort(key=lambda p: p[0].created_at, reverse=True)
    for turn, other in candidates:
        if _repeats_reply(prompt, turn):
            return turn, other
    return None


def _spawned(
    conv: Conversation, earlier: Sequence[Conversation], answered: dict[str, float], *, agents: bool
) -> Link | None:
    t = conv.created_at
    best: tuple[float, TurnFacts, tuple[str, str]] | None = None
    holders: set[str] = set()
    for other in earlier:
        if other.tag is not None:
            continue
        for turn in other.turns:
            if not _open(turn, t, answered):
                continue
            calls = [c for c in turn.calls if _SPAWNS.search(c[1])] if agents else turn.calls
            if not calls:
                continue
            holders.add(other.root)
            if best is None or turn.created_at > best[0]:
                best = (turn.created_at, turn, calls[0])
    if best is None:
        return _spawned_in_background(conv, earlier) if agents else None
    if not agents and len(holders) > 1:
        return Link("main", ambiguous="ambiguous_spawn")
    _, turn, (call_id, name) = best
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
    """Whether `prompt` holds a window of `turn`'s reply, from its middle, token-aligned; only a
    text reply (no tool call) counts: a summary is text, and an agent call's prompt argument,
    which its subagent's prompt repeats, is not one."""
    if turn.calls or turn.output is None or len(turn.output) < COMPACTION_WINDOW:
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
    """The newest earlier turn whose reply `conv`'s first prompt repeats whole, if any."""
    prompt = np.ascontiguousarray(conv.prompt, dtype="<i4").tobytes()
    best: TurnFacts | None = None
    for other in earlier:
        for turn in other.turns:
            if turn.created_at >= conv.created_at:
                continue
            if best is not None and turn.created_at <= best.created_at:
                continue
            if _repeats_reply(prompt, turn):
                best = turn
    return best.id if best is not None else None


def _repeats_reply(prompt: bytes, turn: TurnFacts) -> bool:
    """Whether `prompt` holds `turn`'s whole reply (its stop token aside, which a template may
    render differently), token-aligned."""
    if turn.output is None or len(turn.output) <= _REPEAT_MIN:
        return False
    reply = np.ascontiguousarray(turn.output[:-1], dtype="<i4").tobytes()
    return _contains_aligned(prompt, reply)


def _contains_aligned(haystack: bytes, needle: bytes) -> bool:
    """Whether `needle` occurs in `haystack` at an offset that is a whole token (4 bytes)."""
    at = haystack.find(needle)
    while at != -1:
        if at % 4 == 0:
            return True
        at = haystack.find(needle, at + 1)
    return False
