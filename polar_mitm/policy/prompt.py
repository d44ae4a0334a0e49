"""A request's prompt token ids: found in the store when the request echoes an earlier turn
(splice: that turn's prompt + sampled ids, then the new messages rendered after them), else
rendered whole; and the caches that make the next turn of a conversation cheap — the serialized
ids of recent sequences (an LRU bounded in bytes), the routing key of recent turns, and whether a
template opens the reasoning block itself."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from typing import Any

from polar_mitm.backends.engine_api import ids_json
from polar_mitm.backends.render import (
    PrefixCache,
    PromptIds,
    SpliceError,
    conversation_hashes,
    generation_opens_reasoning,
    render_continuation,
    render_full,
)
from polar_mitm.neutral import ChatRequest
from polar_mitm.policy.config import PolicyConfig
from polar_mitm.policy.discovery import Discovery
from polar_mitm.store.writer import Store

log = logging.getLogger("polar_mitm.policy")


def join_ids(a: bytes, b: bytes) -> bytes:
    """Two `ids_json` texts as one (either may be empty)."""
    return a + b"," + b if a and b else a or b


def template_kwargs(req: ChatRequest) -> dict[str, Any]:
    return {} if req.thinking is None else {"enable_thinking": req.thinking}


class Prompts:
    """Prompt ids for requests, and the per-conversation caches that make the next turn cheap."""

    # New messages up to this size are rendered on the event loop (about a millisecond).
    INLINE_RENDER_CHARS = 16_000
    # Conversations up to this many messages are hashed on the event loop (~50 µs a message);
    # longer ones in a thread (the hash memos are keyed on what they hash, so a race between the
    # two at most drops an entry).
    INLINE_HASH_MESSAGES = 1_000
    # Serialized sequences kept for splicing (bytes, ~6 per token): a few sessions' worth each.
    SENT_IDS_MAX_BYTES = 64 * 1024 * 1024
    # Routing keys kept for turns that echo them (a few hundred bytes each).
    ROUTING_KEYS_MAX = 100_000

    def __init__(self, config: PolicyConfig, store: Store, discovery: Discovery):
        self.config = config
        self.store = store
        self.discovery = discovery
        self.prefixes = PrefixCache(config.prefix_cache_tokens)
        # The serialized ids (`ids_json`) of recent turns' full sequences, so a spliced prompt is
        # sent as that text plus its new ids instead of re-serializing the whole conversation.
        self._sent_ids: OrderedDict[str, tuple[int, bytes]] = OrderedDict()
        self._sent_bytes = 0
        # A turn whose serialized sequence begins its successor's (the usual turn of a growing
        # conversation): that successor's id, and its own tokens and bytes. A retried turn (the
        # same request again, each answer a new branch from the same point) reads it from there
        # instead of serializing the whole conversation again.
        self._sent_views: OrderedDict[str, tuple[str, int, int]] = OrderedDict()
        # Routing keys of recent turns, so a turn that echoes one keeps its conversation's key
        # even when its first messages were rewritten (a tool set changed, a prompt compacted).
        self._keys: OrderedDict[str, str] = OrderedDict()
        self._reasoning_open: dict[str, bool] = {}

    # -- rendering ------------------------------------------------------------------------------

    async def echoed_turn(
        self, req: ChatRequest, session_id: str
    ) -> tuple[list[str], tuple[str, int] | None]:
        """The conversation's hashes, and the newest turn whose prompt + reply the request repeats
        (its id and how many of the request's messages that covers), if any."""
        msgs = req.messages
        if len(msgs) > self.INLINE_HASH_MESSAGES:  # seconds for 70,000 messages: not on the loop
            hashes = await asyncio.to_thread(conversation_hashes, msgs, req.tools)
        else:
            hashes = conversation_hashes(msgs, req.tools)
        candidates = [hashes[i] for i in range(len(msgs) - 1, 0, -1) if msgs[i - 1].role == "assistant"]
        hit = await self.store.find_by_post_hash(session_id, candidates) if candidates else None
        return hashes, (hit[0], hashes.index(hit[1])) if hit is not None else None

    async def extends(self, prompt_ids: list[int], turn_id: str) -> tuple[str | None, int]:
        """(turn_id, its sequence length) when that sequence is a token prefix of prompt_ids."""
        seq, _ = await self.store.sequence(turn_id)
        return (turn_id, len(seq)) if prompt_ids[: len(seq)] == seq else (None, 0)

    async def prompt(self, req: ChatRequest, session_id: str) -> tuple[list[int], str | None, int, list[str]]:
        """(prompt ids, referenced turn, tokens reused from it, conversation hashes)."""
        tok = await self.discovery.tokenizer()
        kw = template_kwargs(req)
        hashes, echo = await self.echoed_turn(req, session_id)
        if echo is not None and self.config.history == "splice":
            turn_id, k = echo
            seq, plen = await self.store.sequence(turn_id)
            try:
                new = req.messages[k:]
                args = (tok, new, seq[plen:], kw)
                # A few new messages render faster than a hop to a worker thread and back.
                small = sum(len(m.content) for m in new) < self.INLINE_RENDER_CHARS
                cont = (
                    render_continuation(*args)
                    if small
                    else await asyncio.to_thread(render_continuation, *args)
                )
                return seq + cont, turn_id, len(seq), hashes
            except SpliceError as e:
                log.warning("splice failed (%s); rendering the whole conversation", e)
        full = await asyncio.to_thread(render_full, tok, req.messages, req.tools, kw, self.prefixes)
        ref, ref_len = await self.extends(full, echo[0]) if echo is not None else (None, 0)
        return full, ref, ref_len, hashes

    async def count_tokens(self, req: ChatRequest) -> int:
        tok = await self.discovery.tokenizer()
        return len(
            await asyncio.to_thread(
                render_full, tok, req.messages, req.tools, template_kwargs(req), self.prefixes
            )
        )

    async def reasoning_open(self, req: ChatRequest, reasoning_parser: str | None) -> bool:
        """Whether the template's generation prompt opens the reasoning block itself (asked once
        per set of template arguments)."""
        kw = template_kwargs(req)
        key = repr(sorted(kw.items()))
        if key not in self._reasoning_open:
            tok = await self.discovery.tokenizer()
            self._reasoning_open[key] = bool(reasoning_parser) and generation_opens_reasoning(tok, kw)
        return self._reasoning_open[key]

    # -- the serialized sequences of recent turns -----------------------------------------------

    def serialized(self, prompt_ids: list[int], ref: str | None, ref_len: int) -> bytes:
        """`ids_json(prompt_ids)`, built from the referenced turn's serialized sequence when it is
        kept (that sequence is prompt_ids[:ref_len] by construction)."""
        kept = self._sent(ref) if ref is not None else None
        if kept is None or kept[0] != ref_len:
            return prompt_ids.serialized() if isinstance(prompt_ids, PromptIds) else ids_json(prompt_ids)
        return join_ids(kept[1], ids_json(prompt_ids[ref_len:]))

    def _sent(self, turn_id: str) -> tuple[int, bytes] | None:
        """(tokens, serialized sequence) of a kept turn, held or read from its successor's (a
        chain of successors, then pointed at the one that holds the bytes)."""
        held = self._sent_ids.get(turn_id)
        if held is not None:
            return held
        view = self._sent_views.get(turn_id)
        if view is None:
            return None
        chain = [turn_id]
        holder = view[0]
        while (held := self._sent_ids.get(holder)) is None:
            nxt = self._sent_views.get(holder)
            if nxt is None:  # what it pointed to is gone
                for t in chain:
                    self._sent_views.pop(t, None)
                return None
            chain.append(holder)
            holder = nxt[0]
        for t in chain[1:]:
            _, tokens, nbytes = self._sent_views[t]
            self._sent_views[t] = (holder, tokens, nbytes)
        _, tokens, nbytes = view
        self._sent_views[turn_id] = (holder, tokens, nbytes)
        return tokens, held[1][:nbytes]

    def keep_sent(self, turn_id: str, ref: str | None, tokens: int, serialized: bytes) -> None:
        if ref is not None and (old := self._sent_ids.pop(ref, None)) is not None:
            self._sent_bytes -= len(old[1])  # its successor covers it
            n = len(old[1])
            if serialized.startswith(old[1]) and serialized[n : n + 1] in (b",", b""):
                self._sent_views[ref] = (turn_id, old[0], n)
                while len(self._sent_views) > self.ROUTING_KEYS_MAX:
                    self._sent_views.popitem(last=False)
        self._sent_ids[turn_id] = (tokens, serialized)
        self._sent_bytes += len(serialized)
        while self._sent_bytes > self.SENT_IDS_MAX_BYTES and len(self._sent_ids) > 1:
            _, (_, old_bytes) = self._sent_ids.popitem(last=False)
            self._sent_bytes -= len(old_bytes)

    # -- routing keys ----------------------------------------------------------------------------

    def routing_key(self, req: ChatRequest, session_id: str, hashes: list[str], ref: str | None) -> str:
        """The conversation's routing key: the same for every turn of one conversation and for
        the retries of a turn, different across sessions (the samples of a group spread over the
        engines) and for a subagent or side call (its own first messages).

        A turn that echoes an earlier one (`ref`) keeps that turn's key; otherwise the key is the
        hash of the session and the conversation up to its first user message (system prompt,
        tools, task), which every later turn of it repeats."""
        if ref is not None and (kept := self._keys.get(ref)) is not None:
            return kept
        first = next((i for i, m in enumerate(req.messages) if m.role != "system"), len(req.messages))
        anchor = hashes[min(first + 1, len(hashes) - 1)]
        return hashlib.sha256(f"{session_id}\0{anchor}".encode()).hexdigest()[:32]

    def keep_key(self, turn_id: str, key: str) -> None:
        self._keys[turn_id] = key
        while len(self._keys) > self.ROUTING_KEYS_MAX:
            self._keys.popitem(last=False)
