"""The prefix-merge strategy: a session's turns folded into as few trajectories as token-exactness allows.

Rules (token ids only; nothing is ever re-tokenized):

1. **Extend.** A turn extends the deepest earlier sequence of its session (a turn's full sequence
   is its prompt + sampled output) that is a token prefix of the turn's prompt. The prompt's
   remaining tokens are appended with mask 0 and logprob 0.0 (tool results, user messages,
   template glue), then the sampled tokens with mask 1 and the engine's logprobs.
2. **Branch.** The sequences form a tree per session (a node per turn). Every leaf becomes one
   row, its path from the root being the row's sequence. Where two turns extend the same node
   (parallel calls, a subagent forked from the conversation, a retry with a changed message),
   the shared tokens appear in several rows but are *trained once*: a node's sampled tokens keep
   mask 1 only in the row of its **longest branch** — the child whose subtree holds the longest
   leaf sequence (the earliest child on a tie), followed down to a leaf. In every other row the
   shared sampled tokens are copies with mask 0 and logprob 0.0. So the main line of a
   conversation is trained end to end, and each side branch only on what it sampled itself.
3. **Retries.** Turns with identical prompt ids (same node, same appended tokens) are one request
   sent more than once. Of such a group the turns that others extend are kept; if none is
   extended, only the newest is kept. The rest are dropped and counted (`retries_dropped`).
4. **Breaks.** A turn that extends nothing while its session already has sequences starts a new
   trajectory (context compaction, a subagent with its own prompt, a template that rewrote
   history). It is compared with the most similar earlier sequence (longest common prefix) and
   classified by `breaks.classify_break`: template, retokenization, other, or unknown (no
   tokenizer). A turn that branches off *inside tokens the model sampled* (a failed splice) is a
   break too (`at: "branch"`). Prompts that diverge inside sampled tokens are also counted as
   `sampled_rewrite` mismatches.
5. **Structure.** A session whose turns form several conversations (the root's children: a
   subagent, a compacted conversation carried on, side calls, a prompt that stopped extending
   its history while the conversation went on) has each row's `role` and `parent_id` set by
   `structure.link`, from the evidence `SessionMerger.turn_links` gathers (the tool calls each
   turn made, the call results each later conversation's first request carries): the parent is
   the row that trains the turn the conversation came from (its tool call, or the summary it
   carries). Per-request rows take the same links (`per_request.turn_links`).
6. **Rows.** `prompt_ids` is everything before the first mask-1 token, `response_ids` the rest;
   `finish_reason` is the last turn's; `trajectory_id` is the last turn's id; the session's
   reward goes on every row of the session; `metadata` (JSON) holds the strategy, weight versions,
   models, styles, tags, where the row branched from and its breaks.
7. **Tool-call parse status.** A row's `tool_parse` is that of the turns it trains (null: no tool
   parser read them; `ok`; or the first failure's kind), every failure with its span in the row
   (`row_span`, positions in prompt_ids + response_ids); with `tool_parse_failures="mask"` a failed turn is trained nowhere.

Cost: each turn is placed with the store's `prompt_ref` hint (the turn its prompt was stored as
extending), verified by comparing tokens: against the newest sequence (the usual case: a linear
chain) as a list comparison that mostly compares shared int objects, else with one `memcmp` per
node on the hinted path. From there the tree is descended by comparing only the children's
appended spans (without a usable hint, from the root). Only the new part of a prompt is converted
to an array, so placement costs about one pass over each prompt at pointer speed plus one pass over
the unique tokens. A session holds only its unique tokens (each node stores just the span it
appended), and rows are built when the session is finished (`SessionMerger.finish`), because any
later turn may still extend any node of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from polar_mitm.reconstruct import structure
from polar_mitm.reconstruct.breaks import TokenText, classify_break, common_prefix
from polar_mitm.reconstruct.stats import ReconstructStats
from polar_mitm.reconstruct.trajectory import (
    LOGPROB_DTYPE,
    MASK_DTYPE,
    TOKEN_DTYPE,
    TOOL_PARSE_POLICIES,
    Trajectory,
    finish_reason_of,
    output_arrays,
    token_array,
)
from polar_mitm.reconstruct.trajectory import tool_parse_failures as tool_parse_failures_of
from polar_mitm.store.turn import Turn
from polar_mitm.strategies import Strategy

STRATEGY = Strategy.PREFIX_MERGE.value
_W = TOKEN_DTYPE.itemsize  # bytes per token id


@dataclass(eq=False, slots=True)
class _Node:
    """One turn in its session's tree: the tokens it appended to its parent's sequence."""

    turn: dict[str, Any]  # the few turn fields rows need; never the turn's full prompt
    parent: _Node | None
    start: int  # = parent's length: where this node's tokens begin in the sequence
    delta: bytes  # appended prompt tokens + sampled tokens, int32 little-endian
    n_inter: int  # how many of them are prompt tokens (mask 0)
    logprobs: np.ndarray  # engine logprobs of the sampled tokens
    order: int
    length: int = 0  # = start + number of tokens in delta
    children: list[_Node] = field(default_factory=list)
    dropped: bool = False
    best: int = 0  # longest leaf sequence in this subtree (set by finish)
    best_child: _Node | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.length = self.start + len(self.delta) // _W

    @property
    def turn_id(self) -> str:
        return self.turn["id"]

    @property
    def interstitial(self) -> bytes:
        return self.delta[: self.n_inter * _W]


class _Prompt:
    """A turn's prompt ids, converted to an array / bytes only if a comparison needs them."""

    __slots__ = ("ids", "_array", "_bytes")

    def __init__(self, ids: list[int] | np.ndarray):
        self.ids = ids
        self._array: np.ndarray | None = ids if isinstance(ids, np.ndarray) else None
        self._bytes: bytes | None = None

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def array(self) -> np.ndarray:
        if self._array is None:
            self._array = token_array(self.ids)
        return self._array

    @property
    def bytes(self) -> bytes:
        if self._bytes is None:
            self._bytes = self.array.tobytes()
        return self._bytes

    def tail(self, start: int) -> np.ndarray:
        """The ids from `start` on (converting only those, unless the whole is already converted)."""
        return self.array[start:] if self._array is not None else token_array(self.ids[start:])


