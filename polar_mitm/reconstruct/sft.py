"""Text conversations from the store, for supervised fine-tuning.

A turn's conversation is its raw request, parsed by its style module into neutral messages, plus
its reply: for a harvested turn the assembled native reply (parsed by its style module, as the
same reply echoed in the next request is), for a policy turn the stored `Completion`. Two ways out:

- `sft_records`: one OpenAI chat-format object per conversation (`messages` with `tool_calls` and
  `tool` messages, `tools`, `metadata`) — what `export --format sft-jsonl` writes.
- `retokenized_trajectories`: harvested conversations rendered with a target model's chat
  template into trajectory rows (the parquet/jsonl columns), the assistant replies marked in
  `loss_mask` and logprobs 0.0 — what `export --tokenizer DIR` adds for harvested sessions. The
  ids are *retokenized text*, never sampled ids, and the metadata says so.

Which conversations: with `prefix-merge`, a session's final turns only — a turn is not final when
a later turn's request repeats its request and reply (compared as normalized messages, see
`backends.render.conversation_hashes`), so a 20-turn agent loop is one conversation; with
`per-request`, every turn.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from polar_mitm import providers
from polar_mitm.backends.render import conversation_hashes
from polar_mitm.backends.tokenizer import Tokenizer
from polar_mitm.neutral import Completion, Message, ProviderError, Tool
from polar_mitm.reconstruct.source import Selection
from polar_mitm.reconstruct.stats import ReconstructStats
from polar_mitm.reconstruct.trajectory import LOGPROB_DTYPE, MASK_DTYPE, TOKEN_DTYPE, Trajectory
from polar_mitm.store import queries
from polar_mitm.store.turn import Turn
from polar_mitm.strategies import Strategy, choices

# ---- a turn → a conversation ----------------------------------------------------------------------


@dataclass
class Conversation:
    """The messages of one turn's request followed by its reply, and where they came from."""

    turn_id: str  # the last turn, whose reply ends the conversation
    session_id: str
    task_id: str | None
    turn_ids: list[str]  # the turns whose replies it holds, oldest first
    messages: list[Message]
    tools: list[Tool]
    thinking: bool | None
    finish_reason: str
    style: str
    model: str | None
    harvested: bool
    reward: float | None = None
    tags: list[str] = field(default_factory=list)


class UnreadableTurn(ValueError):
    """A stored turn whose request or reply cannot be parsed back into messages."""


def conversation_of(turn: Turn) -> Conversation:
    module = providers.STYLES.get(turn.style)
    if module is None:
        raise UnreadableTurn(f"turn {turn.id}: no style module named {turn.style!r}")
    try:
        req = module.parse_request(json.loads(turn.request or ""), path=turn.path or "")
        if turn.text_only:
            replies, finish = module.parse_reply(json.loads(turn.response or ""), lenient=True)
        else:
            completion = Completion.model_validate_json(turn.response or "")
            replies, finish = [completion.as_message()], completion.finish_reason
    except (ProviderError, ValueError, TypeError, KeyError) as e:
        raise UnreadableTurn(f"turn {turn.id}: {getattr(e, 'message', e)}") from e
    return Conversation(
        turn_id=turn.id,
        session_id=turn.session_id,
        task_id=turn.task_id,
        turn_ids=[turn.id],
        messages=[*req.messages, *replies],
        tools=req.tools,
        thinking=req.thinking,
        finish_reason=finish,
        style=turn.style,
        model=turn.model or req.model or None,
        harvested=turn.text_only,
        reward=turn.reward,
        tags=[turn.tag] if turn.tag else [],
    )


def _hashes(conv: Conversation) -> list[str]:
    # Messages only: a harness that changes its tool set mid-session still continues one conversation.
    return conversation_hashes(conv.messages, [])


def _kept(
    turn: Turn, sel: Selection, stats: ReconstructStats, on_turn: Callable[[], object] | None
) -> Conversation | None:
    """The turn's conversation if the selection keeps it and it parses; counted either way."""
    if on_turn is not None:
        on_turn()
    stats.turns_read += 1
    if not sel.keeps(turn):
        if turn.tag is not None and not sel.include_side_calls:
            stats.side_calls_excluded += 1
        else:
            stats.not_ok_excluded += 1
        return None
    try:
        conv = conversation_of(turn)
    except UnreadableTurn:
        stats.mismatches["unreadable_turn"] += 1
        return None
    stats.turns += 1
    stats.sessions.add(turn.session_id)
    return conv


