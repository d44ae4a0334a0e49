"""The store: packing, migrations, prefix references, credentials never stored."""

import asyncio
import json
import sqlite3
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar_mitm import redact
from polar_mitm.store.migrations import MIGRATIONS, migrate
from polar_mitm.store.packing import pack_ids, pack_logprobs, unpack_ids, unpack_logprobs
from polar_mitm.store.reader import read_turns
from polar_mitm.store.requests import RequestReader
from polar_mitm.store.turn import Turn
from polar_mitm.store.writer import Store


def test_ids_roundtrip():
    ids = [0, 1, 151645, 2**31 - 1, 7]
    assert unpack_ids(pack_ids(ids)) == ids
    assert len(pack_ids(ids)) == 4 * len(ids)


def test_logprobs_are_exact_in_float32_or_float64():
    f32 = [-0.5, -1.25, -0.0001220703125]
    blob = pack_logprobs(f32)
    assert blob[:1] == b"f" and unpack_logprobs(blob) == f32
    f64 = [-0.1, -2.718281828459045]  # not float32-representable
    blob = pack_logprobs(f64)
    assert blob[:1] == b"d" and unpack_logprobs(blob) == f64


def test_migrations_are_recorded_and_idempotent(tmp_path):
    db = sqlite3.connect(tmp_path / "x.sqlite")
    assert migrate(db) == [m.__name__ for m in MIGRATIONS]
    assert migrate(db) == []
    assert {r[0] for r in db.execute("SELECT name FROM _migrations")} == {m.__name__ for m in MIGRATIONS}


def test_readers_write_nothing_to_a_current_database_and_bring_an_old_one_up_to_date(tmp_path):
    from polar_mitm.store.connection import connect, init_db
    from polar_mitm.store.migrations import pending

    current = tmp_path / "current.sqlite"
    init_db(current)  # what a writer does on opening
    db = connect(current)
    assert pending(db) == []
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        db.execute("UPDATE sessions SET reward = 1")
    db.close()

    old = tmp_path / "old.sqlite"
    raw = sqlite3.connect(old)
    raw.execute("CREATE TABLE _migrations (name TEXT PRIMARY KEY, applied_at REAL NOT NULL)")
    MIGRATIONS[0](raw)
    raw.execute("INSERT INTO _migrations VALUES (?, 0)", (MIGRATIONS[0].__name__,))
    raw.commit()
    raw.close()
    db = connect(old)  # written by an older polar-mitm: migrated once, then read
    assert pending(db) == []
    db.close()


async def test_prompt_stored_as_reference_plus_suffix(tmp_path):
    path = tmp_path / "s.sqlite"
    store = await Store.open(path)
    await store.ensure_session("s1")
    t1 = Turn(
        id="t1",
        session_id="s1",
        style="anthropic",
        prompt_ids=[1, 2, 3],
        output_ids=[4, 5],
        output_logprobs=[-0.5, -0.25],
        post_hash="h1",
    )
    await store.insert_turn(t1)
    t2 = Turn(
        id="t2",
        session_id="s1",
        style="anthropic",
        prompt_ids=[1, 2, 3, 4, 5, 6, 7],
        prompt_ref="t1",
        prompt_ref_len=5,
        output_ids=[8],
        output_logprobs=[-1.0],
    )
    await store.insert_turn(t2)
    assert await store.find_by_post_hash("s1", ["nope", "h1"]) == ("t1", "h1")
    store.cache.clear()
    assert await store.sequence("t2") == ([1, 2, 3, 4, 5, 6, 7, 8], 7)
    await store.close()
    raw = sqlite3.connect(path).execute("SELECT prompt_suffix FROM turns WHERE id='t2'").fetchone()[0]
    assert unpack_ids(raw) == [6, 7]  # only the new tokens are stored
    turns = list(read_turns(path))
    assert [t.prompt_ids for t in turns] == [[1, 2, 3], [1, 2, 3, 4, 5, 6, 7]]
    assert turns[1].output_logprobs == [-1.0]


