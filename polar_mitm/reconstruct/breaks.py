"""Why a prompt stopped extending an earlier sequence: classifying prefix-merge breaks.

A *break* is a prompt that shares a prefix with an earlier sequence of its session but then
diverges from it: either it starts a new trajectory (compaction, a subagent, a rewritten history)
or it branches off inside tokens the model sampled (the splice of an earlier reply failed). At the
first differing position `k` the break is classified as

- ``template``: a template token (an added/special token such as ``<|im_end|>`` or ``<think>``)
  differs there, on both sides, or on one side while `k` lies inside sampled tokens (e.g. the
  template stripped ``<think>…</think>`` from a reply it re-renders);
- ``retokenization``: decoding both sides from just before `k` gives text where one is a prefix of
  the other: the same text, split into different tokens (needs a tokenizer);
- ``other``: the text itself changed (a new user message, a summary, a different system prompt);
- ``unknown``: no tokenizer was given, so text could not be compared.

Without a tokenizer the template tokens known are the stop tokens the engine ended replies with.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

BREAK_CLASSES = ("template", "retokenization", "other", "unknown")

# Tokens of context decoded before the divergence, so byte-level pieces of one character line up.
_DECODE_MARGIN = 8


@dataclass
class TokenText:
    """What break classification needs from a tokenizer: its template tokens and a decoder."""

    template_ids: set[int] = field(default_factory=set)
    decode: Callable[[Sequence[int]], str] | None = None

    @classmethod
    def load(cls, path: str | Path) -> TokenText:
        """A Hugging Face tokenizer directory (or its tokenizer.json): added tokens + decode."""
        from polar_mitm.backends.tokenizer import Tokenizer

        tokenizer = Tokenizer.load(path)
        with open(Path(tokenizer.path) / "tokenizer.json", encoding="utf-8") as f:
            added = json.load(f).get("added_tokens", [])
        return cls(template_ids={int(t["id"]) for t in added}, decode=tokenizer.decode)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def classify_break(
    old: Sequence[int] | np.ndarray,
    new: Sequence[int] | np.ndarray,
    k: int,
    *,
    in_sampled: bool,
    text: TokenText | None = None,
) -> str:
    """Classify a divergence of `new` from `old` at position `k` (`old[:k] == new[:k]`).

    `in_sampled` says whether old[k] is a token the model sampled. `text` gives template ids and
    a decoder; without a decoder the result is ``template`` or ``unknown``.
    """
    text = text or TokenText()
    o = int(old[k]) if k < len(old) else None
    n = int(new[k]) if k < len(new) else None
    o_t, n_t = o in text.template_ids, n in text.template_ids
    if (o_t and n_t) or ((o_t or n_t) and in_sampled):
        return "template"
    if text.decode is None:
        return "unknown"
    start = max(0, k - _DECODE_MARGIN)
    old_text = text.decode(list(old[start:]))
    new_text = text.decode(list(new[start:]))
    if old_text.startswith(new_text) or new_text.startswith(old_text):
        return "retokenization"
    return "other"