def conversations(
    path: str | Path,
    *,
    strategy: str = Strategy.PREFIX_MERGE,
    selection: Selection | None = None,
    stats: ReconstructStats | None = None,
    harvested_only: bool = False,
    on_turn: Callable[[], object] | None = None,
) -> Iterator[Conversation]:
    """The store's conversations, one session at a time (see the module docstring)."""
    if strategy not in choices(Strategy):
        raise ValueError(f"unknown strategy {strategy!r}; choose {' or '.join(choices(Strategy))}")
    sel = selection or Selection()
    stats = stats if stats is not None else ReconstructStats()
    sessions = queries.session_ids(
        path,
        session=sel.session,
        task=sel.task,
        since=sel.since,
        tokens=False if harvested_only else None,
        with_text=True,
    )
    for session in sessions:
        turns = functools.partial(
            queries.text_turns, path, session, task=sel.task, since=sel.since, text_only=harvested_only
        )
        if strategy == Strategy.PER_REQUEST:
            for turn in turns():
                if (conv := _kept(turn, sel, stats, on_turn)) is not None:
                    yield conv
            continue
        # Newest first: a turn is final unless a turn already seen (a later one) extends it. Only
        # hashes are kept; the final turns are read again afterwards, so memory stays small.
        extended: set[str] = set()
        finals: list[str] = []
        post_of: dict[str, list[tuple[int, str]]] = {}
        for turn in turns(newest_first=True):
            if (conv := _kept(turn, sel, stats, on_turn)) is None:
                continue
            hashes = _hashes(conv)
            if hashes[-1] not in extended:
                finals.append(turn.id)
            extended.update(hashes[:-1])
            post_of.setdefault(hashes[-1], []).append((turn.seq, turn.id))
        for turn in queries.text_turns_by_id(path, finals[::-1]):
            conv = conversation_of(turn)
            # The earlier turns whose replies this conversation repeats (the newest of each).
            earlier = set()
            for h in _hashes(conv)[:-1]:
                before = [t for t in post_of.get(h, []) if t[0] < turn.seq]
                if before:
                    earlier.add(max(before))
            conv.turn_ids = [t for _, t in sorted(earlier)] + [turn.id]
            yield conv


# ---- OpenAI chat format -----------------------------------------------------------------------------


def openai_message(m: Message) -> dict[str, Any]:
    """A neutral message in OpenAI chat format (tool-call arguments as a JSON string)."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.role == "assistant" and m.reasoning:
        out["reasoning_content"] = m.reasoning
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json()}}
            for c in m.tool_calls
        ]
    if m.role == "tool":
        out["tool_call_id"] = m.tool_call_id or ""
        if m.name:
            out["name"] = m.name
    return out


def sft_record(conv: Conversation, *, strategy: str = Strategy.PREFIX_MERGE) -> dict[str, Any]:
    return {
        "messages": [openai_message(m) for m in conv.messages],
        "tools": [t.to_template() for t in conv.tools],
        "metadata": {
            "trajectory_id": conv.turn_id,
            "session_id": conv.session_id,
            "task_id": conv.task_id,
            "turn_ids": conv.turn_ids,
            "strategy": strategy,
            "source": "harvest" if conv.harvested else "policy",
            "style": conv.style,
            "model": conv.model,
            "finish_reason": conv.finish_reason,
            "reward": conv.reward,
            "tags": conv.tags,
        },
    }


def sft_records(
    path: str | Path,
    *,
    strategy: str = Strategy.PREFIX_MERGE,
    selection: Selection | None = None,
    stats: ReconstructStats | None = None,
    on_turn: Callable[[], object] | None = None,
) -> Iterator[dict[str, Any]]:
    """Every conversation of the store (harvested or policy turns) as an SFT record."""
    stats = stats if stats is not None else ReconstructStats()
    for conv in conversations(path, strategy=strategy, selection=selection, stats=stats, on_turn=on_turn):
        stats.trajectories += 1
        yield sft_record(conv, strategy=strategy)


# ---- retokenized rows ----------------------------------------------------------------------------------


@dataclass
class Segment:
    text: str
    trained: bool


@dataclass
class RenderedSequence:
    segments: list[Segment]
    last_reply: int  # index in the conversation of the last reply this sequence trains


def render_segments(
    tok: Tokenizer,
    messages: list[Message],
    tools: list[Tool],
    *,
    template_kwargs: dict[str, Any] | None = None,
    train: str = "all",
) -> tuple[list[RenderedSequence], int]:
    """A conversation rendered prefix by prefix, so each assistant reply's span is known.

    For each assistant message i the template renders messages[:i] with the generation prompt
    (P) and messages[:i+1] without it (F); F minus P is what the model would have generated.
    Consecutive replies share one sequence while each P extends the text so far; where the
    template rewrites history (e.g. drops earlier reasoning) a new sequence starts. A reply whose
    F does not extend its P cannot be marked and stays untrained. `train="last"` marks only the
    last reply. Returns the sequences (each a list of segments) and how many replies stayed
    untrained for those reasons.
    """
    kw = template_kwargs or {}
    tmpl = [m.to_template() for m in messages]
    tdefs = [t.to_template() for t in tools] or None
    replies = [i for i, m in enumerate(messages) if m.role == "assistant"]
    if train == "last":
        replies = replies[-1:]
    rows: list[RenderedSequence] = []
    current: list[Segment] = []
    text = ""
    unmarked = 0
    last = -1
    for i in replies:
        prompt = tok.render(tmpl[:i], tools=tdefs, add_generation_prompt=True, **kw)
        full = tok.render(tmpl[: i + 1], tools=tdefs, add_generation_prompt=False, **kw)
        if not full.startswith(prompt):
            unmarked += 1
            continue
        if current and prompt.startswith(text):
            current.append(Segment(prompt[len(text) :], False))
        else:
            if any(s.trained for s in current):
                rows.append(RenderedSequence(current, last))
            current = [Segment(prompt, False)]
        current.append(Segment(full[len(prompt) :], True))
        text = full
        last = i
    if any(s.trained for s in current):
        rows.append(RenderedSequence(current, last))
    return rows, unmarked


def encode_segments(tok: Tokenizer, segments: list[Segment]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and loss mask of a rendered sequence. Each segment is encoded on its own (a reply
    starts where generation would); a reply is trained up to and including its end-of-turn
    token, and what the template writes after that (a newline) is not."""
    ids: list[int] = []
    mask: list[int] = []
    for seg in segments:
        seg_ids = tok.encode(seg.text)
        seg_mask = [0] * len(seg_ids)
        if seg.trained:
            ends = [k for k, t in enumerate(seg_ids) if t in tok.eos_token_ids]
            stop = ends[-1] + 1 if ends else len(seg_ids)
            seg_mask[:stop] = [1] * stop
        ids += seg_ids
        mask += seg_mask
    return np.asarray(ids, dtype=TOKEN_DTYPE), np.asarray(mask, dtype=MASK_DTYPE)