async def test_read_turns_as_arrays_holds_the_same_values_as_lists(tmp_path):
    """`read_turns(arrays=True)` (what the per-request export reads): the same ids and logprobs,
    bit for bit, also through a reference resolved from the database (not the reader's cache),
    float64 logprobs and a turn with no output."""
    import numpy as np

    path = tmp_path / "a.sqlite"
    store = await Store.open(path)
    await store.ensure_session("s1")
    turns = [
        ("t1", [1, 2, 3], None, 0, [4, 5], [-0.5, -0.25]),
        ("t2", [1, 2, 3, 4, 5, 2**31 - 1, 0], "t1", 5, [8], [-0.1]),  # -0.1: stored as float64
        ("t3", [1, 2, 3, 4, 5, 2**31 - 1, 0, 8, 9], "t2", 8, [], []),
        ("t4", [1, 2, 3, 4, 5, 2**31 - 1, 0, 8, 9, 10], "t3", 9, [11, 12], [-3.0, -0.0]),
    ]
    for i, (tid, prompt, ref, ref_len, out, lps) in enumerate(turns):
        await store.insert_turn(
            Turn(
                id=tid,
                session_id="s1",
                style="anthropic",
                created_at=100.0 + i,
                prompt_ids=prompt,
                prompt_ref=ref,
                prompt_ref_len=ref_len,
                output_ids=out,
                output_logprobs=lps,
            )
        )
    await store.close()
    for since in (None, 102.0):  # from 102: t3's reference (t2) is resolved from the database
        lists = list(read_turns(path, since=since))
        arrays = list(read_turns(path, since=since, arrays=True))
        assert [t.id for t in arrays] == [t.id for t in lists]
        for a, b in zip(arrays, lists, strict=True):
            assert a.prompt_ids.dtype == np.dtype("<i4") and a.prompt_ids.tolist() == b.prompt_ids
            assert a.output_ids.dtype == np.dtype("<i4") and a.output_ids.tolist() == b.output_ids
            assert a.output_logprobs.tolist() == b.output_logprobs
    assert arrays[0].prompt_ids.tolist() == turns[2][1] and arrays[0].output_logprobs.dtype == np.dtype("<f4")
    t2 = list(read_turns(path, arrays=True))[1]
    assert t2.output_logprobs.dtype == np.dtype("<f8") and t2.output_logprobs.tolist() == [-0.1]


async def test_two_writers_of_one_file_give_every_turn_its_own_seq(tmp_path):
    """Two processes (here two connections) writing one database: seq comes from the database,
    so their turns never share one, and each writer's turns keep their order."""
    import asyncio

    path = tmp_path / "shared.sqlite"
    a, b = await Store.open(path), await Store.open(path)

    async def write(store: Store, name: str) -> None:
        for i in range(20):
            await store.insert_turn(Turn(id=f"{name}{i:02d}", session_id=name, style="anthropic"))

    try:
        await asyncio.gather(write(a, "a"), write(b, "b"))
    finally:
        await a.close()
        await b.close()
    rows = sqlite3.connect(path).execute("SELECT seq, id FROM turns ORDER BY seq").fetchall()
    assert [seq for seq, _ in rows] == list(range(1, 41))
    for name in "ab":
        assert [i for _, i in rows if i.startswith(name)] == [f"{name}{i:02d}" for i in range(20)]


