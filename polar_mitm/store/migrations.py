"""Schema migrations: an ordered list of small functions, each applied once and recorded.

Never alter the schema anywhere else; append a new function here instead.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable

Migration = Callable[[sqlite3.Connection], None]


def m001_initial(db: sqlite3.Connection) -> None:
    db.executescript(
        """
        CREATE TABLE sessions (
            id          TEXT PRIMARY KEY,
            task_id     TEXT,
            harness     TEXT,
            command     TEXT,          -- JSON list
            mode        TEXT NOT NULL DEFAULT 'policy',   -- policy | harvest
            metadata    TEXT NOT NULL DEFAULT '{}',
            created_at  REAL NOT NULL,
            ended_at    REAL,
            exit_code   INTEGER,
            reward      REAL
        );
        CREATE TABLE turns (
            id              TEXT PRIMARY KEY,
            session_id      TEXT NOT NULL REFERENCES sessions(id),
            seq             INTEGER NOT NULL,       -- order of creation within the store
            created_at      REAL NOT NULL,
            style           TEXT NOT NULL,          -- anthropic | openai-chat | openai-responses | gemini
            host            TEXT,
            path            TEXT,
            model           TEXT,
            tag             TEXT,                   -- side call kind (title, router, ...) or NULL
            status          TEXT NOT NULL,          -- ok | aborted | error
            finish_reason   TEXT,
            -- prompt = full sequence of prompt_ref (its prompt + output) cut at prompt_ref_len, + suffix
            prompt_ref      TEXT REFERENCES turns(id),
            prompt_ref_len  INTEGER NOT NULL DEFAULT 0,
            prompt_suffix   BLOB,
            prompt_len      INTEGER NOT NULL DEFAULT 0,
            output_ids      BLOB,
            output_logprobs BLOB,
            output_len      INTEGER NOT NULL DEFAULT 0,
            weight_version  TEXT,
            msg_hash        TEXT,                   -- hash chain of the normalized request messages
            post_hash       TEXT,                   -- ... with this turn's reply appended
            request         TEXT,                   -- native request body, credentials removed
            request_headers TEXT,                   -- JSON, credentials removed
            response        TEXT,                   -- the completion (neutral JSON) or harvested reply
            error           TEXT,
            latency_ms      REAL
        );
        CREATE INDEX turns_session ON turns(session_id, seq);
        CREATE INDEX turns_post_hash ON turns(session_id, post_hash);
        CREATE INDEX turns_created ON turns(created_at);
        """
    )


def m002_rollouts(db: sqlite3.Connection) -> None:
    """Rollouts: groups of samples of one task, each sample one session (one attempt of it)."""
    db.executescript(
        """
        CREATE TABLE rollouts (
            id          TEXT PRIMARY KEY,
            created_at  REAL NOT NULL,
            ended_at    REAL,
            status      TEXT NOT NULL DEFAULT 'running',   -- running | done | interrupted | failed
            config      TEXT NOT NULL DEFAULT '{}'         -- JSON: harness, runtime, samples, ...
        );
        CREATE TABLE rollout_groups (
            id          TEXT PRIMARY KEY,
            rollout_id  TEXT NOT NULL REFERENCES rollouts(id),
            task_id     TEXT NOT NULL,
            num_samples INTEGER NOT NULL,
            task        TEXT NOT NULL DEFAULT '{}',       -- JSON: the Task as loaded
            created_at  REAL NOT NULL,
            ended_at    REAL,
            status      TEXT NOT NULL DEFAULT 'running'    -- running | done | early_stopped | cancelled
        );
        CREATE TABLE samples (
            session_id    TEXT PRIMARY KEY REFERENCES sessions(id),
            group_id      TEXT NOT NULL REFERENCES rollout_groups(id),
            sample_index  INTEGER NOT NULL,
            attempt       INTEGER NOT NULL DEFAULT 0,
            -- queued | starting | ready | running | scoring (in flight), then completed |
            -- agent_timeout (trainable) or failed | cancelled | retried (masked)
            status        TEXT NOT NULL,
            cause         TEXT,                 -- why it failed or was cancelled
            reward        REAL,
            reward_detail TEXT,                 -- JSON from the evaluator
            exit_code     INTEGER,              -- the harness's
            timings       TEXT NOT NULL DEFAULT '{}',   -- JSON: seconds per stage
            created_at    REAL NOT NULL,
            ended_at      REAL
        );
        CREATE INDEX samples_group ON samples(group_id, sample_index, attempt);
        """
    )


def m003_service(db: sqlite3.Connection) -> None:
    """The rollout service's state: submitted tasks, their samples (dispatched to nodes under a
    lease), the nodes, and the service's own switches (pause, weight version)."""
    db.executescript(
        """
        CREATE TABLE service_tasks (
            id              TEXT PRIMARY KEY,
            request         TEXT NOT NULL,          -- JSON: the TaskRequest as submitted
            task            TEXT NOT NULL,          -- JSON: the resolved Task
            state           TEXT NOT NULL,          -- queued | running | done | cancelled
            priority        INTEGER NOT NULL DEFAULT 0,
            num_samples     INTEGER NOT NULL,
            created_at      REAL NOT NULL,
            updated_at      REAL NOT NULL,
            callback_state  TEXT,                   -- NULL (none) | pending | delivered | failed
            callback_attempts INTEGER NOT NULL DEFAULT 0,
            callback_error  TEXT
        );
        CREATE TABLE service_samples (
            task_id     TEXT NOT NULL REFERENCES service_tasks(id),
            idx         INTEGER NOT NULL,
            state       TEXT NOT NULL,              -- queued | dispatched | cancelling | finished
            stage       TEXT,                       -- the node's stage while dispatched
            status      TEXT,                       -- outcome: completed | agent_timeout | failed | cancelled
            cause       TEXT,
            node_id     TEXT,
            lease       TEXT,                       -- the current dispatch; results under another are refused
            dispatches  INTEGER NOT NULL DEFAULT 0,
            reward      REAL,
            detail      TEXT,                       -- JSON
            timings     TEXT,                       -- JSON
            weight_versions TEXT,                   -- JSON list
            session_id  TEXT,                       -- on the node that ran it
            rows        TEXT,                       -- JSON list of trajectory rows
            updated_at  REAL NOT NULL,
            PRIMARY KEY (task_id, idx)
        );
        CREATE INDEX service_samples_queue ON service_samples(state);
        CREATE TABLE service_nodes (
            id            TEXT PRIMARY KEY,
            url           TEXT,
            workers       TEXT NOT NULL DEFAULT '{}',   -- JSON
            state         TEXT NOT NULL,                -- active | draining | lost
            registered_at REAL NOT NULL,
            last_seen     REAL NOT NULL,
            stats         TEXT NOT NULL DEFAULT '{}'    -- JSON: the last heartbeat
        );
        CREATE TABLE service_state (
            key   TEXT PRIMARY KEY,
            value TEXT NOT NULL
        );
        """
    )


