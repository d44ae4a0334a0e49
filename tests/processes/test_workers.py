"""`proxy --workers N`: a front hands each connection to the worker process of its session."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys

import httpx
import pytest

from polar_mitm.policy import PolicyConfig
from polar_mitm.proxy.embedded import ProxyConfig, ProxyStartError
from polar_mitm.proxy.workers import WorkerPool, pick, session_of
from polar_mitm.store.migrations import MIGRATIONS
from polar_mitm.store.reader import read_turns
from tests.support.harness import FakeBackend, port_of, printed_url
from tests.support.helpers import MESSAGES_URL, open_db_at_once, process_gone, stored_bytes, wait_until


def _auth(session: str, token: str = "x") -> bytes:
    return b"Basic " + base64.b64encode(f"{session}:{token}".encode())


def test_the_session_is_read_from_the_first_request_head():
    head = (
        b"CONNECT api.anthropic.com:443 HTTP/1.1\r\nHost: api.anthropic.com:443\r\nProxy-Authorization: "
        + _auth("run-7")
        + b"\r\n\r\n"
    )
    assert session_of(head) == "run-7"
    assert session_of(head.replace(b"Proxy-Authorization", b"PROXY-AUTHORIZATION")) == "run-7"
    assert session_of(b"CONNECT h:443 HTTP/1.1\r\nHost: h\r\n\r\n") is None
    assert session_of(b"CONNECT h:443 HTTP/1.1\r\nProxy-Authorization: Bearer abc\r\n\r\n") is None
    # A header after the end of the head (a body) does not count.
    assert session_of(b"POST http://h/ HTTP/1.1\r\n\r\nProxy-Authorization: " + _auth("x")) is None
    assert session_of(b"garbage") is None


def test_a_session_always_goes_to_the_same_worker_and_sessions_spread():
    names = [f"session-{i}" for i in range(200)]
    assert [pick(n, 4) for n in names] == [pick(n, 4) for n in names]
    counts = [sum(pick(n, 4) == w for n in names) for w in range(4)]
    assert min(counts) > 20, counts
    assert pick(None, 3) == pick("", 3)


def _turns(client: httpx.Client, first: str, turns: int) -> list[dict]:
    """A growing conversation: each request echoes the reply before it."""
    msgs: list[dict] = [{"role": "user", "content": first}]
    replies = []
    for i in range(turns):
        r = client.post(MESSAGES_URL, json={"model": "m", "max_tokens": 30, "messages": msgs})
        assert r.status_code == 200, r.text
        reply = r.json()
        replies.append(reply)
        msgs += [
            {"role": "assistant", "content": reply["content"]},
            {"role": "user", "content": f"and then {i}"},
        ]
    return replies


def _policy_pool(db, backend, tokenizer_dir, certs_dir) -> WorkerPool:
    """Two policy-mode workers over the fake backend, writing `db`."""
    config = ProxyConfig(
        db=str(db),
        certs_dir=certs_dir,
        policy=PolicyConfig(backend_url=backend.url, tokenizer=str(tokenizer_dir)),
    )
    return WorkerPool(config, 2)


def _proxy_argv(port, backend, tokenizer_dir, db, certs_dir) -> list[str]:
    """`polar-mitm proxy --workers 2` on `port`."""
    return [
        sys.executable,
        "-m",
        "polar_mitm",
        "proxy",
        "--workers",
        "2",
        "--listen",
        f"127.0.0.1:{port}",
    ] + [
        *("--backend", backend.url, "--tokenizer", str(tokenizer_dir)),
        *("--db", str(db), "--certs", str(certs_dir)),
    ]


@pytest.fixture
def backend(qwen_tokenizer_dir):
    b = FakeBackend(qwen_tokenizer_dir)
    yield b
    b.stop()


@pytest.mark.slow
async def test_workers_serve_every_session_on_its_own_worker(
    tmp_path, certs_dir, qwen_tokenizer_dir, backend
):
    db = tmp_path / "w.sqlite"
    pool = _policy_pool(db, backend, qwen_tokenizer_dir, certs_dir)
    await pool.start()
    sessions = [f"s{i}" for i in range(6)]
    assert {pick(s, 2) for s in sessions} == {0, 1}  # both workers get sessions
    import asyncio

    def drive(session: str) -> list[dict]:
        # A new client (so new connections) per turn: each must reach the session's worker.
        out = []
        for turn in range(3):
            with httpx.Client(
                proxy=pool.session_url(session), verify=str(certs_dir / "mitmproxy-ca-cert.pem"), timeout=60
            ) as c:
                out += _turns(c, f"{session} turn {turn}", 2)
        return out

    try:
        seen = await asyncio.gather(*(asyncio.to_thread(drive, s) for s in sessions))
    finally:
        await pool.stop()
    # One tunnel per client: 3 per session, all to the session's worker.
    expected = [3 * sum(pick(s, 2) == w for s in sessions) for w in range(2)]
    assert pool.handed == expected
    stored = list(read_turns(db))
    assert len(stored) == 6 * 3 * 2
    by_session: dict[str, list] = {}
    for t in stored:
        by_session.setdefault(t.session_id, []).append(t)
    assert sorted(by_session) == sessions
    for s, replies in zip(sessions, seen, strict=True):
        turns = sorted(by_session[s], key=lambda t: t.seq)
        assert [t.status for t in turns] == ["ok"] * 6 and all(t.output_ids for t in turns)
        # Every second turn echoes the first: it extends that turn's sequence (spliced).
        for a, b in zip(turns[::2], turns[1::2], strict=True):
            assert b.prompt_ref == a.id
            assert b.prompt_ids[: len(a.prompt_ids) + len(a.output_ids)] == a.prompt_ids + a.output_ids
        assert len(replies) == 6
    assert len({t.seq for t in stored}) == len(stored)  # two writers, one sequence


@pytest.mark.slow
async def test_a_worker_that_dies_is_started_again_and_its_sessions_go_on(
    tmp_path, certs_dir, qwen_tokenizer_dir, backend
):
    import asyncio

    db = tmp_path / "w.sqlite"
    pool = _policy_pool(db, backend, qwen_tokenizer_dir, certs_dir)
    await pool.start()

    def turn(text: str) -> None:
        with httpx.Client(
            proxy=pool.session_url("s"), verify=str(certs_dir / "mitmproxy-ca-cert.pem"), timeout=60
        ) as c:
            _turns(c, text, 1)

    try:
        await asyncio.to_thread(turn, "before")
        victim = pool._procs[pick("s", 2)]
        victim.kill()  # SIGKILL: no goodbye on its socket
        await asyncio.to_thread(victim.wait)
        await asyncio.to_thread(turn, "after")
        assert pool.restarts == 1
        assert pool._procs[pick("s", 2)] is not victim
    finally:
        await pool.stop()
    assert [t.session_id for t in read_turns(db)] == ["s", "s"]


@pytest.mark.slow
async def test_a_worker_that_cannot_start_is_one_error_and_leaves_nothing(
    tmp_path, certs_dir, qwen_tokenizer_dir, backend
):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    pool = _policy_pool(blocker / "x.sqlite", backend, qwen_tokenizer_dir, certs_dir)
    with pytest.raises(ProxyStartError, match="proxy worker 0 did not start"):
        await pool.start()
    assert all(p.poll() is not None for p in pool._procs)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _gone(pids: list[int], timeout: float) -> bool:
    return wait_until(lambda: all(process_gone(p) for p in pids), timeout, message=f"processes {pids} to end")


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL])
def test_workers_end_with_the_front(tmp_path, certs_dir, qwen_tokenizer_dir, backend, how):
    proc = subprocess.Popen(
        _proxy_argv(0, backend, qwen_tokenizer_dir, tmp_path / "w.sqlite", certs_dir),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stderr.readline()
        assert "polar-mitm proxy on" in line and "2 workers" in line, line
        port = port_of(printed_url(line))
        workers = _children(proc.pid)
        assert len(workers) == 2
        with httpx.Client(
            proxy=f"http://k:x@127.0.0.1:{port}", verify=str(certs_dir / "mitmproxy-ca-cert.pem"), timeout=60
        ) as c:
            assert len(_turns(c, "hello", 2)) == 2
        os.kill(proc.pid, how)
        proc.wait(20)
        assert _gone(workers, 20), "workers outlived the front"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert [t.session_id for t in read_turns(tmp_path / "w.sqlite")] == ["k", "k"]


@pytest.mark.slow
def test_workers_share_the_busy_port_error(tmp_path, certs_dir, qwen_tokenizer_dir, backend):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run(
            _proxy_argv(port, backend, qwen_tokenizer_dir, tmp_path / "w.sqlite", certs_dir),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert r.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_processes_that_open_a_new_database_together_all_succeed(tmp_path):
    """Workers start together on a new file: switching it to WAL and migrating it must not race."""
    import multiprocessing
    import sqlite3

    ctx = multiprocessing.get_context("spawn")
    for i in range(5):
        path = str(tmp_path / f"new-{i}.sqlite")
        barrier = ctx.Barrier(4)
        procs = [ctx.Process(target=open_db_at_once, args=(path, barrier)) for _ in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0, 0, 0, 0]
        con = sqlite3.connect(path)
        names = [r[0] for r in con.execute("SELECT name FROM _migrations ORDER BY rowid")]
        assert names == [fn.__name__ for fn in MIGRATIONS]  # each applied once, in order
        assert con.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        con.close()


@pytest.mark.slow
async def test_workers_harvest_exchanges_with_the_real_upstream(tmp_path, certs_dir, fake_provider):
    """Harvest mode behind the front: the request reaches the upstream, the exchange is stored."""
    import asyncio
    import sqlite3

    db = tmp_path / "h.sqlite"
    pool = WorkerPool(
        ProxyConfig(
            db=str(db),
            certs_dir=certs_dir,
            mode="harvest",
            upstreams={"api.anthropic.com": fake_provider.url},
            upstream_insecure=True,
        ),
        2,
    )
    await pool.start()
    body = {"model": "claude-test", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}

    def call(session: str) -> dict:
        with httpx.Client(
            proxy=pool.session_url(session), verify=str(certs_dir / "mitmproxy-ca-cert.pem"), timeout=60
        ) as c:
            r = c.post(MESSAGES_URL, json=body, headers={"x-api-key": "sk-ant-secret"})
            assert r.status_code == 200, r.text
            return r.json()

    try:
        replies = await asyncio.gather(*(asyncio.to_thread(call, s) for s in ("h0", "h1", "h2", "h3")))
    finally:
        await pool.stop()
    assert {r["content"][0]["text"] for r in replies} == {fake_provider.GREETING}
    assert sum(pool.handed) == 4
    con = sqlite3.connect(db)
    rows = con.execute(
        "SELECT t.session_id, t.status, s.mode FROM turns t JOIN sessions s ON s.id = t.session_id"
    )
    assert sorted(rows.fetchall()) == [(s, "ok", "harvest") for s in ("h0", "h1", "h2", "h3")]
    con.close()
    assert b"sk-ant-secret" not in stored_bytes(db)