async def test_a_turn_waiting_for_another_writers_lock_never_holds_the_event_loop(tmp_path, monkeypatch):
    """Another process holds the write lock while a turn commits: the turn's commit waits in the
    store's thread, not on the loop (the loop commits small turns itself when nothing stands in
    its way), so other sessions' work goes on; the turn lands once the lock is let go. The other
    writer lets go only when the loop has run on (a loop waiting for the lock itself would wait
    for the whole busy timeout, a minute here, and the other writer would give up first)."""
    import threading

    from polar_mitm.store import writer

    monkeypatch.setattr(writer, "_BUSY_MS", 60_000)
    path = tmp_path / "locked.sqlite"
    store = await Store.open(path)
    await store.query("PRAGMA busy_timeout=60000")
    await store.insert_turn(Turn(id="before", session_id="s", style="anthropic"))  # no lock: on the loop
    holding, release = threading.Event(), threading.Event()
    let_go_for_the_loop: list[bool] = []

    def other_writer() -> None:
        db = sqlite3.connect(path, isolation_level=None)
        db.execute("BEGIN IMMEDIATE")
        holding.set()
        let_go_for_the_loop.append(release.wait(20))
        db.execute("COMMIT")
        db.close()

    holder = threading.Thread(target=other_writer)
    holder.start()
    assert holding.wait(30)
    try:
        turn = asyncio.create_task(store.insert_turn(Turn(id="during", session_id="s", style="anthropic")))
        for _ in range(20):  # the loop's other work while the turn waits
            await asyncio.sleep(0.01)
        pending = not turn.done()
        release.set()
        await turn
    finally:
        release.set()
        holder.join(30)
        await store.close()
    assert let_go_for_the_loop == [True] and pending
    rows = sqlite3.connect(path).execute("SELECT id FROM turns ORDER BY seq").fetchall()
    assert rows == [("before",), ("during",)]


async def test_the_wal_is_checkpointed_in_the_stores_thread_not_on_commit(tmp_path):
    """Commits (the loop's included) never checkpoint; every CHECKPOINT_BYTES written, the
    store's thread does, so the WAL stays bounded."""
    path = tmp_path / "wal.sqlite"
    store = await Store.open(path)
    store.CHECKPOINT_BYTES = 256 * 1024
    big = "x" * 30_000  # plain text: what the store compresses is written much smaller
    try:
        assert (await store.query("PRAGMA wal_autocheckpoint"))[0][0] == 0
        for i in range(40):
            await store.insert_turn(
                Turn(id=f"t{i}", session_id="s", style="anthropic", response=big + str(i))
            )
        await store.query("SELECT 1")  # after the thread's queued checkpoint
        wal = (tmp_path / "wal.sqlite-wal").stat().st_size
    finally:
        await store.close()
    # ~1.2 MB written: a WAL never checkpointed would hold all of it; checkpointed every 256 KB,
    # SQLite starts it over from the top and it stays near that.
    assert 256 * 1024 < wal < 600 * 1024, wal
    assert sqlite3.connect(path).execute("SELECT count(*) FROM turns").fetchone()[0] == 40


@pytest.mark.parametrize(
    "name", ["Authorization", "x-api-key", "X-Goog-Api-Key", "Cookie", "Proxy-Authorization", "api-key"]
)
def test_credential_headers_are_redacted(name):
    out = redact.headers([(name, "sk-secret-123"), ("anthropic-version", "2023-06-01")])
    assert "sk-secret-123" not in repr(out)
    assert out["anthropic-version"] == "2023-06-01"


def test_credential_query_params_are_redacted():
    u = redact.url("/v1beta/models/x:generateContent?alt=sse&key=AIzaSECRET&access_token=abc")
    assert "AIzaSECRET" not in u and "abc" not in u and "alt=sse" in u


def _claude_code_request(messages: list, system: str, *, model: str = "claude-sonnet-4-5") -> str:
    # Claude Code's shape: the messages come before the system prompt and tools, and the newest
    # user message carries the cache marker (so an earlier message changes when the next arrives).
    msgs = [dict(m) for m in messages]
    if msgs and msgs[-1]["role"] == "user":
        msgs[-1] = {
            **msgs[-1],
            "content": [
                {"type": "text", "text": msgs[-1]["content"], "cache_control": {"type": "ephemeral"}}
            ],
        }
    tools = [
        {"name": f"Tool{i}", "description": "does a thing " * 40, "input_schema": {"type": "object"}}
        for i in range(12)
    ]
    body = {
        "model": model,
        "messages": msgs,
        "system": [{"type": "text", "text": system}],
        "tools": tools,
        "max_tokens": 32000,
        "stream": True,
    }
    return json.dumps(body, ensure_ascii=False)


