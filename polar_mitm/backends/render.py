"""Prompt rendering and splicing, as pure functions over a tokenizer.

Splice: when a request repeats an earlier assistant reply, the prompt is that earlier turn's
exact token sequence (prompt + sampled ids) followed by the new messages rendered alone. Turns
are therefore append-only by construction, and rendering costs grow with the new messages of a
turn, not with the whole context.

Matching an echoed reply to the turn that sampled it uses a hash chain over normalized messages
(`conversation_hashes`): volatile parts (cache markers, tool-call ids, whitespace, reasoning that
some harnesses drop) are left out, so the same conversation always hashes the same.
"""

from __future__ import annotations

import hashlib
import json
import operator
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from polar_mitm.backends.engine_api import ids_json
from polar_mitm.backends.tokenizer import Tokenizer
from polar_mitm.neutral import Message, Tool

_SENTINEL = "\u2063polar-splice\u2063"


def _message_key(m: Message) -> str:
    calls = [[c.name, c.arguments if c.raw is None else c.raw] for c in m.tool_calls]
    return json.dumps([m.role, m.content.strip(), calls], sort_keys=True, ensure_ascii=False)


def extend_hash(prev: str, message: Message) -> str:
    """The hash of a conversation one message longer than the one `prev` identifies."""
    held = (message, message.role, message.content, message.reasoning, message.tool_calls)
    return _by_identity(
        _BY_OBJECT, (prev, id(message)), held, len(message.content), _extend_hash, prev, message
    )


def _by_identity(
    memo: _Memo, key: Any, held: tuple, chars: int, compute: Callable[..., str], *args: Any
) -> str:
    """compute(*args), remembered for objects known by identity. Requests read alike share their message
    and tool objects (ItemMemo); `held` keeps the objects (so that their ids are not others'
    meanwhile) and the fields they held (a field set anew since is seen; nothing is changed in
    place once read)."""
    known = memo.get(key)
    if known is not None and all(map(operator.is_, known[0], held)):
        return known[1]
    value = compute(*args)
    memo.put(key, (held, value), chars)
    return value


def _extend_hash(prev: str, message: Message) -> str:
    calls = tuple(
        (c.name, c.raw) if c.raw is not None else (c.name, json.dumps(c.arguments, sort_keys=True))
        for c in message.tool_calls
    )
    key = (prev, message.role, message.content, calls)
    known = _HASHES.get(key)
    if known is None:
        known = hashlib.sha256(prev.encode() + b"\x00" + _message_key(message).encode()).hexdigest()[:32]
        _HASHES.put(key, known, len(message.content))
    return known


class _Memo:
    """A bounded memo (by the characters of the messages it holds): a harness sends its whole
    conversation every turn, so every turn would otherwise hash every earlier message again.
    Two generations: entries not used since the last swap are dropped at the next."""

    def __init__(self, max_chars: int):
        self.max_chars = max_chars
        self.new: dict = {}
        self.old: dict = {}
        self.chars = 0

    def get(self, key):
        held = self.new.get(key)
        if held is None and (held := self.old.get(key)) is not None:
            self.put(key, *held)
        return held[0] if held is not None else None

    def put(self, key, value, chars: int) -> None:
        if self.chars + chars > self.max_chars:
            self.old, self.new, self.chars = self.new, {}, 0
        self.new[key] = (value, chars)
        self.chars += chars


_HASHES = _Memo(32_000_000)
_BY_OBJECT = _Memo(32_000_000)
_TOOLS_BY_OBJECT = _Memo(8_000_000)


def conversation_hashes(messages: list[Message], tools: list[Tool]) -> list[str]:
    """h[i] identifies the conversation made of the first i messages (and the tool set)."""
    h = _tools_hash(tools)
    out = [h]
    for m in messages:
        h = extend_hash(h, m)
        out.append(h)
    return out


def _tools_hash(tools: list[Tool]) -> str:
    """The hash of a tool set, known by identity as messages are (its JSON, sorted, is ~0.25 ms a
    turn for Claude Code's tools)."""
    held = tuple(x for t in tools for x in (t, t.name, t.description, t.parameters))
    chars = sum(len(t.description) + 1_000 for t in tools)
    return _by_identity(_TOOLS_BY_OBJECT, tuple(map(id, tools)), held, chars, _hash_tools, tools)


