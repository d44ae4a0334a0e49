"""The rollout server's store at the size a trainer's step gives it: a sample's rows kept as a
zstd frame of their JSON and read back bit for bit, rows of a store written before that read as
they did, and the queries a lease and a trainer's poll make use an index, not every row."""

from __future__ import annotations

import json
import sqlite3

import numpy as np

from polar_mitm.reconstruct.trajectory import Trajectory
from polar_mitm.store.migrations import MIGRATIONS
from polar_mitm.store.service import ServiceStore, pack_rows, unpack_rows


def session_rows() -> list[dict]:
    """A row of a Claude Code session's shape (11.6k prompt tokens, 14.8k response tokens) with
    float32 logprobs at their edges."""
    rng = np.random.default_rng(0)
    lp = rng.normal(-1.0, 2.0, 14_800).astype(np.float32)
    lp[:4] = [-0.1, -1e-8, -3.4028235e38, -0.0]
    t = Trajectory(
        "t1", "s", "task", rng.integers(0, 151_000, 11_600), rng.integers(0, 151_000, 14_800),
        rng.integers(0, 2, 14_800), lp, ["t1"], "stop",
    )  # fmt: skip
    return [t.to_row()]


def test_rows_are_kept_compressed_and_come_back_bit_for_bit(tmp_path):
    rows = session_rows()
    store = ServiceStore(tmp_path / "s.sqlite")
    store.add_task("a", "{}", "{}", 0, 1, False)
    [(s, lease)] = store.lease("n", 1)
    assert store.finish_sample(
        "a", 0, lease, status="completed", cause=None, reward=1.0, rows=rows, node_id="n"
    )
    stored = store.db.execute("SELECT rows FROM service_samples").fetchone()[0]
    assert isinstance(stored, bytes) and len(stored) < len(json.dumps(rows)) / 2
    back = unpack_rows(store.samples("a")[0].rows)
    assert back == rows
    t = Trajectory.from_row(back[0])
    assert t.response_logprobs.tobytes() == np.asarray(rows[0]["response_logprobs"], np.float32).tobytes()
    assert store.samples("a", rows=False)[0].rows is None
    store.close()


def test_rows_written_before_m007_read_as_they_did(tmp_path):
    db = tmp_path / "old.sqlite"
    raw = sqlite3.connect(db)
    raw.execute("CREATE TABLE _migrations (name TEXT PRIMARY KEY, applied_at REAL NOT NULL)")
    for fn in MIGRATIONS[:6]:
        fn(raw)
        raw.execute("INSERT INTO _migrations VALUES (?, 0)", (fn.__name__,))
    rows = [{"prompt_ids": [1, 2], "response_logprobs": [-0.5, float("nan")], "metadata": "{}"}]
    raw.execute(
        "INSERT INTO service_tasks (id, request, task, state, num_samples, created_at, updated_at)"
        " VALUES ('a', '{}', '{}', 'done', 1, 0, 0)"
    )
    raw.execute(
        "INSERT INTO service_samples (task_id, idx, state, rows, updated_at) VALUES ('a', 0, 'finished', ?, 0)",
        (json.dumps(rows),),  # what the writer before m007 left: JSON text, NaN as `json` writes it
    )
    raw.commit()
    raw.close()
    store = ServiceStore(db)  # migrated on open
    back = unpack_rows(store.samples("a")[0].rows)
    assert back[0]["prompt_ids"] == [1, 2] and back[0]["response_logprobs"][0] == -0.5
    assert np.isnan(back[0]["response_logprobs"][1])
    store.close()


def test_packing_what_orjson_does_not_write():
    rows = [{"big": 2**70}]
    assert unpack_rows(pack_rows(rows)) == rows
    assert unpack_rows(None) == []


def test_a_lease_walks_the_open_tasks_in_order_not_every_queued_sample(tmp_path):
    """The bug: the lease sorted every queued sample (3 ms at 10,000, 30 at 100,000) for each
    node's call. Now its plan reads the open tasks by index and each one's samples by key."""
    store = ServiceStore(tmp_path / "s.sqlite")
    for i in range(300):
        store.add_task(f"g{i:03d}", "{}", "{}", 1 if i in (7, 250) else 0, 8, False)
    store.set_task_state("g000", "done")  # not open: never leased from, though its rows say queued
    seen: list[str] = []
    store.db.set_trace_callback(seen.append)
    got = store.lease("n", 10)
    store.db.set_trace_callback(None)
    assert [(s.task_id, s.idx) for s, _ in got] == [("g007", i) for i in range(8)] + [
        ("g250", 0),
        ("g250", 1),
    ]
    [select] = [q for q in seen if q.lstrip().startswith("SELECT")]
    plan = " | ".join(
        r[3] for r in store.db.execute("EXPLAIN QUERY PLAN " + select.replace("LIMIT 10", "LIMIT ?"), (10,))
    )
    assert "USING INDEX service_tasks_open" in plan and "(task_id=?)" in plan, plan
    assert "TEMP B-TREE FOR ORDER BY" not in plan, plan  # no sort of the whole queue
    assert [(s.task_id, s.idx) for s, _ in store.lease("n", 3)] == [("g250", i) for i in range(2, 5)]
    store.close()
