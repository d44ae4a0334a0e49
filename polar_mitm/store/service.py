"""The rollout service's state in SQLite (migration m003): tasks, samples under leases, nodes,
switches. The server holds nothing it cannot rebuild from here, so a killed server restarts where
it was: queued samples stay queued, dispatched ones keep their lease (their node may still
report), finished ones keep their rows.

Synchronous sqlite3 on one connection: every statement is small, and one writer keeps the
dispatch decisions (`lease`) atomic. A sample's rows (its trajectories: ~0.5 MB of JSON for a
Claude Code session of 26k tokens) are kept as a zstd frame of their JSON (m007): a third of the
size, and written and read back in about a millisecond.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polar_mitm import jsontext
from polar_mitm.store.connection import connect_wal, init_db
from polar_mitm.store.requests import zstd

# Level 1: ~1 ms for a session's 0.45 MB of rows, within a few per cent of level 3's size.
ROWS_LEVEL = 1


@dataclass
class SampleRow:
    """One sample of a service task as the server's store keeps it (lease, dispatches, the rows
    a node reported); served as `api.SampleView`. A `rollout` sample is `store.rollouts.SampleInfo`."""

    task_id: str
    idx: int
    state: str
    stage: str | None
    status: str | None
    cause: str | None
    node_id: str | None
    lease: str | None
    dispatches: int
    reward: float | None
    detail: str | None
    timings: str | None
    weight_versions: str | None
    session_id: str | None
    rows: str | bytes | None  # JSON text (stores before m007) or a zstd frame of it: `unpack_rows`
    updated_at: float


_SAMPLE_COLS = (
    "task_id, idx, state, stage, status, cause, node_id, lease, dispatches, reward, detail, timings,"
    " weight_versions, session_id, rows, updated_at"
)
# The same without the rows (a sample's trajectories, the bulk of the table): for views.
_SAMPLE_VIEW_COLS = _SAMPLE_COLS.replace(" rows,", " NULL,")


@dataclass
class TaskRow:
    """One service task as the server's store keeps it (its request and callback state); its
    samples are `SampleRow`s."""

    id: str
    request: str
    task: str
    state: str
    priority: int
    num_samples: int
    created_at: float
    updated_at: float
    callback_state: str | None
    callback_attempts: int
    callback_error: str | None


@dataclass
class TaskSummary:
    """What a task's view shows, read from its columns (its request is not parsed)."""

    id: str
    state: str
    priority: int
    num_samples: int
    created_at: float
    updated_at: float
    callback_state: str | None
    harness: str
    runtime: str


_SUMMARY_COLS = (
    "id, state, priority, num_samples, created_at, updated_at, callback_state,"
    " json_extract(request, '$.harness'), coalesce(json_extract(request, '$.runtime'), 'docker')"
)


@dataclass
class NodeRow:
    id: str
    url: str | None
    workers: str
    state: str
    registered_at: float
    last_seen: float
    stats: str


def pack_rows(rows: list[dict[str, Any]]) -> bytes:
    """A sample's rows as the store keeps them: their JSON (orjson: 30x faster than `json` on a
    session's token lists, the same text for the values JSON holds) in a zstd frame."""
    return zstd.compress(jsontext.dumps(rows), ROWS_LEVEL)


def unpack_rows(stored: str | bytes | None) -> list[dict[str, Any]]:
    """`pack_rows` undone; rows stored before m007 are JSON text."""
    if stored is None:
        return []
    if isinstance(stored, bytes):
        stored = zstd.decompress(stored)
    return jsontext.loads(stored)