async def test_requests_are_stored_as_what_changed_and_read_back_byte_identical(tmp_path):
    """A Claude Code session: growing turns, a title side call, a compacted (non-extending)
    request, a retry of the same request, text with non-ASCII; every reader gets each request
    back exactly, and an extending turn stores a small part of its request."""
    from polar_mitm.store.queries import text_turns, text_turns_by_id

    path = tmp_path / "s.sqlite"
    store = await Store.open(path)
    await store.ensure_session("s1")
    system = "You are Claude Code. " * 400
    messages: list = [{"role": "user", "content": "fix the bug in parser.py — ünïcödé ✓"}]
    sent: dict[str, str] = {}
    prev = None
    for i in range(12):
        if i == 7:  # compaction: a new, shorter conversation (not an extension of the last one)
            messages = [{"role": "user", "content": "Summary of the conversation so far: " + "x" * 3000}]
            prev = None
        req = _claude_code_request(messages, system)
        tid = f"t{i:02d}"
        await store.insert_turn(
            Turn(
                id=tid,
                session_id="s1",
                style="anthropic",
                path="/v1/messages",
                prompt_ids=[1, 2],
                output_ids=[3],
                output_logprobs=[-0.5],
                request=req,
                response='{"r": 1}',
                prompt_ref=prev,
            )
        )
        sent[tid] = req
        prev = tid
        if i == 3:  # a title side call: another system prompt, another tag
            side = _claude_code_request(
                [{"role": "user", "content": "Please write a 5-10 word title"}],
                "Summarize this coding conversation",
                model="claude-haiku",
            )
            await store.insert_turn(
                Turn(
                    id="side",
                    session_id="s1",
                    style="anthropic",
                    tag="title",
                    path="/v1/messages",
                    request=side,
                    response="{}",
                )
            )
            sent["side"] = side
        if i == 5:  # the same request sent again (a retry)
            await store.insert_turn(
                Turn(
                    id="retry",
                    session_id="s1",
                    style="anthropic",
                    path="/v1/messages",
                    prompt_ids=[1],
                    request=req,
                    response="{}",
                    status="error",
                )
            )
            sent["retry"] = req
        messages = messages + [
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": f"tu{i}", "name": "Read", "input": {"f": i}}],
            },
            {"role": "user", "content": f"result {i}: " + "line of the file\n" * (20 + i)},
        ]
    harvested = '{"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}'
    await store.insert_turn(Turn(id="h", session_id="s1", style="gemini", request=harvested, response="{}"))
    sent["h"] = harvested
    await store.close()

    con = sqlite3.connect(path)
    # Characters of request text each row holds (before compression: this is about references).
    reader = RequestReader(con)
    stored = {tid: len(reader.stored_text(tid)) for (tid,) in con.execute("SELECT id FROM turns")}
    refs = dict(con.execute("SELECT id, request_ref FROM turns"))
    con.close()
    assert refs["t00"] is None and refs["side"] is None  # nothing earlier of their kind
    assert refs["t07"] == "t06" and stored["t07"] > 3000  # the compaction shares system and tools only
    assert refs["t06"] == "t05" and refs["retry"] == "t05" and stored["retry"] == 0
    for i in (1, 2, 3, 4, 5, 6, 8, 9, 10, 11):
        assert stored[f"t{i:02d}"] < len(sent[f"t{i:02d}"]) / 5, i

    for got in (
        {t.id: t.request for t in read_turns(path, with_raw=True, include_text_only=True)},
        {t.id: t.request for t in text_turns(path, "s1")},
        {t.id: t.request for t in text_turns(path, "s1", newest_first=True)},
        {t.id: t.request for t in text_turns_by_id(path, ["t11", "t03", "retry", "t09"])},
    ):
        assert got == {k: sent[k] for k in got}
        assert all(got[k].encode() == sent[k].encode() for k in got)
    assert len({t.id for t in read_turns(path, with_raw=True, include_text_only=True)}) == len(sent)