def m004_turns_seq(db: sqlite3.Connection) -> None:
    """An index on turns.seq: every insert computes its seq as MAX(seq) + 1 inside the INSERT (so
    writers in several processes never share one), which must not scan the table."""
    db.execute("CREATE INDEX turns_seq ON turns(seq)")


def m005_request_delta(db: sqlite3.Connection) -> None:
    """A turn's raw request may be stored as what differs from an earlier turn's request: the
    request is `request_ref`'s request cut to its first `request_head` and last `request_tail`
    characters, with `request_delta` between them (`request` is then NULL). Requests of one
    conversation grow by appending messages, so a turn costs what is new, not the whole request."""
    db.executescript(
        """
        ALTER TABLE turns ADD COLUMN request_ref TEXT REFERENCES turns(id);
        ALTER TABLE turns ADD COLUMN request_head INTEGER NOT NULL DEFAULT 0;
        ALTER TABLE turns ADD COLUMN request_tail INTEGER NOT NULL DEFAULT 0;
        ALTER TABLE turns ADD COLUMN request_delta TEXT;
        """
    )


def m006_request_zstd(db: sqlite3.Connection) -> None:
    """A turn's stored request text (`request`, or `request_delta` with a reference) may be a zstd
    frame (`request_zstd` = 1, the column then holds a BLOB), compressed with the raw content of
    `request_dict`'s full request as its dictionary (NULL: none); its `request_headers` may be
    what changed since `headers_ref`'s headers (a JSON object, removed keys as null). Rows written
    before keep 0 and NULLs and read as they did."""
    db.executescript(
        """
        ALTER TABLE turns ADD COLUMN request_zstd INTEGER NOT NULL DEFAULT 0;
        ALTER TABLE turns ADD COLUMN request_dict TEXT REFERENCES turns(id);
        ALTER TABLE turns ADD COLUMN headers_ref TEXT REFERENCES turns(id);
        """
    )