def _hash_tools(tools: list[Tool]) -> str:
    return hashlib.sha256(
        json.dumps([t.model_dump() for t in tools], sort_keys=True, ensure_ascii=False).encode()
    ).hexdigest()[:32]


def render_full(
    tok: Tokenizer,
    messages: list[Message],
    tools: list[Tool],
    template_kwargs: dict[str, Any],
    prefixes: PrefixCache | None = None,
) -> list[int]:
    """The prompt ids of a whole conversation; `prefixes` remembers the ids of its first block
    (system prompt and tools) for the next conversation that starts with the same one, and then
    returns `PromptIds` (their serialized form comes with them)."""
    text = tok.render(
        [m.to_template() for m in messages],
        tools=[t.to_template() for t in tools] or None,
        add_generation_prompt=True,
        **template_kwargs,
    )
    return prefixes.encode(tok, text) if prefixes is not None else tok.encode(text)


class PromptIds(list):
    """Prompt ids whose first `head_len` ids come with their `ids_json` text, `head_json`, so a
    request can be serialized without them."""

    __slots__ = ("head_len", "head_json")

    def __init__(self, ids: list[int], head_len: int, head_json: bytes):
        super().__init__(ids)
        self.head_len = head_len
        self.head_json = head_json

    def serialized(self) -> bytes:
        """`ids_json(self)`, from the known head and the rest."""
        rest = ids_json(self[self.head_len :])
        return self.head_json + b"," + rest if rest else self.head_json


class PrefixCache:
    """Token ids of rendered prompt prefixes that end at an end-of-turn special token, so the
    thousands of rollout sessions that share them tokenize them once. Two per prompt are kept: its
    first block (in ChatML the system prompt with its tools, through `<|im_end|>`: shared by every
    session of a harness) and the prompt through its last end-of-turn token (shared by the samples
    of one task, whose first turn differs only after it). A prompt is encoded from the longest
    kept prefix it starts with. Keyed by the prefix's text (sha256), bounded by the tokens held
    (least recently used out first; a hit keeps the shorter kept prefixes of the prompt in use
    too); thread-safe.

    The ids are those encoding the whole text gives: a tokenizer splits its input at special
    tokens before anything else, so what follows one encodes the same whatever came before. The
    rest is encoded with the boundary token in front (then dropped, its id checked), so it is not
    the start of an input (some pre-tokenizers treat that specially) and the boundary's own
    whitespace handling is the same as in the whole text. The ids through the last boundary are
    those of the rest up to its last boundary id: only the boundary's text gives its id, and every
    occurrence of that text does (counted: where they differ, nothing more is kept).

    A prefix is kept as an int32 array and as its `ids_json` text, ready for the request body
    (~10 bytes a token in all).
    """

    def __init__(self, max_tokens: int = 4_000_000):
        self.max_tokens = max_tokens
        self.size = 0
        self.hits = 0
        self.misses = 0
        self._items: OrderedDict[bytes, tuple[array, bytes]] = OrderedDict()  # key -> (ids, ids_json)
        self._lock = threading.Lock()

    def encode(self, tok: Tokenizer, text: str) -> list[int]:
        """`tok.encode(text)`, reusing the ids of the longest kept prefix of the text."""
        cuts = _turn_ends(tok, text) if self.max_tokens > 0 else []
        if not cuts:
            return tok.encode(text)
        keys = _prefix_keys(tok, text, [end for end, _, _ in cuts])
        at, known = 0, None
        with self._lock:
            for i in range(len(cuts) - 1, -1, -1):
                got = self._items.get(keys[i])
                if got is not None:
                    self._items.move_to_end(keys[i])
                    if known is None:
                        at, known = i, got
        end, boundary, boundary_id = cuts[at]
        tail = tok.encode(boundary + text[end:])
        if not tail or tail[0] != boundary_id:
            return tok.encode(text)
        if known is not None:
            self.hits += 1
            head, head_json = known[0].tolist(), known[1]
        else:
            head = tok.encode(text[:end])
            if not head or head[-1] != boundary_id:
                return tok.encode(text)
            self.misses += 1
            head_json = ids_json(head)
        if len(cuts) - 1 > at:
            self._keep_through_last(tok, head, head_json, tail, len(cuts) - 1 - at, keys[-1])
        if known is None:  # after it: the first block, shared most widely, is the last one out
            self._put(keys[0], head, head_json)
        head_len = len(head)
        return PromptIds(head + tail[1:], head_len, head_json)

    def _keep_through_last(
        self, tok: Tokenizer, head: list[int], head_json: bytes, tail: list[int], later: int, key: bytes
    ) -> None:
        """Keep the ids through the prompt's last boundary: `head`, then `tail` (its first id the
        boundary `head` ends at) up to its last boundary id, when `tail` holds exactly the `later`
        boundaries the text has after the head."""
        ends = {i for _, i in tok.turn_ends}
        at = [k for k, t in enumerate(tail) if t in ends]
        if len(at) != later + 1:
            return
        rest = tail[1 : at[-1] + 1]
        self._put(key, head + rest, head_json + b"," + ids_json(rest))

    def _put(self, key: bytes, ids: list[int], serialized: bytes) -> None:
        if len(ids) > self.max_tokens:
            return
        with self._lock:
            if key in self._items:
                return
            self._items[key] = (array("i", ids), serialized)
            self.size += len(ids)
            while self.size > self.max_tokens:
                _, (old, _) = self._items.popitem(last=False)
                self.size -= len(old)


