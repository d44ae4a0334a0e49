"""SQLite store of sessions and turns.

`Store` is the async writer the proxy uses (WAL; its connection lives in a thread of its own).
`read_turns` is the synchronous reader the offline reconstructor uses; `connect` opens the file
for it (see there for when migrations run); `queries` holds the smaller questions the other
packages ask. A turn's prompt is stored as a reference to an earlier turn's full sequence
(prompt + output) plus its own new suffix, so a long session costs its unique tokens, not turns ×
context; its raw request likewise as what differs from an earlier turn's request (`deltas`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import time
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, Field

from polar_mitm import redact
from polar_mitm.retry import Backoff
from polar_mitm.store import deltas
from polar_mitm.store.migrations import migrate, pending
from polar_mitm.store.packing import (
    pack_ids,
    pack_logprobs,
    unpack_ids,
    unpack_ids_array,
    unpack_logprobs,
    unpack_logprobs_array,
)


class Turn(BaseModel):
    """One row of `turns`: a generation (or a harvested exchange) as the proxy saw it.

    Writers (the policy, harvest) build it and `Store.insert_turn` stores it; readers
    (`read_turns`, `queries`) build it back, its prompt resolved through its reference. The one
    row model of the table: what is written is what is read. A reader fills the columns it reads
    (`read_turns`: the token ids and what reconstruction needs, the raw request with `with_raw`);
    the others keep their defaults.
    """

    id: str
    session_id: str
    seq: int = 0  # its place among all turns: given by SQLite on insert, filled by readers
    created_at: float = Field(default_factory=time.time)
    style: str
    host: str | None = None
    path: str | None = None
    model: str | None = None
    tag: str | None = None
    status: str = "ok"
    finish_reason: str | None = None
    prompt_ids: list[int] = Field(default_factory=list)
    prompt_ref: str | None = None
    prompt_ref_len: int = 0
    output_ids: list[int] = Field(default_factory=list)
    output_logprobs: list[float] = Field(default_factory=list)
    weight_version: str | None = None
    msg_hash: str | None = None
    post_hash: str | None = None
    request: str | None = None
    request_headers: dict[str, str] = Field(default_factory=dict)
    response: str | None = None
    error: str | None = None
    latency_ms: float | None = None
    # Filled by readers from the turn's session (never written with the turn): its task, its
    # reward, and whether the turn has no token ids at all (a harvested exchange).
    task_id: str | None = None
    reward: float | None = None
    text_only: bool = False


def _connect_sync(path: str | Path, **kw: Any) -> sqlite3.Connection:
    db = sqlite3.connect(str(path), **kw)
    # Switching a new file to WAL takes an exclusive lock without waiting for it: processes that
    # open a new file together (a proxy's workers, nodes) retry while another one switches it.
    try:
        Backoff(
            f"switching {path} to WAL",
            attempts=100,
            first=0.05,
            factor=1.0,
            retry_on=(sqlite3.OperationalError,),
            when=lambda e: "locked" in str(e),
            level=logging.DEBUG,
        ).call(lambda: db.execute("PRAGMA journal_mode=WAL"))
    except sqlite3.OperationalError:
        db.close()
        raise
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("PRAGMA foreign_keys=ON")
    return db


def init_db(path: str | Path) -> None:
    """Create the database if needed (mode 0600) and bring its schema up to date."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        # Private from its first byte: it holds every prompt and reply. SQLite gives the -wal and
        # -shm files the database's own mode; an existing file keeps the mode its owner chose.
        Path(path).touch(mode=0o600, exist_ok=False)
    except FileExistsError:
        pass
    db = _connect_sync(path)
    try:
        migrate(db)
    finally:
        db.close()


