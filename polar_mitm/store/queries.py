"""The questions the other packages ask the store, answered here so that every query over
`turns` and `sessions` lives in `polar_mitm.store`.

Reconstruction asks which sessions a selection covers, how many turns it reads, the rewards and
the text of turns (the SFT export); the runtime asks how many turns and tokens a session made;
the `reward` command sets a session's reward. Token ids are read by `reader.read_turns`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
from pydantic import BaseModel

from polar_mitm.store.connection import connect
from polar_mitm.store.reader import turn_filter
from polar_mitm.store.requests import RequestReader
from polar_mitm.store.turn import Turn


def _where(*, with_text: bool = False, **filters: Any) -> tuple[str, list[object]]:
    """A WHERE clause over `turns t JOIN sessions s`: `reader.turn_filter`'s (the one `read_turns`
    applies, so counts match what it reads); `with_text` keeps turns with a request and reply."""
    where, args = turn_filter(**filters)
    if with_text:
        where = ["(t.request IS NOT NULL OR t.request_ref IS NOT NULL)", "t.response IS NOT NULL", *where]
    return (" WHERE " + " AND ".join(where) if where else ""), args


_FROM = " FROM turns t JOIN sessions s ON s.id = t.session_id"


def session_ids(
    path: str | Path,
    *,
    session: str | None = None,
    task: str | None = None,
    since: float | None = None,
    rollout: str | None = None,
    tokens: bool | None = True,
    with_text: bool = False,
) -> list[str]:
    """Sessions with turns that pass the filter (as `read_turns`' and `text_turns`'), in the order
    of their first turn."""
    where, args = _where(
        session=session, task=task, since=since, rollout=rollout, tokens=tokens, with_text=with_text
    )
    db = connect(path)
    try:
        rows = db.execute(
            f"SELECT t.session_id{_FROM}{where} GROUP BY t.session_id ORDER BY MIN(t.seq)", args
        )
        return [r[0] for r in rows]
    finally:
        db.close()


def sessions_of_harness(path: str | Path, harness: str) -> set[str]:
    """The sessions recorded with `harness`'s recipe."""
    db = connect(path)
    try:
        return {r[0] for r in db.execute("SELECT id FROM sessions WHERE harness = ?", (harness,))}
    finally:
        db.close()


def count_turns(
    path: str | Path,
    *,
    session: str | None = None,
    task: str | None = None,
    since: float | None = None,
    rollout: str | None = None,
) -> int:
    """How many turns `read_turns` reads with the same filter."""
    where, args = _where(session=session, task=task, since=since, rollout=rollout, tokens=True)
    db = connect(path)
    try:
        return db.execute(f"SELECT COUNT(*){_FROM}{where}", args).fetchone()[0]
    finally:
        db.close()


def tool_calls(path: str | Path, turn_ids: list[str]) -> dict[str, list[tuple[str, str]]]:
    """The (id, name) of the tool calls each of these turns made, read from its stored
    completion; turns that made none are left out. Asked only for the few sessions that hold
    several conversations, so it reads replies, never prompts."""
    out: dict[str, list[tuple[str, str]]] = {}
    db = connect(path)
    try:
        for start in range(0, len(turn_ids), 500):
            chunk = turn_ids[start : start + 500]
            marks = ",".join("?" * len(chunk))
            for turn_id, response in db.execute(
                f"SELECT id, response FROM turns WHERE id IN ({marks}) AND response LIKE '%\"tool_calls\"%'",
                chunk,
            ):
                calls = _calls_of(response)
                if calls:
                    out[turn_id] = calls
    finally:
        db.close()
    return out


def _calls_of(response: str | None) -> list[tuple[str, str]]:
    """The (id, name) of the tool calls in a stored completion (a turn's `response`: the
    neutral Completion as JSON)."""
    try:
        data = orjson.loads(response or "null")
    except orjson.JSONDecodeError:
        return []
    calls = data.get("tool_calls") if isinstance(data, dict) else None
    if not isinstance(calls, list):
        return []
    return [
        (str(c.get("id") or ""), c["name"])
        for c in calls
        if isinstance(c, dict) and isinstance(c.get("name"), str)
    ]


def tool_parse_failed_sessions(path: str | Path) -> set[str]:
    """Sessions with a turn whose tool-call blocks did not all parse (`turns.tool_parse`)."""
    db = connect(path)
    try:
        rows = db.execute("SELECT DISTINCT session_id FROM turns WHERE tool_parse LIKE '%\"kind\"%'")
        return {r[0] for r in rows}
    finally:
        db.close()