def retokenized_trajectories(
    path: str | Path,
    *,
    tokenizer: str | Path,
    strategy: str = Strategy.PREFIX_MERGE,
    selection: Selection | None = None,
    stats: ReconstructStats | None = None,
    on_turn: Callable[[], object] | None = None,
) -> Iterator[Trajectory]:
    """Harvested conversations as trajectory rows, rendered with `tokenizer`'s chat template.

    prefix-merge: one row per final conversation with every assistant reply trained (more rows
    where the template rewrites history); per-request: one row per turn, its reply trained.
    """
    tok = Tokenizer.load(tokenizer)
    stats = stats if stats is not None else ReconstructStats()
    train = "last" if strategy == Strategy.PER_REQUEST else "all"
    for conv in conversations(
        path, strategy=strategy, selection=selection, stats=stats, harvested_only=True, on_turn=on_turn
    ):
        kwargs = {} if conv.thinking is None else {"enable_thinking": conv.thinking}
        sequences, unmarked = render_segments(
            tok, conv.messages, conv.tools, template_kwargs=kwargs, train=train
        )
        if unmarked:
            stats.mismatches["retokenize_unmarked_reply"] += unmarked
        for k, seq in enumerate(sequences):
            ids, mask = encode_segments(tok, seq.segments)
            last = k == len(sequences) - 1
            reply = conv.messages[seq.last_reply]
            yield Trajectory.from_sequence(
                ids,
                mask,
                np.zeros(len(ids), dtype=LOGPROB_DTYPE),
                trajectory_id=conv.turn_id if last else f"{conv.turn_id}#{k}",
                session_id=conv.session_id,
                task_id=conv.task_id,
                turn_ids=conv.turn_ids,
                finish_reason=conv.finish_reason
                if seq.last_reply == len(conv.messages) - 1
                else ("tool_calls" if reply.tool_calls else "stop"),
                reward=conv.reward,
                meta={
                    "strategy": strategy,
                    "source": "harvest",
                    "retokenized": True,
                    "tokenizer": tok.path,
                    "models": [conv.model] if conv.model else [],
                    "styles": [conv.style],
                    "tags": conv.tags,
                    "sequence": k,
                    "sequences": len(sequences),
                    "unmarked_replies": unmarked,
                },
            )
