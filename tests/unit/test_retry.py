"""polar_mitm.retry: tries until success or `attempts`, pauses that grow to a cap, failures it
must not retry raised at once, and a give-up that is always logged before it is raised."""

import asyncio
import logging
import sqlite3
import threading
import time

import pytest

from polar_mitm.retry import Backoff, delays
from polar_mitm.store.connection import connect_wal


def retry(fn, **kw):
    return Backoff(**kw).call(fn)


def retry_async(fn, **kw):
    return Backoff(**kw).call_async(fn)


class Flaky:
    """Fails `fails` times with `error`, then returns "ok"; counts its calls and their times."""

    def __init__(self, fails: int, error: Exception):
        self.fails, self.error, self.calls = fails, error, []

    def __call__(self) -> str:
        self.calls.append(time.monotonic())
        if len(self.calls) <= self.fails:
            raise self.error
        return "ok"


def test_pauses_grow_to_the_cap():
    d = delays(0.5, 2.0, 3.0)
    assert [next(d) for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_a_flaky_call_succeeds_with_the_pauses_between(caplog):
    f = Flaky(2, OSError("refused"))
    with caplog.at_level(logging.WARNING, "polar_mitm.retry"):
        assert retry(f, what="posting", attempts=3, first=0.05, retry_on=(OSError,)) == "ok"
    assert len(f.calls) == 3
    assert f.calls[1] - f.calls[0] >= 0.05 and f.calls[2] - f.calls[1] >= 0.1
    assert "giving up" not in caplog.text
    assert caplog.text.count("posting failed (attempt") == 2


def test_the_give_up_is_logged_and_raised(caplog):
    f = Flaky(9, OSError("refused"))
    seen = []
    with caplog.at_level(logging.WARNING, "polar_mitm.retry"), pytest.raises(OSError, match="refused"):
        retry(
            f,
            what="posting",
            attempts=3,
            first=0.01,
            retry_on=(OSError,),
            on_retry=lambda n, e: seen.append(n),
        )
    assert len(f.calls) == 3 and seen == [1, 2]
    assert "posting: giving up after 3 attempts: refused" in caplog.text


def test_what_is_not_retried_is_raised_at_once():
    f = Flaky(9, ValueError("bad"))
    with pytest.raises(ValueError):
        retry(f, what="x", attempts=5, first=0.01, retry_on=(OSError,))
    g = Flaky(9, OSError("permission denied"))
    with pytest.raises(OSError):
        retry(g, what="x", attempts=5, first=0.01, retry_on=(OSError,), when=lambda e: "locked" in str(e))
    assert len(f.calls) == 1 and len(g.calls) == 1


def test_async_retries_and_leaves_cancellation_alone():
    f = Flaky(1, TimeoutError())

    async def call() -> str:
        return f()

    assert asyncio.run(retry_async(call, what="x", attempts=2, first=0.01, retry_on=(TimeoutError,))) == "ok"

    async def cancelled() -> None:
        async def hang() -> None:
            await asyncio.sleep(60)

        t = asyncio.create_task(retry_async(hang, what="x", attempts=5, first=0.01))
        await asyncio.sleep(0.05)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t

    asyncio.run(cancelled())


def test_a_store_opened_while_another_holds_the_wal_switch_waits_for_it(tmp_path):
    """The sync variant at its real call site: a new file whose WAL switch is blocked by another
    connection's exclusive lock for a moment opens once the lock is gone."""
    path = tmp_path / "s.sqlite"
    holder = sqlite3.connect(str(path), check_same_thread=False)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN EXCLUSIVE")
    threading.Timer(0.3, holder.rollback).start()
    t0 = time.monotonic()
    db = connect_wal(path, timeout=0)  # no busy wait of sqlite's own: the retry waits
    assert time.monotonic() - t0 >= 0.25
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    db.close()
    holder.close()


async def test_a_report_the_server_never_takes_is_given_up_in_the_log(tmp_path, caplog, monkeypatch):
    """A node whose server is gone tries its report again, then says that it dropped it (it
    used to stop trying without a word)."""
    import socket

    import aiohttp

    from polar_mitm import api
    from polar_mitm.service import node as node_module

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(node_module, "REPORT_ATTEMPTS", 2, raising=False)
    config = node_module.NodeConfig(
        server=f"http://127.0.0.1:{port}", node_token="x", db=str(tmp_path / "n.sqlite"), work_dir=tmp_path
    )
    gw = node_module.GatewayNode(config)
    gw._http = aiohttp.ClientSession()
    try:
        with caplog.at_level(logging.WARNING):
            await gw._send(api.SampleResult(task_id="t1", index=0, lease="l1", status="completed"))
    finally:
        await gw._http.close()
    assert "reporting t1#0: giving up after 2 attempts" in caplog.text
