"""Raw requests and their headers as the store keeps them, and `RequestReader`, which reads them back."""

from __future__ import annotations

import sqlite3

from polar_mitm.store import deltas


class RequestReader:
    """Raw requests as they arrived, from what the store holds: the whole text, or a reference to
    an earlier turn's request and what differs (`deltas`). Remembers what it resolved (bounded),
    so reading turns in order costs one pass over the stored text."""

    def __init__(self, db: sqlite3.Connection, max_chars: int = 16_000_000):
        self.db = db
        self.memo = deltas.Memo(max_chars)

    def text(
        self, turn_id: str, request: str | None, ref: str | None, head: int, tail: int, delta: str | None
    ) -> str | None:
        if ref is not None:
            request = deltas.apply(self._of(ref), head, tail, delta or "")
        if request is not None:
            self.memo.put(turn_id, request)
        return request

    def _of(self, turn_id: str) -> str:
        """The full request of an earlier turn (following its references)."""
        chain: list[tuple[str, int, int, str | None]] = []
        cur: str | None = turn_id
        text: str | None = None
        while cur is not None:
            text = self.memo.get(cur)
            if text is not None:
                break
            row = self.db.execute(
                "SELECT request, request_ref, request_head, request_tail, request_delta FROM turns WHERE id = ?",
                (cur,),
            ).fetchone()
            if row is None:
                raise KeyError(f"turn {cur} holds a request others refer to, but is missing")
            request, ref, head, tail, delta = row
            if ref is None:
                text = request or ""
                self.memo.put(cur, text)
                break
            chain.append((cur, head, tail, delta))
            cur = ref
        assert text is not None
        for tid, head, tail, delta in reversed(chain):
            text = deltas.apply(text, head, tail, delta or "")
            self.memo.put(tid, text)
        return text