class _SequenceCache:
    """Full sequences (prompt + output) of recent turns, bounded by total tokens.

    `compact` keeps them as int32 arrays (4 B a token instead of ~36 B for a list of Python ints),
    for the long-lived proxy; the offline reader keeps lists, which it slices on every turn. A
    compact cache keeps its newest sequences (up to `hot_tokens`) as the lists they came as, since
    the next turn of a conversation asks for them again: converting 30k ids to an array and back
    every turn cost more than the rest of the store's work. Callers must not change what they get.

    A compact cache also keeps a turn whose whole sequence begins the next turn's (`put`'s
    `parent`: the usual turn of a growing conversation) as a view, the next turn's id and a
    length, instead of as a sequence of its own: a conversation then holds one sequence, not one
    per turn, and the hot tier holds conversations rather than turns. A view is read back as a
    slice of what it points to, for the rare request that goes back to an earlier turn.
    """

    MAX_VIEWS = 1_000_000

    def __init__(self, max_tokens: int = 8_000_000, *, compact: bool = False, hot_tokens: int = 1_000_000):
        self.max_tokens = max_tokens
        self.compact = compact
        self.size = 0
        self.items: OrderedDict[str, tuple[list[int] | array, int]] = OrderedDict()
        self.hot_tokens = hot_tokens if compact else 0
        self.hot_size = 0
        self.hot: OrderedDict[str, tuple[list[int], int]] = OrderedDict()
        # turn id -> (id of the turn whose sequence begins with this one's, its length, prompt length)
        self.views: OrderedDict[str, tuple[str, int, int]] = OrderedDict()

    def get(self, turn_id: str) -> tuple[list[int], int] | None:
        warm = self.hot.get(turn_id)
        if warm is not None:
            return warm
        hit = self.items.get(turn_id)
        if hit is not None:
            self.items.move_to_end(turn_id)
            seq, prompt_len = hit
            return (seq.tolist() if isinstance(seq, array) else seq), prompt_len
        view = self.views.get(turn_id)
        if view is None:
            return None
        child_id, length, prompt_len = view
        child = self.get(child_id)
        if child is None or len(child[0]) < length:  # what it pointed to is gone
            del self.views[turn_id]
            return None
        return child[0][:length], prompt_len

    def clear(self) -> None:
        self.items.clear()
        self.hot.clear()
        self.views.clear()
        self.size = self.hot_size = 0

    def put(
        self, turn_id: str, seq: list[int], prompt_len: int, parent: tuple[str, int] | None = None
    ) -> None:
        """Keep `seq`; with `parent` (a turn, and how many of its ids begin `seq`), that turn
        becomes a view of this one when all of its sequence is `seq`'s beginning."""
        if turn_id in self.items or turn_id in self.hot or turn_id in self.views:
            return
        if self.hot_tokens:
            if parent is not None:
                self._fold(parent[0], parent[1], turn_id, seq)
            self.hot[turn_id] = (seq, prompt_len)
            self.hot_size += len(seq)
            while self.hot_size > self.hot_tokens and len(self.hot) > 1:
                old_id, (old, old_len) = self.hot.popitem(last=False)
                self.hot_size -= len(old)
                self._keep(old_id, old, old_len)
            return
        self._keep(turn_id, seq, prompt_len)

    def _fold(self, parent: str, spliced: int, child: str, seq: list[int]) -> None:
        held = self.hot.get(parent)
        if held is None:
            return
        old, old_len = held
        n = len(old)
        # All of the parent's sequence must begin the child's: the prompt was spliced from all of
        # it. Its first and last ids are compared too, as a check on what the caller says.
        start = max(n - 16, 0)
        if not n or spliced != n or n > len(seq) or seq[start:n] != old[start:] or seq[0] != old[0]:
            return
        del self.hot[parent]
        self.hot_size -= n
        self.views[parent] = (child, n, old_len)
        if len(self.views) > self.MAX_VIEWS:
            self.views.popitem(last=False)

    def _keep(self, turn_id: str, seq: list[int], prompt_len: int) -> None:
        self.items[turn_id] = (array("i", seq) if self.compact else seq, prompt_len)
        self.size += len(seq)
        while self.size > self.max_tokens and len(self.items) > 1:
            _, (old, _) = self.items.popitem(last=False)
            self.size -= len(old)