class ServiceStore:
    def __init__(self, path: str | Path):
        init_db(path)
        self.path = str(path)
        self.db = connect_wal(path)
        self.db.execute("PRAGMA busy_timeout=10000")

    def close(self) -> None:
        self.db.close()

    # -- tasks ----------------------------------------------------------------------------------

    def add_task(self, task_id: str, request: str, task: str, priority: int, n: int, callback: bool) -> bool:
        """Insert a task and its queued samples; False when the id exists."""
        now = time.time()
        try:
            with self.db:
                self.db.execute(
                    "INSERT INTO service_tasks (id, request, task, state, priority, num_samples, created_at,"
                    " updated_at, callback_state) VALUES (?, ?, ?, 'queued', ?, ?, ?, ?, ?)",
                    (task_id, request, task, priority, n, now, now, "pending" if callback else None),
                )
                self.db.executemany(
                    "INSERT INTO service_samples (task_id, idx, state, updated_at) VALUES (?, ?, 'queued', ?)",
                    [(task_id, i, now) for i in range(n)],
                )
        except sqlite3.IntegrityError:
            return False
        return True

    def task(self, task_id: str) -> TaskRow | None:
        row = self.db.execute("SELECT * FROM service_tasks WHERE id = ?", (task_id,)).fetchone()
        return TaskRow(*row) if row else None

    def tasks(self, states: tuple[str, ...] | None = None) -> list[TaskRow]:
        sql = "SELECT * FROM service_tasks"
        args: tuple[str, ...] = ()
        if states:
            sql += f" WHERE state IN ({','.join('?' * len(states))})"
            args = states
        return [TaskRow(*r) for r in self.db.execute(sql + " ORDER BY created_at", args)]

    def summaries(self, task_id: str | None = None) -> list[TaskSummary]:
        sql = f"SELECT {_SUMMARY_COLS} FROM service_tasks"
        args: tuple[str, ...] = ()
        if task_id is not None:
            sql, args = sql + " WHERE id = ?", (task_id,)
        return [TaskSummary(*r) for r in self.db.execute(sql + " ORDER BY created_at", args)]

    def set_task_state(self, task_id: str, state: str) -> None:
        with self.db:
            self.db.execute(
                "UPDATE service_tasks SET state = ?, updated_at = ? WHERE id = ?",
                (state, time.time(), task_id),
            )

    def set_callback(self, task_id: str, state: str, error: str | None = None) -> None:
        with self.db:
            self.db.execute(
                "UPDATE service_tasks SET callback_state = ?, callback_attempts = callback_attempts + 1,"
                " callback_error = ? WHERE id = ?",
                (state, error, task_id),
            )

    def pending_callbacks(self) -> list[TaskRow]:
        return [
            TaskRow(*r)
            for r in self.db.execute(
                "SELECT * FROM service_tasks WHERE callback_state = 'pending' AND state IN ('done', 'cancelled')"
            )
        ]

    # -- samples --------------------------------------------------------------------------------

    def samples(self, task_id: str, *, rows: bool = True) -> list[SampleRow]:
        """A task's samples in index order; with rows=False their `rows` are None (views)."""
        cols = _SAMPLE_COLS if rows else _SAMPLE_VIEW_COLS
        return [
            SampleRow(*r)
            for r in self.db.execute(
                f"SELECT {cols} FROM service_samples WHERE task_id = ? ORDER BY idx", (task_id,)
            )
        ]

    def all_samples(self) -> dict[str, list[SampleRow]]:
        """Every task's samples, without their rows, in one query (the task list)."""
        out: dict[str, list[SampleRow]] = {}
        for r in self.db.execute(f"SELECT {_SAMPLE_VIEW_COLS} FROM service_samples ORDER BY task_id, idx"):
            out.setdefault(r[0], []).append(SampleRow(*r))
        return out

    def sample(self, task_id: str, idx: int) -> SampleRow | None:
        row = self.db.execute(
            f"SELECT {_SAMPLE_COLS} FROM service_samples WHERE task_id = ? AND idx = ?", (task_id, idx)
        ).fetchone()
        return SampleRow(*row) if row else None

    def lease(self, node_id: str, capacity: int) -> list[tuple[SampleRow, str]]:
        """Dispatch up to `capacity` queued samples to a node, highest priority first, oldest
        task first, in index order. Each gets a fresh lease; the task becomes running."""
        if capacity <= 0:
            return []
        now = time.time()
        out = []
        with self.db:
            # The open tasks in order (m007's partial index), each task's samples by its key:
            # the walk stops at `capacity`, however many samples wait. (CROSS JOIN keeps the
            # tasks outermost; `+s.state` keeps the samples' state index out of the inner loop.)
            rows = self.db.execute(
                f"SELECT {', '.join('s.' + c.strip() for c in _SAMPLE_COLS.split(','))}"
                " FROM service_tasks t CROSS JOIN service_samples s ON s.task_id = t.id"
                " WHERE +s.state = 'queued' AND t.state IN ('queued', 'running')"
                " ORDER BY t.priority DESC, t.created_at, t.id, s.idx LIMIT ?",
                (capacity,),
            ).fetchall()
            for r in rows:
                s = SampleRow(*r)
                lease = uuid.uuid4().hex
                self.db.execute(
                    "UPDATE service_samples SET state = 'dispatched', stage = 'queued', node_id = ?, lease = ?,"
                    " dispatches = dispatches + 1, updated_at = ? WHERE task_id = ? AND idx = ?",
                    (node_id, lease, now, s.task_id, s.idx),
                )
                self.db.execute(
                    "UPDATE service_tasks SET state = 'running', updated_at = ? WHERE id = ? AND state = 'queued'",
                    (now, s.task_id),
                )
                out.append((s, lease))
        return out

    def finish_sample(
        self,
        task_id: str,
        idx: int,
        lease: str | None,
        *,
        status: str,
        cause: str | None,
        reward: float | None,
        detail: Any = None,
        timings: dict[str, float] | None = None,
        weight_versions: list[str] | None = None,
        session_id: str | None = None,
        rows: list[dict[str, Any]] | None = None,
        node_id: str | None = None,
    ) -> bool:
        """Record a sample's outcome, only under its current lease and from the node holding it
        (or, with lease None, a sample that is not dispatched: cancelled or failed by the
        server). False when refused."""
        now = time.time()
        cond = (
            "lease = ? AND node_id IS ? AND state IN ('dispatched', 'cancelling')"
            if lease
            else "state != 'finished'"
        )
        args: tuple[Any, ...] = (lease, node_id) if lease else ()
        with self.db:
            cur = self.db.execute(
                # A sample we asked to stop keeps our reason (early stop, a cancelled task).
                "UPDATE service_samples SET state = 'finished', stage = NULL, status = ?,"
                " cause = CASE WHEN state = 'cancelling' AND cause IS NOT NULL THEN cause ELSE ? END, reward = ?,"
                " detail = ?, timings = ?, weight_versions = ?, session_id = ?, rows = ?, updated_at = ?"
                f" WHERE task_id = ? AND idx = ? AND {cond}",
                (
                    status,
                    cause,
                    reward,
                    json.dumps(detail, default=str) if detail is not None else None,
                    json.dumps(timings or {}),
                    json.dumps(weight_versions or []),
                    session_id,
                    pack_rows(rows or []),
                    now,
                    task_id,
                    idx,
                    *args,
                ),
            )
        return cur.rowcount == 1

    def requeue_sample(self, task_id: str, idx: int, lease: str, max_dispatches: int, node_id: str) -> bool:
        """A node gave a sample back unfinished (it is shutting down): queue it again while it
        has dispatches left. False when the lease is stale, not this node's, or none are left."""
        with self.db:
            cur = self.db.execute(
                "UPDATE service_samples SET state = 'queued', stage = NULL, node_id = NULL, lease = NULL,"
                " updated_at = ? WHERE task_id = ? AND idx = ? AND lease = ? AND node_id = ?"
                " AND state = 'dispatched' AND dispatches < ?",
                (time.time(), task_id, idx, lease, node_id, max_dispatches),
            )
        return cur.rowcount == 1

    def held_by(self, node_id: str) -> list[tuple[str, int, str, str, float]]:
        """The samples the server counts as the node's: (task, index, lease, state, since), since
        being when the node got the lease (or the sample last changed under it)."""
        return list(
            self.db.execute(
                "SELECT task_id, idx, lease, state, updated_at FROM service_samples"
                " WHERE node_id = ? AND state IN ('dispatched', 'cancelling')",
                (node_id,),
            )
        )

    def overdue(self, now: float, grace: float, since: float) -> list[tuple[str, int, str, str]]:
        """Samples a node has held past their deadline: (task, index, lease, node). The deadline
        is the sample's budget (`timeout_seconds`, else its task's total timeout) plus `grace`,
        from when its node began it (a heartbeat says so: `set_stages`); while it waits in its
        node's queue, one budget more. Nothing counts from before `since` (this server's start)."""
        return list(
            self.db.execute(
                "SELECT s.task_id, s.idx, s.lease, s.node_id FROM service_samples s"
                " JOIN service_tasks t ON t.id = s.task_id"
                " WHERE s.state IN ('dispatched', 'cancelling') AND max(s.updated_at, ?)"
                " + coalesce(json_extract(t.request, '$.timeout_seconds'),"
                " json_extract(t.task, '$.total_timeout_sec'), 3600)"
                " * (CASE WHEN coalesce(s.stage, 'queued') IN ('queued', 'preparing') THEN 2 ELSE 1 END)"
                " + ? < ?",
                (since, grace, now),
            )
        )

    def repair(
        self, stale: list[tuple[str, int, str]], cause: str, max_dispatches: int
    ) -> tuple[int, int, int]:
        """Give up samples under the leases in `stale` (task, index, lease), which their node no
        longer runs or ran past their deadline: queued again while dispatches are left, else
        failed with `cause` (and how many times each was dispatched); one being cancelled is
        cancelled. The lease ends, so a node still holding it is told to drop it. A sample whose
        lease changed meanwhile is left alone. (requeued, failed, cancelled)"""
        now = time.time()
        requeued = failed = cancelled = 0
        with self.db:
            for t, i, lease in stale:
                key = (t, i, lease)
                cancelled += self.db.execute(
                    "UPDATE service_samples SET state = 'finished', status = 'cancelled', stage = NULL,"
                    " lease = NULL, updated_at = ? WHERE task_id = ? AND idx = ? AND lease = ?"
                    " AND state = 'cancelling'",
                    (now, *key),
                ).rowcount
                requeued += self.db.execute(
                    "UPDATE service_samples SET state = 'queued', stage = NULL, node_id = NULL, lease = NULL,"
                    " updated_at = ? WHERE task_id = ? AND idx = ? AND lease = ? AND state = 'dispatched'"
                    " AND dispatches < ?",
                    (now, *key, max_dispatches),
                ).rowcount
                failed += self.db.execute(
                    "UPDATE service_samples SET state = 'finished', status = 'failed', reward = 0.0, stage = NULL,"
                    " cause = ? || ' (dispatched ' || dispatches || ' times)', lease = NULL, updated_at = ?"
                    " WHERE task_id = ? AND idx = ? AND lease = ? AND state = 'dispatched'",
                    (cause, now, *key),
                ).rowcount
        return requeued, failed, cancelled

    def set_stages(self, node_id: str, stages: list[tuple[str, int, str]]) -> None:
        """The stage each sample is at on its node. A sample that leaves its node's queue starts
        its budget there: its deadline (`overdue`) counts from then."""
        now = time.time()
        with self.db:
            self.db.executemany(
                "UPDATE service_samples SET stage = ?1, updated_at = CASE WHEN coalesce(stage, 'queued')"
                " IN ('queued', 'preparing') AND ?1 NOT IN ('queued', 'preparing') THEN ?2 ELSE updated_at END"
                " WHERE task_id = ?3 AND idx = ?4 AND node_id = ?5 AND state IN ('dispatched', 'cancelling')",
                [(stage, now, t, i, node_id) for t, i, stage in stages],
            )

    def cancel_samples(self, task_id: str, reason: str) -> int:
        """Queued samples of the task → cancelled; dispatched ones → cancelling (their node is
        told to stop them, and reports them cancelled). Returns how many were touched."""
        now = time.time()
        with self.db:
            a = self.db.execute(
                "UPDATE service_samples SET state = 'finished', status = 'cancelled', cause = ?, updated_at = ?"
                " WHERE task_id = ? AND state = 'queued'",
                (reason, now, task_id),
            ).rowcount
            b = self.db.execute(
                "UPDATE service_samples SET state = 'cancelling', cause = ?, updated_at = ?"
                " WHERE task_id = ? AND state = 'dispatched'",
                (reason, now, task_id),
            ).rowcount
        return a + b

    def cancelling_for(self, node_id: str) -> list[tuple[str, int]]:
        return [
            (t, i)
            for t, i in self.db.execute(
                "SELECT task_id, idx FROM service_samples WHERE node_id = ? AND state = 'cancelling'",
                (node_id,),
            )
        ]

    def requeue_node(self, node_id: str, max_dispatches: int) -> tuple[int, int]:
        """A lost node's unfinished samples: queued again (once), or failed when they were already
        dispatched `max_dispatches` times; its cancelling ones become cancelled. (requeued, failed)"""
        now = time.time()
        with self.db:
            self.db.execute(
                "UPDATE service_samples SET state = 'finished', status = 'cancelled', stage = NULL, updated_at = ?"
                " WHERE node_id = ? AND state = 'cancelling'",
                (now, node_id),
            )
            requeued = self.db.execute(
                "UPDATE service_samples SET state = 'queued', stage = NULL, node_id = NULL, lease = NULL,"
                " updated_at = ? WHERE node_id = ? AND state = 'dispatched' AND dispatches < ?",
                (now, node_id, max_dispatches),
            ).rowcount
            failed = self.db.execute(
                "UPDATE service_samples SET state = 'finished', status = 'failed', reward = 0.0, stage = NULL,"
                " cause = 'node lost: ' || node_id || ' (dispatched ' || dispatches || ' times)', lease = NULL,"
                " updated_at = ? WHERE node_id = ? AND state = 'dispatched'",
                (now, node_id),
            ).rowcount
        return requeued, failed

    def counts(self) -> dict[tuple[str, str | None], int]:
        """(state, status) → samples, for the metrics."""
        return {
            (state, status): n
            for state, status, n in self.db.execute(
                "SELECT state, status, COUNT(*) FROM service_samples GROUP BY state, status"
            )
        }

    # -- nodes ----------------------------------------------------------------------------------

    def register_node(self, node_id: str, url: str | None, workers: dict[str, int]) -> None:
        now = time.time()
        with self.db:
            self.db.execute(
                "INSERT INTO service_nodes (id, url, workers, state, registered_at, last_seen)"
                " VALUES (?, ?, ?, 'active', ?, ?) ON CONFLICT(id) DO UPDATE SET url = excluded.url,"
                " workers = excluded.workers, state = 'active', last_seen = excluded.last_seen",
                (node_id, url, json.dumps(workers), now, now),
            )

    def heartbeat(self, node_id: str, stats: str) -> NodeRow | None:
        with self.db:
            self.db.execute(
                "UPDATE service_nodes SET last_seen = ?, stats = ? WHERE id = ?",
                (time.time(), stats, node_id),
            )
        return self.node(node_id)

    def node(self, node_id: str) -> NodeRow | None:
        row = self.db.execute("SELECT * FROM service_nodes WHERE id = ?", (node_id,)).fetchone()
        return NodeRow(*row) if row else None

    def nodes(self) -> list[NodeRow]:
        return [NodeRow(*r) for r in self.db.execute("SELECT * FROM service_nodes ORDER BY registered_at")]

    def set_node_state(self, node_id: str, state: str) -> bool:
        with self.db:
            return (
                self.db.execute("UPDATE service_nodes SET state = ? WHERE id = ?", (state, node_id)).rowcount
                == 1
            )

    def set_node_key(self, node_id: str, key_digest: str) -> None:
        """The digest of the key a node was issued at registration (never the key itself)."""
        self.put(f"node_key:{node_id}", key_digest)

    def node_for_key(self, key_digest: str) -> str | None:
        row = self.db.execute(
            "SELECT key FROM service_state WHERE key LIKE 'node\\_key:%' ESCAPE '\\' AND value = ?",
            (key_digest,),
        ).fetchone()
        return row[0].removeprefix("node_key:") if row else None

    def dispatched_count(self, node_id: str) -> int:
        return self.db.execute(
            "SELECT COUNT(*) FROM service_samples WHERE node_id = ? AND state IN ('dispatched', 'cancelling')",
            (node_id,),
        ).fetchone()[0]

    # -- switches -------------------------------------------------------------------------------

    def get(self, key: str, default: str | None = None) -> str | None:
        row = self.db.execute("SELECT value FROM service_state WHERE key = ?", (key,)).fetchone()
        return row[0] if row else default

    def put(self, key: str, value: str | None) -> None:
        with self.db:
            if value is None:
                self.db.execute("DELETE FROM service_state WHERE key = ?", (key,))
            else:
                self.db.execute(
                    "INSERT INTO service_state (key, value) VALUES (?, ?)"
                    " ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                    (key, value),
                )