@pytest.mark.parametrize("seed", range(40))
def test_a_request_diffed_against_any_other_comes_back_exactly(seed):
    import random

    from polar_mitm.store import deltas

    rng = random.Random(seed)
    alphabet = 'ab{}"é✓\U0001f600'
    ref = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 9000)))
    cut = rng.randrange(0, len(ref) + 1)
    kind = seed % 4
    if kind == 0:  # appended
        text = ref + "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 50)))
    elif kind == 1:  # inserted in the middle
        text = ref[:cut] + "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 5000))) + ref[cut:]
    elif kind == 2:  # cut short
        text = ref[:cut]
    else:  # unrelated
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 9000)))
    d = deltas.diff(ref, text)
    assert d.head + d.tail <= min(len(ref), len(text))
    assert deltas.apply(ref, d.head, d.tail, d.middle) == text


async def test_a_turn_reads_back_as_it_was_written(tmp_path):
    """One row model: the fields `read_turns` fills come back equal to what was written."""
    db = tmp_path / "t.sqlite"
    store = await Store.open(db)
    await store.ensure_session("s", task_id="task-1")
    written = Turn(
        id="t1",
        session_id="s",
        style="anthropic",
        model="m",
        tag="main",
        status="ok",
        finish_reason="stop",
        prompt_ids=[1, 2, 3],
        output_ids=[4, 5],
        output_logprobs=[-0.5, -0.25],
        weight_version="v7",
        logprobs_mode="sampling",
        request='{"messages": []}',
        response='{"text": "hi"}',
    )
    await store.insert_turn(written)
    await store.close()
    (read,) = read_turns(db, with_raw=True)
    filled = (
        "id session_id created_at style model tag status finish_reason prompt_ids output_ids"
        " output_logprobs prompt_ref prompt_ref_len weight_version logprobs_mode request response"
    ).split()
    assert {k: getattr(read, k) for k in filled} == {k: getattr(written, k) for k in filled}
    assert read.seq == 1 and read.task_id == "task-1"


def test_a_turn_that_begins_the_next_one_is_kept_as_a_view_of_it():
    from polar_mitm.store.sequences import SequenceCache

    cache = SequenceCache(compact=True, hot_tokens=1_000)
    first = list(range(100, 140))
    cache.put("t1", first, 30)
    second = first + [7, 8, 9]
    cache.put("t2", second, 41, parent=("t1", len(first)))
    assert "t1" not in cache.hot and cache.hot_size == len(second)  # one sequence for both
    assert cache.get("t1") == (first, 30) and cache.get("t2") == (second, 41)
    # Spliced from part of it only (the harness changed the reply): no view.
    cache.put("t3", first[:35] + [1, 2], 36, parent=("t2", 35))
    assert "t2" in cache.hot and cache.get("t2") == (second, 41)
    # What the caller says is checked against the ids.
    cache.put("t4", [0] + second[1:] + [5], 43, parent=("t2", len(second)))
    assert "t2" in cache.hot
    # The sequence a view points to leaves the cache: the view answers nothing (the store reads).
    cache.hot.pop("t2")
    cache.hot_size -= len(second)
    assert cache.get("t1") is None and "t1" not in cache.views


def test_the_hot_tier_keeps_what_is_asked_for_and_takes_back_what_is_asked_for_again():
    """A conversation's sequence that every retry of its turn splices onto stays a list while
    the retries' own sequences fill the hot tier; one that left it comes back when asked for."""
    from array import array

    from polar_mitm.store.sequences import SequenceCache

    cache = SequenceCache(compact=True, hot_tokens=100)
    base = list(range(1000, 1040))
    cache.put("base", base, 30)
    for i in range(6):  # retries: 40 tokens each, the hot tier holds 100
        assert cache.get("base") == (base, 30)
        cache.put(f"retry{i}", base[:35] + [i] * 5, 35)
    assert "base" in cache.hot and isinstance(cache.items["retry0"][0], array)
    assert cache.hot_size <= 100
    # Cold, then asked for: the same ids, as a list, hot again (and the least recently used out).
    assert cache.get("retry0") == (base[:35] + [0] * 5, 35)
    assert "retry0" in cache.hot and "retry0" not in cache.items
    assert cache.hot_size <= 100 and cache.size == sum(len(s) for s, _ in cache.items.values())
    for t in [*cache.items, *cache.hot]:  # every one reads back exactly, wherever it is now
        assert cache.get(t) == ((base, 30) if t == "base" else (base[:35] + [int(t[-1])] * 5, 35))


