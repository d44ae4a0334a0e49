"""`Store`: the async writer the proxy uses (WAL; its connection lives in a thread of its own).

A turn's prompt is stored as a reference to an earlier turn's full sequence (prompt + output) plus
its own new suffix, so a long session costs its unique tokens, not turns × context; its raw
request likewise as what differs from an earlier turn's request (`deltas`), zstd-compressed with
the session's dictionary, and its headers as what changed since the session's previous turn
(`requests`).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from polar_mitm import redact
from polar_mitm.store import deltas, requests
from polar_mitm.store.connection import connect_wal, init_db
from polar_mitm.store.packing import pack_ids, pack_logprobs, unpack_ids
from polar_mitm.store.sequences import SequenceCache
from polar_mitm.store.turn import Turn

Statement = tuple[str, Sequence[Any]]

_INSERT_TURN = (
    "INSERT INTO turns (id, session_id, seq, created_at, style, host, path, model, tag, status,"
    " finish_reason, prompt_ref, prompt_ref_len, prompt_suffix, prompt_len, output_ids,"
    " output_logprobs, output_len, weight_version, msg_hash, post_hash, request, request_headers,"
    " response, error, latency_ms, request_ref, request_head, request_tail, request_delta,"
    " request_zstd, request_dict, headers_ref, logprobs_mode, tool_parse)"
    " VALUES (?,?,(SELECT COALESCE(MAX(seq), 0) + 1 FROM turns),"
    "?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)"
)
# Places in its values (after the seq, which the INSERT computes) of the columns `_write_turn` fills.
_REQUEST_COL, _REF_COL, _DELTA_COL, _ZSTD_COL, _DICT_COL = 20, 25, 28, 29, 30


_BUSY_MS = 5_000  # how long a write waits for another writer's lock (sqlite3's default timeout)


def _size(statements: Sequence[Statement]) -> int:
    """About how many bytes the statements add to the WAL (their text and blob values)."""
    return sum(len(v) for _, params in statements for v in params if isinstance(v, str | bytes)) + 4096


class Store:
    """Async writer used by the proxy; safe for concurrent turns, and beside other writers (other
    processes) of the same file.

    Its connection lives in one thread of its own; every write (`write`) is one transaction,
    committed there in one trip from the event loop, so concurrent writes never share a
    transaction. A turn's commit is the exception, when it is small and that thread is idle: it
    commits on the event loop's thread itself (no thread hop: ~0.3 ms of a short turn's CPU,
    futexes and a wake-up of the loop), never waiting there:

    - for the write lock: the loop's attempt takes it without waiting (busy timeout 0); another
      process holding it sends the commit to the thread, which waits for it as every write does;
    - for a WAL checkpoint: the connection never checkpoints on commit (`wal_autocheckpoint` 0);
      the thread checkpoints (PASSIVE, as SQLite's own) after every CHECKPOINT_BYTES written;
    - for the thread: only while nothing is queued or running there (`_sent` == `_done`: each
      counter written by one thread), so the connection is never in two transactions at once and
      the turns commit in the order they came."""

    INLINE_CHARS = 64 * 1024  # a request text compressed on the loop at most this long
    CHECKPOINT_BYTES = 4 * 1024 * 1024  # SQLite's own default: 1,000 pages of 4 KiB

    def __init__(
        self,
        path: str | Path,
        thread: ThreadPoolExecutor,
        conn: sqlite3.Connection,
        *,
        request_memo_chars: int,
        dict_chars: int = 64_000_000,
        compress: bool = True,
    ):
        self.path = str(path)
        self._thread = thread
        self._conn = conn  # used in `_thread`, or on the loop while `_thread` is idle
        self._sent = 0  # jobs given to `_thread` (the loop counts)
        self._done = 0  # ... and finished there (the thread counts)
        self._unchecked = 0  # bytes committed since the last checkpoint (roughly)
        self.cache = SequenceCache(compact=True)
        self._sessions: set[str] = set()
        # Recent requests, to store the next one of a conversation as what differs (0: whole).
        self.requests = deltas.Memo(request_memo_chars)
        # The newest turn of each (session, tag, path): the reference of a request that does not
        # extend an earlier turn's prompt (side calls, harvested exchanges, a compacted context).
        self._last_request: OrderedDict[tuple[str, str | None, str | None], str] = OrderedDict()
        # The newest completed turn by (session, post_hash) of those this writer stored, so the
        # usual echo of the previous reply is found without a query (bounded, oldest out first).
        self._post_hashes: OrderedDict[tuple[str, str], str] = OrderedDict()
        # False: request text plain and headers whole, as stores before m006 (for comparisons).
        self.compress = compress
        # Each session's zstd dictionary: one of its requests (its turn id), bounded in characters.
        self.dict_chars = dict_chars
        self._dicts: OrderedDict[str, tuple[str, requests.zstd.ZstdDict, int]] = OrderedDict()
        self._dict_size = 0
        # Each session's newest headers (turn id, headers, how many references lead to whole ones).
        self._last_headers: OrderedDict[str, tuple[str, dict[str, str], int]] = OrderedDict()

    @classmethod
    async def open(
        cls,
        path: str | Path,
        *,
        request_memo_chars: int = 32_000_000,
        dict_chars: int = 64_000_000,
        compress: bool = True,
    ) -> Store:
        init_db(path)
        thread = ThreadPoolExecutor(1, thread_name_prefix="polar-store")
        # Autocommit: `write` opens and commits its own transactions. Not bound to its thread:
        # the loop commits small turns itself while the thread is idle (see the class).
        conn = await asyncio.get_running_loop().run_in_executor(
            thread, lambda: connect_wal(path, isolation_level=None, check_same_thread=False)
        )
        conn.execute("PRAGMA wal_autocheckpoint=0")
        return cls(
            path,
            thread,
            conn,
            request_memo_chars=request_memo_chars,
            dict_chars=dict_chars,
            compress=compress,
        )

    async def close(self) -> None:
        await self._run(self._conn.close)
        self._thread.shutdown(wait=False)

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.wrap_future(self._submit(fn, *args))

    def _submit(self, fn: Any, *args: Any) -> Any:
        """fn(*args) in the store's thread; counted until it has returned there (a cancelled
        waiter does not stop it)."""

        def job() -> Any:
            try:
                return fn(*args)
            finally:
                self._done += 1

        self._sent += 1
        return self._thread.submit(job)

    def _checkpoint(self) -> None:
        self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()

    def _committed(self, size: int) -> None:
        """`size` more bytes in the WAL: past CHECKPOINT_BYTES, a checkpoint in the thread."""
        self._unchecked += size
        if self._unchecked >= self.CHECKPOINT_BYTES:
            self._unchecked = 0
            self._submit(self._checkpoint)

    async def write(self, *statements: Statement) -> None:
        """Run the statements as one transaction; it is committed (durable in the WAL) when this
        returns, or rolled back and the error raised."""
        await self._run(self._write, statements)
        self._committed(_size(statements))

    def _write(self, statements: Sequence[Statement], *, wait: bool = True) -> bool:
        """The transaction. The write lock first: waiting for other writers, or with `wait`
        False (the loop's commit) not at all: then False, with nothing written, when another
        connection holds it."""
        conn = self._conn
        if wait:
            conn.execute("BEGIN IMMEDIATE")
        else:
            conn.execute("PRAGMA busy_timeout=0")
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as e:
                if e.sqlite_errorcode in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
                    return False
                raise
            finally:
                conn.execute(f"PRAGMA busy_timeout={_BUSY_MS}")
        try:
            for sql, params in statements:
                conn.execute(sql, params)
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        return True

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
        processes sharing the file never hand out the same one (m004 indexes seq for the MAX).
        Its request text is compressed in the store's thread, beside the commit, not on the loop."""
        # Sessions named by proxy credentials appear with their first turn.
        known = rec.session_id in self._sessions
        key = (rec.session_id, rec.tag, rec.path)
        request_ref, delta = self._request_delta(rec.request, rec.prompt_ref, self._last_request.get(key))
        zdict = self._dicts.get(rec.session_id)
        if zdict is not None:
            self._dicts.move_to_end(rec.session_id)
        headers_ref, headers = self._headers_delta(rec.session_id, rec.request_headers)
        stored = (rec.request if delta is None else delta.middle) if self.compress else None
        values = _turn_row(rec, request_ref, delta, headers, headers_ref)
        statements: list[Statement] = []
        if not known:
            statements.append(
                (
                    "INSERT OR IGNORE INTO sessions (id, created_at) VALUES (?, ?)",
                    (rec.session_id, time.time()),
                )
            )
        statements.append((_INSERT_TURN, values))
        if self._sent == self._done and (stored is None or len(stored) <= self.INLINE_CHARS):
            self._compress(values, stored, zdict)
            if not self._write(statements, wait=False):
                await self._run(self._write, statements)
        else:
            await self._run(self._write_turn, statements, values, stored, zdict)
        self._committed(_size(statements))
        self._remember(rec, key, zdict, headers_ref)

    def _remember(
        self,
        rec: Turn,
        key: tuple[str, str | None, str | None],
        zdict: tuple[str, requests.zstd.ZstdDict, int] | None,
        headers_ref: str | None,
    ) -> None:
        """What the next turns are written against, once `rec` is committed: its session, its
        post hash, its sequence, its request text and headers (each memory bounded)."""
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
            if zdict is None and self.compress and self.dict_chars > 0:
                self._keep_dict(rec.session_id, rec.id, rec.request)
        if rec.request_headers:
            depth = self._last_headers.get(rec.session_id, ("", {}, 0))[2] + 1 if headers_ref else 0
            self._last_headers[rec.session_id] = (rec.id, rec.request_headers, depth)
            self._last_headers.move_to_end(rec.session_id)
            if len(self._last_headers) > 65_536:
                self._last_headers.popitem(last=False)

    def _write_turn(
        self,
        statements: list[Statement],
        values: list[Any],
        stored: str | None,
        zdict: tuple[str, requests.zstd.ZstdDict, int] | None,
    ) -> None:
        """In the store's thread: the request text compressed (when that is smaller) into its
        column, then the transaction."""
        self._compress(values, stored, zdict)
        self._write(statements)

    @staticmethod
    def _compress(
        values: list[Any], stored: str | None, zdict: tuple[str, requests.zstd.ZstdDict, int] | None
    ) -> None:
        frame = requests.compress(stored, zdict[1] if zdict else None) if stored else None
        if frame is not None:
            values[_REQUEST_COL if values[_REF_COL] is None else _DELTA_COL] = frame
            values[_ZSTD_COL] = 1
            values[_DICT_COL] = zdict[0] if zdict else None

    def _keep_dict(self, session_id: str, turn_id: str, text: str) -> None:
        """The session's dictionary from now on: this turn's request (bounded in total, least
        recently used out first)."""
        if not requests.MIN_COMPRESS <= len(text) <= self.dict_chars:
            return
        zdict = requests.dictionary(text)
        self._dicts[session_id] = (turn_id, zdict, len(text))
        # Digested in the store's thread while the harness waits for its reply; nothing awaits it.
        self._submit(requests.warm, zdict)
        self._dict_size += len(text)
        while self._dict_size > self.dict_chars and len(self._dicts) > 1:
            _, (_, _, size) = self._dicts.popitem(last=False)
            self._dict_size -= size

    def _headers_delta(self, session_id: str, headers: dict[str, str]) -> tuple[str | None, dict[str, Any]]:
        """The reference and what `headers` changed since the session's previous turn's, or
        (None, headers) to store them whole."""
        last = self._last_headers.get(session_id)
        if last is None or not headers or not self.compress or last[2] + 1 >= requests.HEADER_CHAIN:
            return None, headers
        changed = requests.headers_diff(last[1], headers)
        return (None, headers) if changed is None else (last[0], changed)

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

    async def exchange(self, turn_id: str) -> tuple[str, str, str, str | None, str | None] | None:
        """(session, style, status, raw request, response) of one turn, or None when the store has
        no such turn (the response of a Responses-style turn is continued from these)."""

        def read() -> tuple[str, str, str, str | None, str | None] | None:
            row = self._conn.execute(
                "SELECT session_id, style, status, response FROM turns WHERE id = ?", (turn_id,)
            ).fetchone()
            if row is None:
                return None
            return row[0], row[1], row[2], requests.RequestReader(self._conn).request(turn_id), row[3]

        return await self._run(read)

    async def set_reward(self, session_id: str, value: float | None) -> None:
        await self.write(("UPDATE sessions SET reward = ? WHERE id = ?", (value, session_id)))


def _turn_row(
    rec: Turn,
    request_ref: str | None,
    delta: deltas.Delta | None,
    headers: dict[str, Any],
    headers_ref: str | None,
) -> list[Any]:
    """`rec` as the values of `_INSERT_TURN` (its prompt stored as the suffix past its reference)."""
    suffix = rec.prompt_ids[rec.prompt_ref_len :] if rec.prompt_ref else rec.prompt_ids
    return [
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
        json.dumps(headers),
        rec.response,
        rec.error,
        rec.latency_ms,
        request_ref,
        *((0, 0, None) if delta is None else delta),
        0,
        None,
        headers_ref,
        rec.logprobs_mode,
        rec.tool_parse,
    ]
