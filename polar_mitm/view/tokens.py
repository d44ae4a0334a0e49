"""A trajectory's tokens as the viewer shows them: the text of each token, and one page of the row.

Decoding token by token with `decode([id])` turns every token that ends inside a multi-byte
character into U+FFFD. For byte-level BPE vocabularies (GPT-2, Qwen, Llama 3) each token is a
run of bytes, so `TokenPieces` joins the bytes of consecutive tokens and gives each token the
characters it completes: the pieces concatenate to exactly the decoded text, and a token that
ends mid-character shows as empty (its hover still shows its id). Other vocabularies fall back to
decoding one token at a time.

`page_of` is pure: a `Trajectory`, the facts of its turns (from the store) and a decoder in, the
tokens of one page out, each with its place in the row, whether it is trained, its logprob and the
turn it came from. Pages keep the DOM of a 100k-token row small (see docs/view.md).
"""

from __future__ import annotations

import json
import math
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import numpy as np

from polar_mitm.reconstruct.trajectory import Trajectory

PAGE_TOKENS = 4096
# Logprob shading: probability exp(logprob) in eight steps, 0 (unlikely) … 7 (certain).
SHADES = 8


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the byte-level alphabet's characters → bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenPieces:
    """The text of each token id of a tokenizer directory (see the module docstring)."""

    def __init__(self, path: str | Path):
        from polar_mitm.backends.tokenizer import Tokenizer

        self.tokenizer = Tokenizer.load(path)
        with open(Path(self.tokenizer.path) / "tokenizer.json", encoding="utf-8") as f:
            spec = json.load(f)
        self.added = {int(t["id"]): t["content"] for t in spec.get("added_tokens", [])}
        decoder = spec.get("decoder") or {}
        kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", [])]
        self.byte_level = "ByteLevel" in kinds

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode()
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        table = _byte_decoder()
        try:
            return bytes(table[c] for c in piece)
        except KeyError:  # not in the byte alphabet after all
            return piece.encode()

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """One string per id; joined, they are the decoded text of `ids`."""
        if not self.byte_level:
            return [self.tokenizer.decode([int(i)]) for i in ids]
        out: list[str] = []
        pending = b""
        for i in ids:
            pending += self._bytes(int(i))
            text, pending = _complete(pending)
            out.append(text)
        if pending and out:
            out[-1] += pending.decode("utf-8", errors="replace")
        return out


def _complete(buf: bytes) -> tuple[str, bytes]:
    """The characters `buf` completes, and the bytes of a character it has only begun."""
    try:
        return buf.decode("utf-8"), b""
    except UnicodeDecodeError as e:
        if e.reason == "unexpected end of data" and len(buf) - e.start < 4:
            head = buf[: e.start].decode("utf-8", errors="replace")
            return head, buf[e.start :]
        return buf.decode("utf-8", errors="replace"), b""


@dataclass(frozen=True)
class TurnSpan:
    """Where one turn's sampled tokens sit in a row: [start, end) over prompt + response."""

    turn_id: str
    index: int  # the turn's place in the row (0-based)
    start: int
    end: int
    weight_version: str | None
    tag: str | None


@dataclass
class TokenPage:
    """One page of a row's tokens, and what the page's head shows about the whole row."""

    number: int
    pages: int
    size: int  # tokens per page
    start: int  # the first token's index in the row
    ids: list[int]
    text: list[str] | None  # None: no tokenizer, ids are shown
    trained: list[bool]
    logprobs: list[float]
    shade: list[int]
    turn: list[int]  # index into spans, -1 outside every turn's sampled tokens
    kind: list[str]  # prompt | context | sampled | copy (sampled, trained in another row)
    spans: list[TurnSpan]
    boundaries: dict[int, int] = field(default_factory=dict)  # row index → span index, on this page


def turn_spans(row: Trajectory, facts: dict[str, tuple[int, int, str | None, str | None]]) -> list[TurnSpan]:
    """The sampled span of each turn of a row, from each turn's (prompt_len, output_len,
    weight_version, tag): a prefix-merge row's turns are prefixes of its sequence, so a turn's
    output sits right after its prompt. Per-request rows are one turn."""
    spans = []
    n = row.num_tokens
    for i, tid in enumerate(row.turn_ids):
        prompt_len, output_len, version, tag = facts.get(tid, (0, 0, None, None))
        start = min(prompt_len, n)
        spans.append(TurnSpan(tid, i, start, min(start + output_len, n), version, tag))
    return spans


def shade_of(logprob: float) -> int:
    return min(SHADES - 1, max(0, int(math.exp(min(logprob, 0.0)) * SHADES)))


def page_of(
    row: Trajectory,
    spans: list[TurnSpan],
    number: int,
    *,
    decode: Callable[[Sequence[int]], list[str]] | None = None,
    size: int = PAGE_TOKENS,
) -> TokenPage:
    """Page `number` (0-based, clamped) of the row's whole sequence."""
    n = row.num_tokens
    pages = max(1, math.ceil(n / size))
    number = min(max(0, number), pages - 1)
    lo, hi = number * size, min(n, (number + 1) * size)
    cut = len(row.prompt_ids)
    ids = np.concatenate([row.prompt_ids, row.response_ids])[lo:hi]
    mask = np.concatenate([np.zeros(cut, dtype=np.int8), row.loss_mask])[lo:hi]
    logprobs = np.concatenate([np.zeros(cut, dtype=np.float32), row.response_logprobs])[lo:hi]
    starts = [s.start for s in spans]
    turn, kind = [], []
    for k in range(lo, hi):
        j = bisect_right(starts, k) - 1
        inside = j >= 0 and k < spans[j].end
        turn.append(j if inside else -1)
        if mask[k - lo]:
            kind.append("sampled")
        elif inside:
            kind.append("copy")
        else:
            kind.append("prompt" if k < cut and j < 0 else "context")
    id_list = ids.tolist()
    lp = logprobs.tolist()
    trained = [bool(m) for m in mask.tolist()]
    return TokenPage(
        number=number,
        pages=pages,
        size=size,
        start=lo,
        ids=id_list,
        text=decode(id_list) if decode is not None else None,
        trained=trained,
        logprobs=lp,
        shade=[shade_of(x) if t else 0 for x, t in zip(lp, trained, strict=True)],
        turn=turn,
        kind=kind,
        spans=spans,
        boundaries={s.start: s.index for s in spans if lo <= s.start < hi},
    )