Statement = tuple[str, Sequence[Any]]


class Store:
    """Async writer used by the proxy; safe for concurrent turns, and beside other writers (other
    processes) of the same file.

    Its connection lives in one thread of its own; every write (`write`) is one transaction,
    committed there in one trip from the event loop, so a turn costs one thread hop and
    concurrent writes never share a transaction."""

    def __init__(
        self,
        path: str | Path,
        thread: ThreadPoolExecutor,
        conn: sqlite3.Connection,
        *,
        request_memo_chars: int,
    ):
        self.path = str(path)
        self._thread = thread
        self._conn = conn  # used in `_thread` only
        self.cache = _SequenceCache(compact=True)
        self._sessions: set[str] = set()
        # Recent requests, to store the next one of a conversation as what differs (0: whole).
        self.requests = deltas.Memo(request_memo_chars)
        # The newest turn of each (session, tag, path): the reference of a request that does not
        # extend an earlier turn's prompt (side calls, harvested exchanges, a compacted context).
        self._last_request: OrderedDict[tuple[str, str | None, str | None], str] = OrderedDict()
        # The newest completed turn by (session, post_hash) of those this writer stored, so the
        # usual echo of the previous reply is found without a query (bounded, oldest out first).
        self._post_hashes: OrderedDict[tuple[str, str], str] = OrderedDict()

    @classmethod
    async def open(cls, path: str | Path, *, request_memo_chars: int = 32_000_000) -> Store:
        init_db(path)
        thread = ThreadPoolExecutor(1, thread_name_prefix="polar-store")
        # Autocommit: `write` opens and commits its own transactions.
        conn = await asyncio.get_running_loop().run_in_executor(
            thread, lambda: _connect_sync(path, isolation_level=None)
        )
        return cls(path, thread, conn, request_memo_chars=request_memo_chars)

    async def close(self) -> None:
        await self._run(self._conn.close)
        self._thread.shutdown(wait=False)

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def write(self, *statements: Statement) -> None:
        """Run the statements as one transaction; it is committed (durable in the WAL) when this
        returns, or rolled back and the error raised."""
        await self._run(self._write, statements)

    def _write(self, statements: Sequence[Statement]) -> None:
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")  # the write lock first, waiting for other writers
        try:
            for sql, params in statements:
                conn.execute(sql, params)
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    async def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        """The rows of one query."""
        return await self._run(lambda: self._conn.execute(sql, params).fetchall())

    async def ensure_session(
        self,
        session_id: str,
        *,
        task_id: str | None = None,
        harness: str | None = None,
        command: Sequence[str] | None = None,
        secret_flags: Sequence[str] = (),
        mode: str = "policy",
        metadata: dict[str, Any] | None = None,
    ) -> None:
        await self.write(
            (
                "INSERT OR IGNORE INTO sessions (id, task_id, harness, command, mode, metadata, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    session_id,
                    task_id,
                    harness,
                    json.dumps(redact.argv(command, secret_flags)) if command is not None else None,
                    mode,
                    json.dumps(metadata or {}),
                    time.time(),
                ),
            )
        )

    async def end_session(self, session_id: str, exit_code: int | None) -> None:
        await self.write(
            (
                "UPDATE sessions SET ended_at = ?, exit_code = ? WHERE id = ?",
                (time.time(), exit_code, session_id),
            )
        )

    async def insert_turn(self, rec: Turn) -> None:
        """Commit one turn. Returns only once the turn is durable in the WAL.

        Its `seq` is computed by the INSERT itself, under SQLite's write lock, so writers in other
        processes sharing the file never hand out the same one (m004 indexes seq for the MAX)."""
        # Sessions named by proxy credentials appear with their first turn.
        known = rec.session_id in self._sessions
        suffix = rec.prompt_ids[rec.prompt_ref_len :] if rec.prompt_ref else rec.prompt_ids
        key = (rec.session_id, rec.tag, rec.path)
        request_ref, delta = self._request_delta(rec.request, rec.prompt_ref, self._last_request.get(key))
        insert = (
            "INSERT INTO turns (id, session_id, seq, created_at, style, host, path, model, tag, status,"
            " finish_reason, prompt_ref, prompt_ref_len, prompt_suffix, prompt_len, output_ids,"
            " output_logprobs, output_len, weight_version, msg_hash, post_hash, request, request_headers,"
            " response, error, latency_ms, request_ref, request_head, request_tail, request_delta)"
            " VALUES (?,?,(SELECT COALESCE(MAX(seq), 0) + 1 FROM turns),"
            "?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (
                rec.id,
                rec.session_id,
                rec.created_at,
                rec.style,
                rec.host,
                rec.path,
                rec.model,
                rec.tag,
                rec.status,
                rec.finish_reason,
                rec.prompt_ref,
                rec.prompt_ref_len if rec.prompt_ref else 0,
                pack_ids(suffix),
                len(rec.prompt_ids),
                pack_ids(rec.output_ids),
                pack_logprobs(rec.output_logprobs),
                len(rec.output_ids),
                rec.weight_version,
                rec.msg_hash,
                rec.post_hash,
                rec.request if delta is None else None,
                json.dumps(rec.request_headers),
                rec.response,
                rec.error,
                rec.latency_ms,
                request_ref,
                *((0, 0, None) if delta is None else delta),
            ),
        )
        session = (
            "INSERT OR IGNORE INTO sessions (id, created_at) VALUES (?, ?)",
            (rec.session_id, time.time()),
        )
        if known:
            await self.write(insert)
        else:
            await self.write(session, insert)
        self._sessions.add(rec.session_id)
        if rec.status == "ok" and rec.post_hash is not None:
            self._post_hashes[(rec.session_id, rec.post_hash)] = rec.id
            self._post_hashes.move_to_end((rec.session_id, rec.post_hash))
            if len(self._post_hashes) > 262_144:
                self._post_hashes.popitem(last=False)
        if rec.output_ids or rec.prompt_ids:
            # A prompt spliced from all of an earlier turn's sequence makes that turn a view.
            parent = (rec.prompt_ref, rec.prompt_ref_len) if rec.prompt_ref else None
            self.cache.put(rec.id, rec.prompt_ids + rec.output_ids, len(rec.prompt_ids), parent=parent)
        if rec.request:
            self.requests.put(rec.id, rec.request)
            self._last_request[key] = rec.id
            self._last_request.move_to_end(key)
            if len(self._last_request) > 65_536:
                self._last_request.popitem(last=False)

    def _request_delta(self, text: str | None, *refs: str | None) -> tuple[str | None, deltas.Delta | None]:
        """The reference (one of `refs` whose request is still remembered) that `text` differs from
        least, and how; (None, None) to store it whole."""
        best: tuple[str | None, deltas.Delta | None] = (None, None)
        if not text:
            return best
        for ref in dict.fromkeys(refs):
            base = self.requests.get(ref)
            if base is None:
                continue
            d = deltas.diff(base, text)
            if deltas.worth_it(d, text) and (best[1] is None or len(d.middle) < len(best[1].middle)):
                best = (ref, d)
        return best

    async def find_by_post_hash(self, session_id: str, hashes: Sequence[str]) -> tuple[str, str] | None:
        """The newest completed turn of the session whose post_hash is one of `hashes`.

        Returns (turn_id, matched_hash); callers pass hashes longest-prefix first and take the
        first hit in that order.
        """
        if not hashes:
            return None
        known = self._post_hashes.get((session_id, hashes[0]))
        if known is not None:  # the longest prefix, stored by this writer: what the query returns
            return known, hashes[0]
        marks = ",".join("?" * len(hashes))
        rows = await self.query(
            f"SELECT id, post_hash FROM turns WHERE session_id = ? AND status = 'ok'"
            f" AND post_hash IN ({marks}) ORDER BY seq DESC",
            (session_id, *hashes),
        )
        if not rows:
            return None
        by_hash: dict[str, str] = {}
        for turn_id, h in rows:
            by_hash.setdefault(h, turn_id)
        for h in hashes:
            if h in by_hash:
                return by_hash[h], h
        return None

    async def sequence(self, turn_id: str) -> tuple[list[int], int]:
        """A turn's full sequence (prompt + output ids) and its prompt length."""
        hit = self.cache.get(turn_id)
        if hit is not None:
            return hit
        chain: list[tuple[str, str | None, int, bytes, bytes, int]] = []
        cur_id: str | None = turn_id
        base: list[int] = []
        while cur_id is not None:
            cached = self.cache.get(cur_id)
            if cached is not None:
                base = cached[0]
                break
            rows = await self.query(
                "SELECT id, prompt_ref, prompt_ref_len, prompt_suffix, output_ids, prompt_len"
                " FROM turns WHERE id = ?",
                (cur_id,),
            )
            if not rows:
                raise KeyError(f"turn {cur_id} not in store {self.path}")
            row = rows[0]
            chain.append(row)
            cur_id = row[1]
        seq = base
        prompt_len = 0
        for tid, _ref, ref_len, suffix, output, plen in reversed(chain):
            prompt = (seq[:ref_len] if _ref else []) + unpack_ids(suffix)
            prompt_len = plen
            seq = prompt + unpack_ids(output)
            self.cache.put(tid, seq, prompt_len)
        return seq, prompt_len

    async def set_reward(self, session_id: str, value: float | None) -> None:
        await self.write(("UPDATE sessions SET reward = ? WHERE id = ?", (value, session_id)))