class ToolParseRate(BaseModel):
    """How the tool parser fared on one harness's turns: turns it read, turns with a block that
    failed, and the failed blocks by kind."""

    harness: str | None
    parser: str
    turns: int = 0
    failed_turns: int = 0
    failures: dict[str, int] = {}


def tool_parse_rates(
    path: str | Path,
    *,
    session: str | None = None,
    task: str | None = None,
    since: float | None = None,
    rollout: str | None = None,
) -> list[ToolParseRate]:
    """Per harness and tool parser, over the turns a selection reads that a tool parser read."""
    where, args = _where(session=session, task=task, since=since, rollout=rollout)
    where = (where + " AND " if where else " WHERE ") + "t.tool_parse IS NOT NULL"
    out: dict[tuple[str | None, str], ToolParseRate] = {}
    db = connect(path)
    try:
        for harness, text in db.execute(f"SELECT s.harness, t.tool_parse{_FROM}{where}", args):
            try:
                status = orjson.loads(text)
            except orjson.JSONDecodeError:
                continue
            parser = str(status.get("parser"))
            rate = out.setdefault((harness, parser), ToolParseRate(harness=harness, parser=parser))
            rate.turns += 1
            failures = status.get("failures") or []
            if failures:
                rate.failed_turns += 1
            for f in failures:
                kind = str(f.get("kind"))
                rate.failures[kind] = rate.failures.get(kind, 0) + 1
    finally:
        db.close()
    return sorted(out.values(), key=lambda r: (r.harness or "", r.parser))


def session_rewards(path: str | Path) -> dict[str, float | None]:
    """Every session's outcome reward (None where none was attached)."""
    db = connect(path)
    try:
        return dict(db.execute("SELECT id, reward FROM sessions").fetchall())
    finally:
        db.close()


def session_of_turn(path: str | Path, turn_id: str) -> str | None:
    """The session of a turn (or `turn_id` itself when it names a session), None if neither."""
    db = connect(path)
    try:
        row = db.execute("SELECT session_id FROM turns WHERE id = ?", (turn_id,)).fetchone()
        if row is None:
            row = db.execute("SELECT id FROM sessions WHERE id = ?", (turn_id,)).fetchone()
        return row[0] if row else None
    finally:
        db.close()


def session_summary(path: str | Path, session_id: str) -> tuple[int, int, int]:
    """(turns, prompt tokens, sampled tokens) of one session."""
    db = connect(path)
    try:
        return db.execute(
            "SELECT COUNT(*), COALESCE(SUM(prompt_len), 0), COALESCE(SUM(output_len), 0) FROM turns"
            " WHERE session_id = ?",
            (session_id,),
        ).fetchone()
    finally:
        db.close()


def has_session(path: str | Path, session: str) -> bool:
    db = connect(path)
    try:
        return db.execute("SELECT 1 FROM sessions WHERE id = ?", (session,)).fetchone() is not None
    finally:
        db.close()


def no_session(path: str | Path, session: str) -> KeyError:
    """The error for a session the store does not have, naming the most recent ones."""
    db = connect(path)
    try:
        known = [r[0] for r in db.execute("SELECT id FROM sessions ORDER BY created_at DESC LIMIT 5")]
    finally:
        db.close()
    return KeyError(f"no session {session!r} in {path} (most recent: {', '.join(known) or 'none'})")


def set_reward(path: str | Path, session: str, value: float | None) -> None:
    """Attach (or with None, clear) a session's outcome reward. KeyError if there is no such session."""
    db = connect(path, write=True)
    try:
        with db:
            changed = db.execute("UPDATE sessions SET reward = ? WHERE id = ?", (value, session)).rowcount
    finally:
        db.close()
    if changed == 0:
        raise no_session(path, session)


# Columns of a text read, and the Turn fields they fill (token ids stay empty).
_TEXT_COLUMNS = (
    "t.id, t.session_id, t.seq, t.created_at, t.style, t.path, t.model, t.tag, t.status, t.finish_reason,"
    " t.request, t.response, (t.prompt_len = 0 AND t.output_len = 0), s.task_id, s.reward,"
    " t.request_ref, t.request_head, t.request_tail, t.request_delta, t.request_zstd, t.request_dict"
)
_TEXT_FIELDS = (
    *("id", "session_id", "seq", "created_at", "style", "path", "model", "tag", "status", "finish_reason"),
    *("request", "response", "text_only", "task_id", "reward"),
)