class SessionMerger:
    """Prefix-merges the turns of one session, fed in creation order; `finish` yields its rows."""

    def __init__(
        self,
        session_id: str,
        *,
        task_id: str | None = None,
        reward: float | None = None,
        text: TokenText | None = None,
        stats: ReconstructStats | None = None,
        tool_calls: ToolCallsOf | None = None,
        tool_results: ToolResultsOf | None = None,
        tool_parse_failures: str = "keep",
    ) -> None:
        if tool_parse_failures not in TOOL_PARSE_POLICIES:
            raise ValueError(
                f"unknown tool-parse policy {tool_parse_failures!r}; "
                f"choose one of {', '.join(TOOL_PARSE_POLICIES)}"
            )
        # "mask": a turn whose tool calls did not all parse is not trained in any row.
        self.mask_tool_parse_failures = tool_parse_failures == "mask"
        self.session_id = session_id
        # The tool calls (id, name) each of some turns made, and the call ids whose results some
        # turns' requests carry, from the store; asked only for sessions of several conversations
        # (None: no subagent, and no continuation by a carried result, is recognized).
        self.tool_calls = tool_calls
        self.tool_results = tool_results
        self.task_id = task_id
        self.reward = reward
        self.text = text or TokenText()
        self.stats = stats if stats is not None else ReconstructStats()
        self.root = _Node(
            turn={"id": None}, parent=None, start=0, delta=b"", n_inter=0, logprobs=_NO_LOGPROBS, order=-1
        )
        self.nodes: list[_Node] = []
        self.by_turn: dict[str, _Node] = {}
        self.stop_ids: set[int] = set()  # template tokens known without a tokenizer
        # The newest node and its full sequence as the store's list: a continuation's prompt
        # shares those very int objects, so comparing it costs a pointer check per token.
        self._last: tuple[_Node, list[int]] | None = None
        self._links: dict[str, structure.Link] | None = None

    # --- placing turns ----------------------------------------------------------------------

    def add(self, turn: Turn) -> None:
        if turn.session_id != self.session_id:
            raise ValueError(f"turn {turn.id} is from session {turn.session_id}, not {self.session_id}")
        if turn.id in self.by_turn:
            raise ValueError(f"turn {turn.id} was added twice")
        output, logprobs, fits = output_arrays(turn.output_ids, turn.output_logprobs)
        if not fits:
            self.stats.mismatches["logprob_length"] += 1
        if self.task_id is None:
            self.task_id = turn.task_id
        prompt = _Prompt(turn.prompt_ids)
        parent = self._descend(self._hinted_start(turn, prompt), prompt)
        node = _Node(
            turn={
                "id": turn.id,
                "seq": turn.seq,
                "created_at": turn.created_at,
                "style": turn.style,
                "model": turn.model,
                "tag": turn.tag,
                "status": turn.status,
                "finish_reason": finish_reason_of(turn.finish_reason, turn.status),
                "weight_version": turn.weight_version,
                "tool_parse": turn.tool_parse,
            },
            parent=parent,
            start=parent.length,
            delta=prompt.tail(parent.length).tobytes() + output.tobytes(),
            n_inter=len(prompt) - parent.length,
            logprobs=logprobs,
            order=len(self.nodes),
        )
        if parent.children or (parent is self.root and self.nodes):
            self._compare_with_siblings(node, parent, prompt.array)
        parent.children.append(node)
        self.nodes.append(node)
        self.by_turn[turn.id] = node
        # Token arrays (what a per-request export reads) take the memcmp path instead.
        self._last = (node, turn.prompt_ids + turn.output_ids) if isinstance(turn.prompt_ids, list) else None
        self._links = None
        if turn.finish_reason == "stop" and len(output):
            self.stop_ids.add(int(output[-1]))

    def _hinted_start(self, turn: Turn, prompt: _Prompt) -> _Node:
        """The node the store's prompt_ref points at (or its ancestor within prompt_ref_len), if
        the tokens confirm it; else the root."""
        hint = self.by_turn.get(turn.prompt_ref) if turn.prompt_ref else None
        if hint is None:
            return self.root
        limit = min(turn.prompt_ref_len, len(prompt))
        node = hint
        while node.length > limit and node.parent is not None:
            node = node.parent  # the root has length 0, so this stops
        if self._is_prefix(node, prompt):
            return node
        self.stats.mismatches["hint_unverified"] += 1
        return self.root

    def _is_prefix(self, node: _Node, prompt: _Prompt) -> bool:
        """Whether node's full sequence is a prefix of the prompt."""
        if self._last is not None and self._last[0] is node:
            return prompt.ids[: node.length] == self._last[1]
        pb = prompt.bytes
        while node.parent is not None:
            if not pb.startswith(node.delta, node.start * _W):
                return False
            node = node.parent
        return True

    def _descend(self, node: _Node, prompt: _Prompt) -> _Node:
        """From `node` (a prefix of the prompt), the deepest descendant that is still a prefix."""
        n = len(prompt)
        while True:
            deeper = None
            offset = node.length * _W
            for child in node.children:
                if child.length <= n and (deeper is None or child.length > deeper.length):
                    if prompt.bytes.startswith(child.delta, offset):
                        deeper = child
            if deeper is None:
                return node
            node = deeper

    def _compare_with_siblings(self, node: _Node, parent: _Node, prompt: np.ndarray) -> None:
        """Classify how a turn relates to the sequences it did not extend (retry, branch, break)."""
        rest = prompt[parent.length :]
        best, best_len = None, -1
        for sibling in parent.children:
            n = common_prefix(rest, np.frombuffer(sibling.delta, dtype=TOKEN_DTYPE))
            if n >= best_len:  # a tie goes to the newest sibling
                best, best_len = sibling, n
        assert best is not None
        if best_len == len(rest):
            # The prompt ends inside an earlier sequence: the same request again, or a rewind.
            node.notes["retry_of" if best_len == best.n_inter else "rewind_of"] = best.turn_id
            return
        k = parent.length + best_len
        in_sampled = best_len >= best.n_inter
        if in_sampled:
            self.stats.mismatches["sampled_rewrite"] += 1
        if parent is not self.root and not in_sampled:
            node.notes["branch_of"] = best.turn_id
            return
        if k == 0:
            cls = "other"  # nothing in common with anything earlier
        else:
            old = np.concatenate([prompt[: parent.length], np.frombuffer(best.delta, dtype=TOKEN_DTYPE)])
            text = TokenText(self.text.template_ids | self.stop_ids, self.text.decode)
            cls = classify_break(old, prompt, k, in_sampled=in_sampled, text=text)
        node.notes["break"] = {
            "turn_id": node.turn_id,
            "class": cls,
            "at": "new-trajectory" if parent is self.root else "branch",
            "vs_turn": best.turn_id,
            "common_prefix": k,
            "in_sampled": in_sampled,
        }
        self.stats.breaks[cls] += 1

    # --- building rows ----------------------------------------------------------------------

    def finish(self) -> Iterator[Trajectory]:
        """The session's rows, one per leaf, in the order their last turns were created."""
        links = self.turn_links()
        self._drop_retries()
        for node in reversed(self.nodes):  # children come after parents
            if node.dropped:
                continue
            kept = node.children
            if not kept:
                node.best = node.length
                continue
            node.best_child = max(kept, key=lambda c: (c.best, -c.order))
            node.best = node.best_child.best
            self.stats.branches += len(kept) - 1
        rows = [self._row(leaf) for leaf in self.nodes if not leaf.dropped and not leaf.children]
        for row in rows:
            found = links[row.turn_ids[0]]
            row.role = found.role
            if found.parent_turn is not None:
                row.parent_id = self._trained_row(self.by_turn[found.parent_turn])
            row.meta.update(found.meta())
        self._last = None
        yield from rows

    def turn_links(self, stats: ReconstructStats | None = None) -> dict[str, structure.Link]:
        """Every turn's role and origin: its conversation's (`structure.link`), by turn id; a
        session of one conversation is all `main`, or `side` where its first turn is tagged.
        Where the evidence decided nothing, the break kind is counted in `stats` (default: the
        merger's own). Call before `finish`, which drops retries from the tree."""
        if self._links is not None:
            return self._links
        stats = stats if stats is not None else self.stats
        tops = self.root.children
        if len(tops) < 2:
            one = structure.Link("side" if tops and tops[0].turn["tag"] is not None else "main")
            self._links = dict.fromkeys(self.by_turn, one)
            return self._links
        convs: list[tuple[_Node, list[_Node]]] = []
        for top in tops:
            members, stack = [], [top]
            while stack:
                n = stack.pop()
                members.append(n)
                stack.extend(n.children)
            convs.append((top, sorted(members, key=lambda n: n.order)))
        calls = self.tool_calls([n.turn_id for _, ms in convs for n in ms]) if self.tool_calls else {}
        later = [top.turn_id for top, _ in convs[1:]]
        results = self.tool_results(later) if self.tool_results else {}
        facts = []
        for top, members in convs:
            turns = [
                structure.TurnFacts(
                    id=n.turn_id,
                    created_at=n.turn["created_at"],
                    next_at=min((c.turn["created_at"] for c in n.children), default=None),
                    calls=calls.get(n.turn_id, []),
                    output=np.frombuffer(n.delta[n.n_inter * _W :], dtype=TOKEN_DTYPE),
                    extends=n.parent.turn_id if n.parent is not None and n.parent is not self.root else None,
                )
                for n in members
            ]
            facts.append(
                structure.Conversation(
                    root=top.turn_id,
                    created_at=top.turn["created_at"],
                    tag=top.turn["tag"],
                    prompt=np.frombuffer(top.interstitial, dtype=TOKEN_DTYPE),
                    turns=turns,
                    results=frozenset(results.get(top.turn_id, ())),
                )
            )
        by_root = structure.link(facts)
        for found in by_root.values():
            if found.ambiguous is not None:
                stats.breaks[found.ambiguous] += 1
        self._links = {n.turn_id: by_root[top.turn_id] for top, members in convs for n in members}
        return self._links

    @staticmethod
    def _trained_row(node: _Node) -> str:
        """The id of the row that trains `node`: the leaf reached through its longest branches
        (a dropped retry's: that of the retry kept in its place)."""
        node = node.notes.get("kept", node)
        while node.best_child is not None:
            node = node.best_child
        return node.turn_id

    def _drop_retries(self) -> None:
        for parent in [self.root, *self.nodes]:
            if len(parent.children) < 2:
                continue
            groups: dict[bytes, list[_Node]] = {}
            for child in parent.children:
                groups.setdefault(child.interstitial, []).append(child)
            for group in groups.values():
                if len(group) < 2:
                    continue
                keep = [c for c in group if c.children] or [max(group, key=lambda c: c.order)]
                for c in group:
                    if c not in keep:
                        c.dropped = True
                        c.notes["kept"] = keep[0]
                        self.stats.retries_dropped += 1
                keep[0].notes["retries_dropped"] = len(group) - len(keep)
            parent.children = [c for c in parent.children if not c.dropped]

    def _row(self, leaf: _Node) -> Trajectory:
        path: list[_Node] = []
        node: _Node | None = leaf
        while node is not None and node.parent is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        # Which nodes this row trains: the leaf, and each ancestor reached through its best child.
        owned = [False] * len(path)
        owns = True
        for i in range(len(path) - 1, -1, -1):
            owned[i] = owns
            owns = owns and path[i].parent.best_child is path[i]  # type: ignore[union-attr]
        ids = np.frombuffer(b"".join(n.delta for n in path), dtype=TOKEN_DTYPE)
        mask = np.zeros(len(ids), dtype=MASK_DTYPE)
        logprobs = np.zeros(len(ids), dtype=LOGPROB_DTYPE)
        parse = [
            tool_parse_failures_of(n.turn["tool_parse"]) if mine else (False, [])
            for n, mine in zip(path, owned, strict=True)
        ]
        for n, mine, (_, failed) in zip(path, owned, parse, strict=True):
            if mine and not (failed and self.mask_tool_parse_failures):
                s = n.start + n.n_inter
                mask[s : n.length] = 1
                logprobs[s : n.length] = n.logprobs
        first_owned = owned.index(True)
        turns = [n.turn for n in path]
        meta: dict[str, Any] = {
            "strategy": STRATEGY,
            "weight_versions": _distinct(t["weight_version"] for t in turns),
            "models": _distinct(t["model"] for t in turns),
            "styles": _distinct(t["style"] for t in turns),
            "tags": _distinct(t["tag"] for t in turns),
            "statuses": _distinct(t["status"] for t in turns),
            "created_at": [turns[0]["created_at"], turns[-1]["created_at"]],
            # Tokens before `trained_from` belong to a node another row trains (0: none do).
            "trained_from": path[first_owned].start,
            "branched_from": path[first_owned - 1].turn_id if first_owned else None,
            "breaks": [n.notes["break"] for n in path if "break" in n.notes],
            "retries_dropped": sum(n.notes.get("retries_dropped", 0) for n in path),
        }
        row = Trajectory.from_sequence(
            ids,
            mask,
            logprobs,
            trajectory_id=leaf.turn_id,
            session_id=self.session_id,
            task_id=self.task_id,
            turn_ids=[t["id"] for t in turns],
            finish_reason=leaf.turn["finish_reason"],
            reward=self.reward,
            meta=meta,
        )
        if any(parsed for parsed, _ in parse):
            found = [
                {**f, "turn_id": n.turn_id, "row_span": shifted_span(f.get("span"), n.start + n.n_inter)}
                for n, (_, failed) in zip(path, parse, strict=True)
                for f in failed
            ]
            row.tool_parse = found[0].get("kind") if found else "ok"
            if found:
                meta["tool_parse_failures"] = found
        return row


