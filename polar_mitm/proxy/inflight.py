"""Request body bytes each session holds in the proxy's memory at once: a budget per session.

A connection cap bounds connections, not bytes: 64 connections of one sandbox, each with a body
just under the request cap, would hold two gigabytes in the proxy. Every place that buffers a
request body whole (mitmproxy's HTTP layer, `proxy/addons/bodies.py`; the gateway, for the
connections it serves itself) takes the body's size from its session's budget before it reads
a byte, and gives it back when the request is done; a body that would pass the budget is refused
with a 413 that names it. One budget, so a session's bytes are counted once whichever way they came.
"""

from __future__ import annotations


class InFlight:
    def __init__(self, per_session: int):
        self.per_session = per_session
        self.held: dict[str, int] = {}  # session -> bytes taken and not yet given back
        self.refused = 0

    def take(self, session: str, size: int) -> bool:
        """Take `size` bytes of `session`'s budget; False, and nothing taken, when it has not that
        much left."""
        held = self.held.get(session, 0)
        if held + size > self.per_session:
            self.refused += 1
            return False
        self.held[session] = held + size
        return True

    def give(self, session: str, size: int) -> None:
        """Give back what `take` took."""
        left = self.held.get(session, 0) - size
        if left > 0:
            self.held[session] = left
        else:
            self.held.pop(session, None)

    def refusal(self, session: str, size: int | None) -> str:
        """Why a body of `size` bytes (None: of a length not declared) was refused."""
        what = f"a request body of {size:,} bytes" if size is not None else "a request body"
        return (
            f"polar-mitm: {what} would pass the {self.per_session:,} bytes session {session} may have "
            f"in the proxy at once ({self.held.get(session, 0):,} held now; "
            "--max-session-bytes-in-flight); send it when the others are done\n"
        )