# ---- synchronous reading, for the offline tools --------------------------------------------


def connect(path: str | Path, *, write: bool = False) -> sqlite3.Connection:
    """A synchronous connection for the offline tools: a reader unless `write`.

    Migrations run where the database is opened to be written (`Store.open`, `init_db`, and here
    with `write=True`). A reader of a current database writes nothing: it checks which
    migrations are recorded and then refuses writes (`query_only`). Only a database written by an
    older polar-mitm is migrated by its first reader, once, so old stores stay readable.
    """
    if not Path(path).exists():
        raise FileNotFoundError(f"no database at {path}")
    if write:
        db = _connect_sync(path)
        migrate(db)
        return db
    db = sqlite3.connect(str(path))
    db.execute("PRAGMA foreign_keys=ON")
    if pending(db):
        migrate(db)
    db.execute("PRAGMA query_only=ON")
    return db


def turn_filter(
    *,
    session: str | None = None,
    task: str | None = None,
    since: float | None = None,
    tokens: bool | None = True,
    rollout: str | None = None,
) -> tuple[list[str], list[object]]:
    """SQL conditions and their arguments over `turns t JOIN sessions s`, for every reader.

    tokens: True keeps turns with token ids (policy turns), False only text turns (harvested),
    None both.
    """
    where: list[str] = []
    args: list[object] = []
    if session:
        where.append("t.session_id = ?")
        args.append(session)
    if task:
        where.append("s.task_id = ?")
        args.append(task)
    if since is not None:
        where.append("t.created_at >= ?")
        args.append(since)
    if rollout:
        where.append(
            "t.session_id IN (SELECT sa.session_id FROM samples sa JOIN rollout_groups g"
            " ON g.id = sa.group_id WHERE g.rollout_id = ?)"
        )
        args.append(rollout)
    if tokens is True:
        where.append("(t.output_len > 0 OR t.prompt_len > 0)")
    elif tokens is False:
        where.append("t.prompt_len = 0 AND t.output_len = 0")
    return where, args