def _text_turn(row: tuple, requests: RequestReader) -> Turn:
    n = len(_TEXT_FIELDS)
    fields: dict[str, Any] = dict(zip(_TEXT_FIELDS, row[:n], strict=True))
    fields["request"] = requests.text(fields["id"], fields["request"], *row[n:])
    fields["text_only"] = bool(fields["text_only"])
    no_ids: dict[str, Any] = {"prompt_ids": [], "output_ids": [], "output_logprobs": [], "prompt_ref_len": 0}
    return Turn.model_construct(**fields, **no_ids, prompt_ref=None, weight_version=None)


def text_turns(
    path: str | Path,
    session: str,
    *,
    task: str | None = None,
    since: float | None = None,
    text_only: bool = False,
    newest_first: bool = False,
) -> Iterator[Turn]:
    """A session's turns that kept their request and reply, as text (token ids left empty): every
    such turn, or with `text_only` only those without token ids (harvested exchanges)."""
    where, args = _where(
        session=session, task=task, since=since, tokens=False if text_only else None, with_text=True
    )
    db = connect(path)
    try:
        order = " ORDER BY t.seq DESC" if newest_first else " ORDER BY t.seq"
        requests = RequestReader(db)
        for row in db.execute(f"SELECT {_TEXT_COLUMNS}{_FROM}{where}{order}", args):
            yield _text_turn(row, requests)
    finally:
        db.close()


def text_turns_by_id(path: str | Path, ids: list[str]) -> Iterator[Turn]:
    """The named turns, as `text_turns` reads them, in the order named."""
    db = connect(path)
    requests = RequestReader(db)
    try:
        for turn_id in ids:
            row = db.execute(f"SELECT {_TEXT_COLUMNS}{_FROM} WHERE t.id = ?", (turn_id,)).fetchone()
            if row is None:
                raise KeyError(f"turn {turn_id} vanished from {path}")
            yield _text_turn(row, requests)
    finally:
        db.close()


# ---- the viewer (`polar-mitm view`) ------------------------------------------------------------


class SessionListing(BaseModel):
    """One line of the viewer's sessions list: a session, what it made, how it ended."""

    id: str
    task_id: str | None
    harness: str | None
    mode: str
    created_at: float
    ended_at: float | None
    exit_code: int | None
    reward: float | None
    metadata: str
    turns: int
    prompt_tokens: int  # summed over turns: what per-request rows would hold, with output_tokens
    output_tokens: int
    last_turn_at: float | None
    sample_status: str | None  # the newest attempt's status when the session is a rollout sample

    @property
    def status(self) -> str:
        """One word a user filters on: the sample's status, else running / ok / failed."""
        if self.sample_status:
            return self.sample_status
        if self.ended_at is None and self.exit_code is None:
            return "running"
        return "ok" if self.exit_code in (0, None) else "failed"


def list_sessions(
    path: str | Path,
    *,
    task: str | None = None,
    since: float | None = None,
    harness: str | None = None,
    search: str | None = None,
    limit: int = 200,
    offset: int = 0,
) -> list[SessionListing]:
    """Sessions newest first with their turn and token counts; `search` matches a part of the id
    (or of the task id). The status filter is the caller's (`SessionListing.status` is derived)."""
    where: list[str] = []
    args: list[object] = []
    if task:
        where.append("s.task_id = ?")
        args.append(task)
    if since is not None:
        where.append("s.created_at >= ?")
        args.append(since)
    if harness:
        where.append("s.harness = ?")
        args.append(harness)
    if search:
        where.append("(instr(s.id, ?) > 0 OR instr(COALESCE(s.task_id, ''), ?) > 0)")
        args += [search, search]
    # The page of sessions first, then the turns of just those (the (session_id, seq) index):
    # aggregating every turn of the store to show 200 sessions would read all of it.
    sql = (
        "SELECT s.id, s.task_id, s.harness, s.mode, s.created_at, s.ended_at, s.exit_code, s.reward, s.metadata,"
        " (SELECT sa.status FROM samples sa WHERE sa.session_id = s.id ORDER BY sa.attempt DESC LIMIT 1)"
        " FROM sessions s"
        + (" WHERE " + " AND ".join(where) if where else "")
        + " ORDER BY s.created_at DESC, s.id LIMIT ? OFFSET ?"
    )
    db = connect(path)
    try:
        rows = db.execute(sql, [*args, limit, offset]).fetchall()
        counts: dict[str, tuple] = {}
        ids = [r[0] for r in rows]
        for start in range(0, len(ids), 500):
            chunk = ids[start : start + 500]
            marks = ",".join("?" * len(chunk))
            for sid, *agg in db.execute(
                "SELECT session_id, COUNT(*), COALESCE(SUM(prompt_len), 0), COALESCE(SUM(output_len), 0),"
                f" MAX(created_at) FROM turns WHERE session_id IN ({marks}) GROUP BY session_id",
                chunk,
            ):
                counts[sid] = tuple(agg)
    finally:
        db.close()
    return [
        SessionListing.model_construct(
            id=r[0],
            task_id=r[1],
            harness=r[2],
            mode=r[3],
            created_at=r[4],
            ended_at=r[5],
            exit_code=r[6],
            reward=r[7],
            metadata=r[8],
            sample_status=r[9],
            **dict(
                zip(
                    ("turns", "prompt_tokens", "output_tokens", "last_turn_at"),
                    counts.get(r[0], (0, 0, 0, None)),
                    strict=True,
                )
            ),
        )  # fmt: skip
        for r in rows
    ]