_NO_LOGPROBS = np.zeros(0, dtype=LOGPROB_DTYPE)
ToolCallsOf = Callable[[list[str]], Mapping[str, list[tuple[str, str]]]]
ToolResultsOf = Callable[[list[str]], Mapping[str, Iterable[str]]]


def shifted_span(span: Any, by: int) -> list[int] | None:
    """A failed block's span in its turn's sampled tokens, moved to the row's whole sequence
    (prompt_ids + response_ids: a masked turn may have moved into prompt_ids)."""
    if not (isinstance(span, list) and len(span) == 2):
        return None
    return [int(span[0]) + by, int(span[1]) + by]


def _distinct(values: Iterable[Any]) -> list[Any]:
    return list(dict.fromkeys(v for v in values if v is not None))


def prefix_merge(
    turns: Iterable[Turn],
    *,
    rewards: Mapping[str, float | None] | None = None,
    text: TokenText | None = None,
    stats: ReconstructStats | None = None,
    tool_calls: ToolCallsOf | None = None,
    tool_results: ToolResultsOf | None = None,
    tool_parse_failures: str = "keep",
) -> Iterator[Trajectory]:
    """Prefix-merge `turns` (creation order, any sessions); rows come session by session.

    Every session is held until the input ends, so for a whole store feed one session at a time
    (what `export.iter_trajectories` does).
    """
    rewards = rewards or {}
    mergers: dict[str, SessionMerger] = {}
    for turn in turns:
        merger = mergers.get(turn.session_id)
        if merger is None:
            merger = mergers[turn.session_id] = SessionMerger(
                turn.session_id,
                reward=rewards.get(turn.session_id),
                text=text,
                stats=stats,
                tool_calls=tool_calls,
                tool_results=tool_results,
                tool_parse_failures=tool_parse_failures,
            )
        merger.add(turn)
    for merger in mergers.values():
        yield from merger.finish()