def test_answers_to_the_same_prompt_are_kept_as_branches_of_the_conversation():
    from polar_mitm.store.sequences import SequenceCache

    cache = SequenceCache(compact=True, hot_tokens=1_000)
    first = list(range(100, 140))
    cache.put("t1", first, 30)
    second = first + [7, 8, 9]
    cache.put("t2", second, 41, parent=("t1", len(first)))  # t1 a view of t2
    for i in range(3):  # t2's prompt again: each answer spliced onto all of t1
        cache.put(f"r{i}", first + [i] * 4, 41, parent=("t1", len(first)))
        assert f"r{i}" in cache.branches and f"r{i}" not in cache.hot
    assert cache.hot_size == len(second) and cache.branch_size == 12
    assert [cache.get(f"r{i}") for i in range(3)] == [(first + [i] * 4, 41) for i in range(3)]
    assert cache.get("t1") == (first, 30) and cache.get("t2") == (second, 41)
    # What the caller says is checked against the ids: a sequence that does not begin with it.
    cache.put("bad", [0] + first[1:] + [5], 41, parent=("t1", len(first)))
    assert "bad" in cache.hot and cache.get("bad") == ([0] + first[1:] + [5], 41)
    # The sequence it branched from leaves the cache: the branch answers nothing (the store reads).
    cache.hot.pop("t2")
    cache.hot_size -= len(second)
    assert cache.get("r0") is None and "r0" not in cache.branches


async def test_an_earlier_turn_of_a_conversation_reads_back_exactly(tmp_path):
    """Turns kept as views, turns evicted, and the database agree on every sequence."""
    db = tmp_path / "v.sqlite"
    store = await Store.open(db)
    store.cache = type(store.cache)(compact=True, hot_tokens=300, max_tokens=400)
    seq: list[int] = []
    prev = None
    want = {}
    for i in range(12):
        prompt = seq + [1000 + i] * 7
        out = [2000 + i] * 5
        await store.insert_turn(
            Turn(
                id=f"t{i}",
                session_id="s",
                style="anthropic",
                prompt_ids=prompt,
                prompt_ref=prev,
                prompt_ref_len=len(seq) if prev else 0,
                output_ids=out,
                output_logprobs=[-0.5] * 5,
            )
        )
        seq, prev = prompt + out, f"t{i}"
        want[prev] = (seq, len(prompt))
    assert store.cache.views  # earlier turns became views
    for tid, (ids, plen) in want.items():
        assert await store.sequence(tid) == (ids, plen)
    await store.close()
    fresh = await Store.open(db)  # nothing cached: everything from the database
    for tid, (ids, plen) in want.items():
        assert await fresh.sequence(tid) == (ids, plen)
    await fresh.close()


async def test_a_write_is_one_transaction_rolled_back_whole_when_a_statement_fails(tmp_path):
    store = await Store.open(tmp_path / "w.sqlite")
    try:
        await store.ensure_session("s")
        with pytest.raises(sqlite3.IntegrityError):
            await store.write(
                ("UPDATE sessions SET reward = 1.5 WHERE id = ?", ("s",)),
                ("INSERT INTO sessions (id, created_at) VALUES (?, ?)", ("s", 0.0)),  # the id exists
            )
        assert await store.query("SELECT reward FROM sessions WHERE id = ?", ("s",)) == [(None,)]
        # The connection is usable after it, and concurrent writes are each committed.
        await asyncio.gather(*(store.ensure_session(f"t{i}") for i in range(20)))
        assert (await store.query("SELECT count(*) FROM sessions"))[0][0] == 21
    finally:
        await store.close()
    seen = sqlite3.connect(tmp_path / "w.sqlite").execute("SELECT count(*) FROM sessions").fetchone()[0]
    assert seen == 21  # durable: another connection reads them after close


# ---- request text compressed, headers as what changed (m006) ------------------------------------

FIXTURE = Path(__file__).resolve().parents[2] / "bench" / "fixtures" / "claude_code_session.jsonl.zst"


