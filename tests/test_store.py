"""The store: packing, migrations, prefix references, credentials never stored."""

import sqlite3

import pytest

from polar_mitm import redact
from polar_mitm.store.db import Store, TurnRecord, read_turns
from polar_mitm.store.migrations import MIGRATIONS, migrate
from polar_mitm.store.packing import pack_ids, pack_logprobs, unpack_ids, unpack_logprobs


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
    from polar_mitm.store.db import connect, init_db
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
    t1 = TurnRecord(
        id="t1",
        session_id="s1",
        style="anthropic",
        prompt_ids=[1, 2, 3],
        output_ids=[4, 5],
        output_logprobs=[-0.5, -0.25],
        post_hash="h1",
    )
    await store.insert_turn(t1)
    t2 = TurnRecord(
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
    store.cache.items.clear()
    assert await store.sequence("t2") == ([1, 2, 3, 4, 5, 6, 7, 8], 7)
    await store.close()
    raw = sqlite3.connect(path).execute("SELECT prompt_suffix FROM turns WHERE id='t2'").fetchone()[0]
    assert unpack_ids(raw) == [6, 7]  # only the new tokens are stored
    turns = list(read_turns(path))
    assert [t.prompt_ids for t in turns] == [[1, 2, 3], [1, 2, 3, 4, 5, 6, 7]]
    assert turns[1].output_logprobs == [-1.0]


async def test_two_writers_of_one_file_give_every_turn_its_own_seq(tmp_path):
    """Two processes (here two connections) writing one database: seq comes from the database,
    so their turns never share one, and each writer's turns keep their order."""
    import asyncio

    path = tmp_path / "shared.sqlite"
    a, b = await Store.open(path), await Store.open(path)

    async def write(store: Store, name: str) -> None:
        for i in range(20):
            await store.insert_turn(TurnRecord(id=f"{name}{i:02d}", session_id=name, style="anthropic"))

    try:
        await asyncio.gather(write(a, "a"), write(b, "b"))
    finally:
        await a.close()
        await b.close()
    rows = sqlite3.connect(path).execute("SELECT seq, id FROM turns ORDER BY seq").fetchall()
    assert [seq for seq, _ in rows] == list(range(1, 41))
    for name in "ab":
        assert [i for _, i in rows if i.startswith(name)] == [f"{name}{i:02d}" for i in range(20)]


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