def session_facets(path: str | Path) -> dict[str, list[str]]:
    """The distinct task ids and harnesses of the store, for the viewer's filter menus."""
    db = connect(path)
    try:
        tasks = [
            r[0]
            for r in db.execute("SELECT DISTINCT task_id FROM sessions WHERE task_id IS NOT NULL ORDER BY 1")
        ]
        harnesses = [
            r[0]
            for r in db.execute("SELECT DISTINCT harness FROM sessions WHERE harness IS NOT NULL ORDER BY 1")
        ]
    finally:
        db.close()
    return {"task": tasks, "harness": harnesses}


class TurnFacts(BaseModel):
    """What the viewer shows of a turn besides its tokens: where it went, how it ended, timings."""

    id: str
    session_id: str
    seq: int
    created_at: float
    style: str
    host: str | None
    path: str | None
    model: str | None
    tag: str | None
    status: str
    finish_reason: str | None
    prompt_len: int
    output_len: int
    weight_version: str | None
    latency_ms: float | None
    error: str | None
    request_headers: str | None


_FACT_COLUMNS = ", ".join(f"t.{name}" for name in TurnFacts.model_fields)


def turn_facts(
    path: str | Path, *, ids: list[str] | None = None, session: str | None = None
) -> list[TurnFacts]:
    """The named turns' facts (in creation order), or every turn of `session`; no token ids.
    Headers stored as what changed since an earlier turn's come back whole."""
    fields = list(TurnFacts.model_fields)
    out: list[TurnFacts] = []
    db = connect(path)
    requests = RequestReader(db)

    def fact(row: tuple) -> TurnFacts:
        values = dict(zip(fields, row[:-1], strict=True))
        if row[-1] is not None:
            values["request_headers"] = json.dumps(
                requests.headers(values["id"], values["request_headers"], row[-1])
            )
        return TurnFacts.model_construct(**values)

    try:
        if session is not None:
            rows = db.execute(
                f"SELECT {_FACT_COLUMNS}, t.headers_ref FROM turns t WHERE t.session_id = ? ORDER BY t.seq",
                (session,),
            )
            out = [fact(r) for r in rows]
        for start in range(0, len(ids or []), 500):
            chunk = (ids or [])[start : start + 500]
            marks = ",".join("?" * len(chunk))
            rows = db.execute(
                f"SELECT {_FACT_COLUMNS}, t.headers_ref FROM turns t WHERE t.id IN ({marks})", chunk
            )
            out += [fact(r) for r in rows]
    finally:
        db.close()
    return sorted(out, key=lambda f: f.seq)


def session_record(path: str | Path, session: str) -> dict[str, Any] | None:
    """A session's own row (id, task, harness, command, mode, metadata, times, exit code, reward)."""
    db = connect(path)
    try:
        cur = db.execute(
            "SELECT id, task_id, harness, command, mode, metadata, created_at, ended_at, exit_code, reward"
            " FROM sessions WHERE id = ?",
            (session,),
        )
        row = cur.fetchone()
        return dict(zip([d[0] for d in cur.description], row, strict=True)) if row else None
    finally:
        db.close()
