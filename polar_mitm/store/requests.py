"""Raw requests and their headers as the store keeps them, and `RequestReader`, which reads them back.

A request's stored text (the whole request, or the part that differs from its reference, see
`deltas`) is a zstd frame when that is smaller (m006: `request_zstd`), compressed with the
session's dictionary: the full text of one earlier request of the session (`request_dict`, its
turn), used as zstd raw content. A session's requests repeat its system prompt, tools and
earlier messages, so what is new in each compresses against them; the first request itself is
compressed without one. Headers are stored as what changed since the session's previous turn
(`headers_ref`): the keys whose value is new or changed, and removed ones as null.

Pure encoding functions here, and the reader; `writer.Store` picks the dictionary and writes.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from collections import OrderedDict
from typing import cast

from polar_mitm.store import deltas

if sys.version_info >= (3, 14):
    from compression import zstd
else:  # the same module, backported (a dependency of mitmproxy's too)
    from backports import zstd

# zstd's default level: a few tens of µs for a turn's delta against a digested dictionary.
LEVEL = 3
# Texts shorter than this stay plain: a frame's own header costs more than it could save.
MIN_COMPRESS = 64
# A session's headers are stored whole every this many turns, so a reader's chain stays short.
HEADER_CHAIN = 64


def _bytes(text: str) -> bytes:
    # surrogatepass: any Python string round-trips, even one with a lone surrogate.
    return text.encode("utf-8", "surrogatepass")


def dictionary(text: str) -> zstd.ZstdDict:
    """A zstd dictionary whose raw content is `text` (a session's request)."""
    return zstd.ZstdDict(_bytes(text), is_raw=True)


def warm(zdict: zstd.ZstdDict) -> None:
    """Digest `zdict` for `LEVEL` now (zstd keeps the digest in it), so the next turn's
    compression does not: the writer runs this in its thread between a session's turns."""
    zstd.compress(b"\0", LEVEL, zstd_dict=zdict.as_digested_dict)


def compress(text: str, zdict: zstd.ZstdDict | None) -> bytes | None:
    """`text` as a zstd frame (against `zdict` when given), or None when that is not smaller."""
    raw = _bytes(text)
    if len(raw) < MIN_COMPRESS:
        return None
    frame = zstd.compress(raw, LEVEL, zstd_dict=zdict.as_digested_dict if zdict is not None else None)
    return frame if len(frame) < len(raw) else None


def decompress(frame: bytes, zdict: zstd.ZstdDict | None) -> str:
    # Undigested: the decompressor references the raw content (~25 µs a frame against a 50 kB
    # dictionary), where a digested one is rebuilt for every frame (~10× that).
    return zstd.decompress(frame, zstd_dict=zdict.as_undigested_dict if zdict is not None else None).decode(
        "utf-8", "surrogatepass"
    )


def headers_diff(base: dict[str, str], headers: dict[str, str]) -> dict[str, str | None] | None:
    """`headers` as what changed from `base` (removed keys as None), or None when that would not
    read back as the same dict in the same order (then they are stored whole)."""
    changed: dict[str, str | None] = {k: v for k, v in headers.items() if base.get(k) != v}
    changed.update({k: None for k in base if k not in headers})
    if apply_headers(base, changed) != headers or list(apply_headers(base, changed)) != list(headers):
        return None
    return changed


def apply_headers(base: dict[str, str], changed: dict[str, str | None]) -> dict[str, str]:
    """The headers `headers_diff` described (its inverse)."""
    out = dict(base)
    for k, v in changed.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


class RequestReader:
    """Raw requests (and headers) as they arrived, from what the store holds: the whole text, or
    a reference to an earlier turn's request and what differs (`deltas`), either of them plain or
    a zstd frame. Remembers what it resolved (bounded), so reading turns in order costs one pass
    over the stored text."""

    def __init__(self, db: sqlite3.Connection, max_chars: int = 16_000_000):
        self.db = db
        self.memo = deltas.Memo(max_chars)
        self._dicts: OrderedDict[str, zstd.ZstdDict] = OrderedDict()
        self._headers: OrderedDict[str, dict[str, str]] = OrderedDict()

    def text(
        self,
        turn_id: str,
        request: str | bytes | None,
        ref: str | None,
        head: int,
        tail: int,
        delta: str | bytes | None,
        zstd_frame: int = 0,
        dict_ref: str | None = None,
    ) -> str | None:
        """The request of `turn_id` from its stored columns (request, request_ref, request_head,
        request_tail, request_delta, request_zstd, request_dict, in that order)."""
        if zstd_frame:
            zdict = self._dict(dict_ref)
            if ref is not None:
                delta = decompress(delta, zdict) if isinstance(delta, bytes) else delta
            elif isinstance(request, bytes):
                request = decompress(request, zdict)
        if ref is not None:
            # A compressed delta was decompressed above; an uncompressed one is stored as text.
            request = deltas.apply(self._of(ref), head, tail, cast(str | None, delta) or "")
        elif isinstance(request, bytes):  # the text a zstd frame held, decompressed above
            request = cast(str, request)
        if request is not None:
            self.memo.put(turn_id, request)
        return request

    def request(self, turn_id: str) -> str | None:
        """The request of one turn, by id."""
        row = self.db.execute(f"SELECT {COLUMNS} FROM turns WHERE id = ?", (turn_id,)).fetchone()
        if row is None:
            raise KeyError(f"no turn {turn_id}")
        return self.text(turn_id, *row)

    def stored_text(self, turn_id: str) -> str:
        """What the row itself holds of its request, as text: the whole request, or (with a
        reference) only the part that differs from it; decompressed where it is a zstd frame."""
        row = self.db.execute(
            "SELECT request, request_delta, request_zstd, request_dict FROM turns WHERE id = ?", (turn_id,)
        ).fetchone()
        if row is None:
            raise KeyError(f"no turn {turn_id}")
        value = row[0] if row[0] is not None else row[1]
        if isinstance(value, bytes) and row[2]:
            return decompress(value, self._dict(row[3]))
        return value or ""

    def _dict(self, turn_id: str | None) -> zstd.ZstdDict | None:
        if turn_id is None:
            return None
        zdict = self._dicts.get(turn_id)
        if zdict is None:
            zdict = self._dicts[turn_id] = dictionary(self._of(turn_id))
            if len(self._dicts) > 64:
                self._dicts.popitem(last=False)
        return zdict

    def _of(self, turn_id: str) -> str:
        """The full request of an earlier turn (following its references)."""
        chain: list[tuple[str, tuple]] = []
        cur: str | None = turn_id
        text: str | None = None
        while cur is not None:
            text = self.memo.get(cur)
            if text is not None:
                break
            row = self.db.execute(f"SELECT {COLUMNS} FROM turns WHERE id = ?", (cur,)).fetchone()
            if row is None:
                raise KeyError(f"turn {cur} holds a request others refer to, but is missing")
            if row[1] is None:  # stored whole
                text = self.text(cur, *row) or ""
                self.memo.put(cur, text)
                break
            chain.append((cur, row))
            cur = row[1]
        assert text is not None
        for tid, row in reversed(chain):
            text = self.text(tid, *row)
            assert text is not None
        return text

    def headers(self, turn_id: str, stored: str | None = None, ref: str | None = None) -> dict[str, str]:
        """The request headers of `turn_id`; from its stored columns (request_headers,
        headers_ref) when given, else read."""
        known = self._headers.get(turn_id)
        if known is not None:
            return dict(known)
        if stored is None and ref is None:
            row = self.db.execute(
                "SELECT request_headers, headers_ref FROM turns WHERE id = ?", (turn_id,)
            ).fetchone()
            if row is None:
                raise KeyError(f"no turn {turn_id}")
            stored, ref = row
        value = json.loads(stored) if stored else {}
        if ref is not None:
            value = apply_headers(self.headers(ref), value)
        self._headers[turn_id] = value
        if len(self._headers) > 4096:
            self._headers.popitem(last=False)
        return dict(value)


# The stored columns of a request, in `RequestReader.text`'s order (after the turn id).
COLUMNS = "request, request_ref, request_head, request_tail, request_delta, request_zstd, request_dict"