def _turn_ends(tok: Tokenizer, text: str) -> list[tuple[int, str, int]]:
    """(where each end-of-turn token of `text` ends, its text, its id), in order."""
    found: list[tuple[int, str, int]] = []
    for boundary, boundary_id in tok.turn_ends:
        i = text.find(boundary)
        while i >= 0:
            found.append((i + len(boundary), boundary, boundary_id))
            i = text.find(boundary, i + len(boundary))
    found.sort()
    return found


def _prefix_keys(tok: Tokenizer, text: str, ends: list[int]) -> list[bytes]:
    """The cache's key of `text[:end]` for each of `ends` (ascending), in one pass over the text."""
    h = hashlib.sha256(tok.path.encode() + b"\x00")
    keys, done = [], 0
    for end in ends:
        h.update(text[done:end].encode())
        keys.append(h.copy().digest())
        done = end
    return keys


class SpliceError(ValueError):
    """The template does not render new messages independently of the history."""


def render_continuation(
    tok: Tokenizer,
    new_messages: list[Message],
    prev_output_ids: list[int],
    template_kwargs: dict[str, Any],
) -> list[int]:
    """Token ids that follow an earlier turn's sampled ids to form the new prompt.

    Renders a stand-in conversation (one user and one assistant message) with and without the
    new messages; the difference is what the template puts after an assistant reply. The glue
    between the sampled ids and that difference is what the template writes after the reply's
    content: its end-of-turn marker (unless the model already sampled it) and any separator.
    """
    stand_in = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _SENTINEL}]
    before = _stand_in_text(tok, stand_in, template_kwargs)
    after = tok.render(
        stand_in + [m.to_template() for m in new_messages], add_generation_prompt=True, **template_kwargs
    )
    if not after.startswith(before):
        raise SpliceError("chat template re-renders history when messages are appended")
    end = before.rfind(_SENTINEL)
    if end < 0:
        raise SpliceError("chat template dropped the assistant content")
    closing = before[end + len(_SENTINEL) :]  # e.g. "<|im_end|>\n"
    glue = closing
    if prev_output_ids and prev_output_ids[-1] in tok.eos_token_ids:
        eos_text = tok.decode([prev_output_ids[-1]])
        if closing.startswith(eos_text):
            glue = closing[len(eos_text) :]
    return tok.encode(glue + after[len(before) :])


def _stand_in_text(tok: Tokenizer, stand_in: list[dict], template_kwargs: dict[str, Any]) -> str:
    """The stand-in conversation rendered alone: the same every turn, so rendered once per
    tokenizer and template arguments."""
    key = (id(tok), repr(sorted(template_kwargs.items())))
    held = _STAND_INS.get(key)
    if held is None or held[0] is not tok:
        held = (tok, tok.render(stand_in, add_generation_prompt=False, **template_kwargs))
        if len(_STAND_INS) >= 64:
            _STAND_INS.clear()
        _STAND_INS[key] = held
    return held[1]


_STAND_INS: dict[tuple[int, str], tuple[Tokenizer, str]] = {}


def generation_opens_reasoning(tok: Tokenizer, template_kwargs: dict[str, Any]) -> bool:
    """Whether the template's generation prompt already opens a <think> block."""
    text = tok.render([{"role": "user", "content": "u"}], add_generation_prompt=True, **template_kwargs)
    tail = text.rstrip()
    return tail.endswith("<think>")
