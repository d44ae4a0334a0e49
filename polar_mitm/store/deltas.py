"""Raw requests stored as what differs from an earlier one.

A harness resends its whole conversation every turn, and a conversation's requests mostly grow by
appending messages: the next request shares the previous one's start (model, earlier messages)
and its end (in the Anthropic style the system prompt and tools come after the messages). So a
request is stored as a reference to an earlier turn's request, how many characters of its start
(`head`) and of its end (`tail`) to keep, and the text between them (the delta). Any text can be
stored this way; one that shares little with the reference is stored whole.

Pure functions here; `writer.Store` picks the reference and writes, the readers resolve.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

# Characters compared per slice while walking to the first difference (memcmp does the work).
_BLOCK = 4096
# A delta is kept only when it saves at least this many characters and half the request.
MIN_SAVING = 1024


class Delta(NamedTuple):
    head: int
    tail: int
    middle: str


def _prefix(a: str, b: str, limit: int) -> int:
    """Length of the common start of a and b, at most `limit`."""
    i = 0
    while i < limit:
        j = min(i + _BLOCK, limit)
        if a[i:j] != b[i:j]:
            lo, hi = i, j  # a[:lo] == b[:lo]; they differ before hi
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if a[lo:mid] == b[lo:mid]:
                    lo = mid
                else:
                    hi = mid
            return lo
        i = j
    return limit


def _suffix(a: str, b: str, limit: int) -> int:
    """Length of the common end of a and b, at most `limit`."""
    na, nb = len(a), len(b)
    i = 0
    while i < limit:
        j = min(i + _BLOCK, limit)
        if a[na - j : na - i] != b[nb - j : nb - i]:
            lo, hi = i, j
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if a[na - mid : na - lo] == b[nb - mid : nb - lo]:
                    lo = mid
                else:
                    hi = mid
            return lo
        i = j
    return limit


def diff(ref: str, text: str) -> Delta:
    """`text` as `ref`'s first `head` and last `tail` characters with `middle` between them."""
    limit = min(len(ref), len(text))
    head = _prefix(ref, text, limit)
    tail = _suffix(ref, text, limit - head)
    return Delta(head, tail, text[head : len(text) - tail])


def worth_it(delta: Delta, text: str) -> bool:
    saved = delta.head + delta.tail
    return saved >= MIN_SAVING and 2 * saved >= len(text)


def apply(ref: str, head: int, tail: int, middle: str) -> str:
    """The request `diff` described (the inverse of `diff`)."""
    return ref[:head] + middle + (ref[len(ref) - tail :] if tail else "")


class Memo:
    """Recent turns' full requests by turn id, bounded by total characters (least recently used
    out first). The writer keeps them to diff the next request against; a reader keeps those it
    resolved, since a turn's reference is nearly always a recent turn."""

    def __init__(self, max_chars: int):
        self.max_chars = max_chars
        self.size = 0
        self.items: OrderedDict[str, str] = OrderedDict()

    def get(self, turn_id: str | None) -> str | None:
        if turn_id is None:
            return None
        text = self.items.get(turn_id)
        if text is not None:
            self.items.move_to_end(turn_id)
        return text

    def put(self, turn_id: str, text: str) -> None:
        if self.max_chars <= 0 or len(text) > self.max_chars or turn_id in self.items:
            return
        self.items[turn_id] = text
        self.size += len(text)
        while self.size > self.max_chars:
            _, old = self.items.popitem(last=False)
            self.size -= len(old)
