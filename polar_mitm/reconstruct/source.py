"""Where reconstruction reads its turns: the store, filtered as the command line asks.

`read_selected` wraps `store.db.read_turns` with the filters the store does not apply (side calls,
aborted turns) and counts what it leaves out. The small queries here (sessions in order, how many
turns, rewards) only read the store's tables; writing them is the store's business, except the
outcome reward, which `set_reward` writes with plain sqlite3 for the offline `reward` command.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from polar_mitm.reconstruct.stats import ReconstructStats
from polar_mitm.store.db import StoredTurn, connect, read_turns, turn_filter


@dataclass(frozen=True)
class Selection:
    """Which turns a command works on."""

    session: str | None = None
    task: str | None = None
    since: float | None = None  # unix seconds; turns created at or after
    include_side_calls: bool = False  # turns with a tag (title generation, routers, …)
    include_aborted: bool = False  # turns whose status is not 'ok' (aborted, error)
    rollout: str | None = None  # only the sessions (samples) of this rollout

    def keeps(self, turn: StoredTurn) -> bool:
        return (self.include_side_calls or turn.tag is None) and (self.include_aborted or turn.status == "ok")


def parse_since(value: str) -> float:
    """Unix seconds, or an ISO 8601 date / date-time (local time unless it carries an offset)."""
    try:
        return float(value)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(value.strip()).timestamp()
    except ValueError:
        raise ValueError(
            f"{value!r} is neither unix seconds nor an ISO date/time (e.g. 2025-06-01 or 2025-06-01T14:30:00Z)"
        ) from None


def _where(sel: Selection, session: str | None = None) -> tuple[str, list[object]]:
    # The store's own filter, so counts match what read_turns yields.
    where, args = turn_filter(
        session=session or sel.session, task=sel.task, since=sel.since, rollout=sel.rollout
    )
    return " WHERE " + " AND ".join(where), args


def session_ids(path: str | Path, sel: Selection) -> list[str]:
    """Sessions with turns in the selection, in the order of their first turn."""
    where, args = _where(sel)
    db = connect(path)
    try:
        rows = db.execute(
            "SELECT t.session_id FROM turns t JOIN sessions s ON s.id = t.session_id"
            f"{where} GROUP BY t.session_id ORDER BY MIN(t.seq)",
            args,
        ).fetchall()
    finally:
        db.close()
    return [r[0] for r in rows]


def count_turns(path: str | Path, sel: Selection) -> int:
    """How many turns `read_selected` will read (before the side-call / status filters)."""
    where, args = _where(sel)
    db = connect(path)
    try:
        return db.execute(
            f"SELECT COUNT(*) FROM turns t JOIN sessions s ON s.id = t.session_id{where}", args
        ).fetchone()[0]
    finally:
        db.close()


def session_rewards(path: str | Path) -> dict[str, float | None]:
    """Every session's outcome reward (None where none was attached)."""
    db = connect(path)
    try:
        return dict(db.execute("SELECT id, reward FROM sessions").fetchall())
    finally:
        db.close()


def session_of_turn(path: str | Path, turn_id: str) -> str | None:
    db = connect(path)
    try:
        row = db.execute("SELECT session_id FROM turns WHERE id = ?", (turn_id,)).fetchone()
        if row is None:
            row = db.execute("SELECT id FROM sessions WHERE id = ?", (turn_id,)).fetchone()
        return row[0] if row else None
    finally:
        db.close()


def set_reward(path: str | Path, session: str, value: float | None) -> None:
    """Attach (or with None, clear) a session's outcome reward. KeyError if there is no such session."""
    db = connect(path)
    try:
        with db:
            cur = db.execute("UPDATE sessions SET reward = ? WHERE id = ?", (value, session))
        if cur.rowcount == 0:
            known = [r[0] for r in db.execute("SELECT id FROM sessions ORDER BY created_at DESC LIMIT 5")]
            raise KeyError(f"no session {session!r} in {path} (most recent: {', '.join(known) or 'none'})")
    finally:
        db.close()


def read_selected(
    path: str | Path,
    sel: Selection,
    *,
    session: str | None = None,
    stats: ReconstructStats | None = None,
    on_turn: Callable[[], object] | None = None,
) -> Iterator[StoredTurn]:
    """The selected turns in creation order (of one session if `session` is given)."""
    for turn in read_turns(
        path, session=session or sel.session, task=sel.task, since=sel.since, rollout=sel.rollout
    ):
        if on_turn is not None:
            on_turn()
        if stats is not None:
            stats.turns_read += 1
        if not sel.keeps(turn):
            if stats is not None:
                if turn.tag is not None and not sel.include_side_calls:
                    stats.side_calls_excluded += 1
                else:
                    stats.not_ok_excluded += 1
            continue
        if stats is not None:
            stats.turns += 1
            stats.sessions.add(turn.session_id)
            stats.per_request_tokens += len(turn.prompt_ids) + len(turn.output_ids)
            stats.sampled_tokens += len(turn.output_ids)
        yield turn