def read_turns(
    path: str | Path,
    *,
    session: str | None = None,
    task: str | None = None,
    since: float | None = None,
    with_raw: bool = False,
    include_text_only: bool = False,
    rollout: str | None = None,
    arrays: bool = False,
) -> Iterator[Turn]:
    """Turns in creation order, with prompt ids resolved through their references.

    Resolution keeps the full sequences of recent turns in a bounded cache, so it costs about
    one pass over the unique tokens. With `arrays`, `prompt_ids` and `output_ids` are read-only
    int32 numpy arrays and `output_logprobs` a read-only float32 (or, as stored, float64) array
    instead of lists: the same values without a Python object per token, for the exporters.
    """
    db = connect(path)
    cache = _SequenceCache()
    ids_of, logprobs_of = (
        (unpack_ids_array, unpack_logprobs_array) if arrays else (unpack_ids, unpack_logprobs)
    )
    where, args = turn_filter(
        session=session, task=task, since=since, tokens=None if include_text_only else True, rollout=rollout
    )
    raw_cols = (
        ", t.request, t.response, t.request_ref, t.request_head, t.request_tail, t.request_delta"
        if with_raw
        else ", NULL, NULL, NULL, 0, 0, NULL"
    )
    sql = (
        "SELECT t.id, t.session_id, t.seq, t.created_at, t.style, t.model, t.tag, t.status, t.finish_reason,"
        " t.prompt_ref, t.prompt_ref_len, t.prompt_suffix, t.output_ids, t.output_logprobs, t.weight_version,"
        f" s.task_id{raw_cols} FROM turns t JOIN sessions s ON s.id = t.session_id"
        + (" WHERE " + " AND ".join(where) if where else "")
        + " ORDER BY t.seq"
    )
    requests = RequestReader(db)
    try:
        for row in db.execute(sql, args):
            (
                tid,
                sid,
                seq,
                created,
                style,
                model,
                tag,
                status,
                finish,
                ref,
                ref_len,
                suffix,
                out,
                lps,
                wv,
            ) = row[:15]
            prompt = ids_of(suffix)
            if ref:
                base = cache.get(ref)
                if base is None:
                    base = (_resolve_sync(db, ref, cache, arrays=arrays), 0)
                prompt = _join(base[0][:ref_len], prompt)
            output = ids_of(out)
            cache.put(tid, _join(prompt, output), len(prompt))
            # Values come straight from our own schema: skip validation, it dominated export time.
            yield Turn.model_construct(
                id=tid,
                session_id=sid,
                seq=seq,
                created_at=created,
                style=style,
                model=model,
                tag=tag,
                status=status,
                finish_reason=finish,
                prompt_ids=prompt,
                output_ids=output,
                output_logprobs=logprobs_of(lps),
                prompt_ref=ref,
                prompt_ref_len=ref_len,
                weight_version=wv,
                task_id=row[15],
                request=requests.text(tid, row[16], *row[18:22]) if with_raw else None,
                response=row[17],
            )
    finally:
        db.close()


def _join(head: list[int] | np.ndarray, tail: list[int] | np.ndarray) -> list[int] | np.ndarray:
    """Two token sequences as one: lists stay lists, arrays (`read_turns(arrays=True)`) arrays."""
    return head + tail if isinstance(head, list) else np.concatenate((head, tail))


def _resolve_sync(
    db: sqlite3.Connection, turn_id: str, cache: _SequenceCache, *, arrays: bool = False
) -> list[int] | np.ndarray:
    row = db.execute(
        "SELECT prompt_ref, prompt_ref_len, prompt_suffix, output_ids FROM turns WHERE id = ?", (turn_id,)
    ).fetchone()
    if row is None:
        raise KeyError(f"turn {turn_id} referenced but missing")
    ref, ref_len, suffix, out = row
    ids_of = unpack_ids_array if arrays else unpack_ids
    prompt = ids_of(suffix)
    if ref:
        base = cache.get(ref)
        prompt = _join((base[0] if base else _resolve_sync(db, ref, cache, arrays=arrays))[:ref_len], prompt)
    seq = _join(prompt, ids_of(out))
    cache.put(turn_id, seq, len(prompt))
    return seq


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