def m007_service_rows_zstd(db: sqlite3.Connection) -> None:
    """A service sample's `rows` may hold a BLOB: a zstd frame of the rows' JSON
    (`store.service.pack_rows`); text written before stays and reads as it did. And the open tasks
    in dispatch order (a partial index: queued and running tasks only), so a lease walks them from
    the first and stops at its capacity instead of sorting every queued sample."""
    db.execute(
        "CREATE INDEX service_tasks_open ON service_tasks(priority DESC, created_at, id)"
        " WHERE state IN ('queued', 'running')"
    )


def m008_logprobs_mode(db: sqlite3.Connection) -> None:
    """What a turn's logprobs are of (`polar_mitm.backends.logprobs`): `sampling` (the distribution
    the tokens were drawn from), `tempered` (after temperature, before top-k/top-p), `raw` (the
    model's, before temperature) or `logits`; NULL for turns written before, or not sampled here."""
    db.execute("ALTER TABLE turns ADD COLUMN logprobs_mode TEXT")


def m009_tool_parse(db: sqlite3.Connection) -> None:
    """What the proxy's tool parser made of a turn's output (`OutputParser.parse_status`), as
    JSON: `{"parser", "calls", "failures": [{"kind", "name", "span"}]}`; NULL where no tool parser
    read it (a request without tools, the engine's own parser, a harvested turn, an older row)."""
    db.execute("ALTER TABLE turns ADD COLUMN tool_parse TEXT")


MIGRATIONS: list[Migration] = [
    m001_initial,
    m002_rollouts,
    m003_service,
    m004_turns_seq,
    m005_request_delta,
    m006_request_zstd,
    m007_service_rows_zstd,
    m008_logprobs_mode,
    m009_tool_parse,
]


def pending(db: sqlite3.Connection) -> list[str]:
    """The migrations this database has not had (all of them for a new file); reads only."""
    known = db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = '_migrations'").fetchone()
    done = {row[0] for row in db.execute("SELECT name FROM _migrations")} if known else set()
    return [fn.__name__ for fn in MIGRATIONS if fn.__name__ not in done]


def migrate(db: sqlite3.Connection) -> list[str]:
    """Apply every migration not yet recorded; returns the names applied.

    Each migration runs in one transaction that holds SQLite's write lock from its start (BEGIN
    IMMEDIATE) and checks again, under the lock, that no other process applied it meanwhile: the
    workers of one proxy, or nodes, may open a new database file at the same moment."""
    db.execute("CREATE TABLE IF NOT EXISTS _migrations (name TEXT PRIMARY KEY, applied_at REAL NOT NULL)")
    db.commit()
    done = {row[0] for row in db.execute("SELECT name FROM _migrations")}
    applied = []
    mode = db.autocommit
    db.autocommit = True  # transactions are ours: executescript must not commit midway
    try:
        for fn in MIGRATIONS:
            if fn.__name__ in done:
                continue
            db.execute("BEGIN IMMEDIATE")
            try:
                if db.execute("SELECT 1 FROM _migrations WHERE name = ?", (fn.__name__,)).fetchone() is None:
                    fn(db)
                    db.execute("INSERT INTO _migrations VALUES (?, ?)", (fn.__name__, time.time()))
                    applied.append(fn.__name__)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
    finally:
        db.autocommit = mode
    return applied