def _captured_turns() -> list[dict]:
    """The captured real Claude Code session (bench/capture_session.py), one dict per turn."""
    from polar_mitm.store.requests import zstd

    return [json.loads(line) for line in zstd.decompress(FIXTURE.read_bytes()).decode().splitlines() if line]


async def _replay(path, turns: list[dict], **store_kw) -> None:
    store = await Store.open(path, **store_kw)
    try:
        for t in turns:
            fields = {k: v for k, v in t.items() if k not in ("prompt_suffix", "prompt_len")}
            base = (
                (await store.sequence(t["prompt_ref"]))[0][: t["prompt_ref_len"]] if t["prompt_ref"] else []
            )
            await store.insert_turn(Turn(**fields, prompt_ids=base + t["prompt_suffix"]))
    finally:
        await store.close()


def _reads(path) -> dict[str, tuple]:
    """Each turn's request, headers (and their order) and ids, through every reader."""
    from polar_mitm.store.queries import text_turns, turn_facts

    out = {}
    for t in read_turns(path, with_raw=True, include_text_only=True):
        out[t.id] = (t.request, t.request_headers, list(t.request_headers), t.prompt_ids, t.output_ids)
    sessions = {sid for (sid,) in sqlite3.connect(path).execute("SELECT DISTINCT session_id FROM turns")}
    for sid in sessions:
        for t in text_turns(path, sid):
            assert t.request == out[t.id][0]
        for f in turn_facts(path, session=sid):
            assert json.loads(f.request_headers) == out[f.id][1]
            assert list(json.loads(f.request_headers)) == out[f.id][2]
    return out


async def test_a_real_claude_code_session_costs_at_most_twice_its_minimum(tmp_path):
    """Issue 21's goal on the captured session: the turns' own pages ≤ 2 × (zstd of the last
    request + 4 B per unique prompt token + 8 B per sampled token); before m006 it was above."""
    import pyarrow as pa

    turns = _captured_turns()
    last = max(turns, key=lambda t: t["prompt_len"])["request"].encode()
    minimum = (
        len(pa.compress(last, codec="zstd", asbytes=True))
        + 4 * sum(len(t["prompt_suffix"]) for t in turns)
        + 8 * sum(len(t["output_ids"]) for t in turns)
    )

    def pages(path) -> int:
        db = sqlite3.connect(path)
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        (n,) = db.execute(
            "SELECT SUM(pgsize) FROM dbstat WHERE name = 'turns' OR name IN"
            " (SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'turns')"
        ).fetchone()
        db.close()
        return n

    await _replay(tmp_path / "before.sqlite", turns, compress=False)
    await _replay(tmp_path / "after.sqlite", turns)
    before, after = pages(tmp_path / "before.sqlite"), pages(tmp_path / "after.sqlite")
    # Before m006 this session's pages were 2.01× its minimum (1.98× since m007 added a column:
    # SQLite's pages fill differently); now 1.40×.
    assert before > 1.9 * minimum and after <= 2 * minimum and after < 0.8 * before, (before, after, minimum)
    got = _reads(tmp_path / "after.sqlite")
    assert got == _reads(tmp_path / "before.sqlite")
    for t in turns:
        assert got[t["id"]][:3] == (t["request"], t["request_headers"], list(t["request_headers"]))
    con = sqlite3.connect(tmp_path / "after.sqlite")
    zstd_rows, dict_rows, header_refs = con.execute(
        "SELECT SUM(request_zstd), COUNT(request_dict), COUNT(headers_ref) FROM turns"
    ).fetchone()
    con.close()
    assert zstd_rows == len(turns) and dict_rows == len(turns) - 1 and header_refs == len(turns) - 1


async def test_a_store_written_before_m006_opens_and_reads_identically(tmp_path):
    """An old store (schema up to m005, rows as that writer left them: text plain, headers whole)
    is migrated by its first reader and reads back exactly what a new store of the same turns does."""
    turns = _captured_turns()[:8]
    await _replay(tmp_path / "plain.sqlite", turns, compress=False)
    await _replay(tmp_path / "new.sqlite", turns)
    old = tmp_path / "old.sqlite"
    raw = sqlite3.connect(old)
    raw.execute("CREATE TABLE _migrations (name TEXT PRIMARY KEY, applied_at REAL NOT NULL)")
    for fn in MIGRATIONS[:5]:
        fn(raw)
        raw.execute("INSERT INTO _migrations VALUES (?, 0)", (fn.__name__,))
    assert MIGRATIONS[5].__name__ == "m006_request_zstd"
    columns = [r[1] for r in raw.execute("PRAGMA table_info(turns)")]
    assert "request_zstd" not in columns
    raw.execute("ATTACH DATABASE ? AS plain", (str(tmp_path / "plain.sqlite"),))
    raw.execute("INSERT INTO sessions SELECT * FROM plain.sessions")
    raw.execute(f"INSERT INTO turns ({', '.join(columns)}) SELECT {', '.join(columns)} FROM plain.turns")
    raw.commit()
    raw.execute("DETACH DATABASE plain")
    raw.close()
    got = _reads(old)
    assert got == _reads(tmp_path / "new.sqlite")
    assert {tid: v[:3] for tid, v in got.items()} == {
        t["id"]: (t["request"], t["request_headers"], list(t["request_headers"])) for t in turns
    }


_header_names = st.sampled_from(["accept", "x-request-id", "content-length", "user-agent", "x-a", "x-b"])
_headers = st.dictionaries(_header_names, st.text(max_size=40), max_size=6)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    calls=st.lists(
        st.tuples(
            st.sampled_from(["s1", "s2"]), st.sampled_from([None, "title"]), st.text(max_size=300), _headers
        ),
        min_size=1,
        max_size=12,
    ),
    system=st.text(min_size=0, max_size=2000),
)
def test_requests_and_headers_read_back_as_written(tmp_path_factory, calls, system):
    """Any sequence of requests (sharing a session's system prompt, as a harness's do, or not)
    and headers, written by the store, reads back the same text and the same headers in the
    same order through every reader."""
    path = tmp_path_factory.mktemp("prop") / "runs.sqlite"
    sent: dict[str, tuple] = {}
    history: dict[str, str] = {}

    async def write() -> None:
        # Room for about one session's dictionary: the other's is dropped and picked again.
        store = await Store.open(path, dict_chars=3000)
        try:
            for i, (session, tag, text, headers) in enumerate(calls):
                history[session] = history.get(session, system) + text
                req = history[session] if tag is None else text + system
                tid = f"t{i:02d}"
                await store.insert_turn(
                    Turn(
                        id=tid,
                        session_id=session,
                        style="anthropic",
                        tag=tag,
                        path="/v1/messages",
                        request=req,
                        request_headers=headers,
                        response="{}",
                    )
                )
                sent[tid] = (req, headers, list(headers))
        finally:
            await store.close()

    asyncio.run(write())
    got = _reads(path)
    assert {tid: v[:3] for tid, v in got.items()} == sent
    con = sqlite3.connect(path)
    for column in ("request_dict", "headers_ref", "request_ref"):  # a session's own turns only
        crossed = f"SELECT COUNT(*) FROM turns t JOIN turns r ON r.id = t.{column} WHERE r.session_id != t.session_id"
        assert con.execute(crossed).fetchone() == (0,)
    con.close()


async def test_a_credential_in_a_compressed_request_is_still_found_by_the_leak_checks(tmp_path):
    """The tests that look for a secret in the store's bytes read through the readers
    (`stored_bytes`): compressed, a secret in a request's text does not show in the file."""
    from tests.support.helpers import stored_bytes

    path = tmp_path / "runs.sqlite"
    secret = "sk-ant-api03-leaked-0123456789"
    body = json.dumps({"messages": [{"role": "user", "content": f"my key is {secret}, " + "pad " * 60}]})
    store = await Store.open(path)
    await store.insert_turn(Turn(id="t1", session_id="s", style="anthropic", request=body, response="{}"))
    await store.close()
    raw = b"".join(p.read_bytes() for p in sorted(tmp_path.glob("runs.sqlite*")))
    assert secret.encode() not in raw  # what a raw scan sees: nothing
    assert secret.encode() in stored_bytes(path)
