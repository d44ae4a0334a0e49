"""A hung engine, as a real process: `polar-mitm fake-backend` SIGSTOPped behind a `polar-mitm
proxy` process at its default liveness settings. A request fails within 30 s whatever the turn
was doing when the engine stopped (before its first turn, mid-stream), with an error that says
the engine is hung; SIGTERM to the proxy while a turn waits on the stopped engine exits within
5 s, with that turn stored. And the gateway's discovery of an engine that hangs before anyone
asked it (no preflight): bounded by --engine-dead-after, said as a timeout, not asked again by
the next turn."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from polar_mitm.policy import PolicyConfig
from tests.support.harness import FakeBackend, Lines, proxy_process
from tests.support.helpers import MESSAGES_URL

pytestmark = pytest.mark.slow

# A reply long enough to be stopped in the middle of (0.05 s a token: several seconds).
LONG = " ".join(f"word{i}" for i in range(300))


@contextmanager
def engine(tokenizer: Path, tmp: Path):
    """A fake engine process that streams a long reply to "talk", SIGCONTed before it is stopped."""
    script = tmp / "script.json"
    script.write_text(json.dumps([{"match": "talk", "text": LONG}]))
    fake = FakeBackend(tokenizer, "--token-delay", "0.05", "--script", str(script))
    try:
        yield fake
    finally:
        os.kill(fake.proc.pid, signal.SIGCONT)
        fake.stop()


def proxy(fake: FakeBackend, tokenizer: Path, certs: Path, db: Path):
    """`polar-mitm proxy` in front of `fake` with the default liveness settings."""
    return proxy_process(fake.url, tokenizer, certs, db)


def drained(lines: Lines) -> list[str]:
    """Every line the process wrote, once it has closed its output."""
    try:
        while True:
            lines.next(10)
    except AssertionError:
        return lines.seen


def body(text: str, stream: bool = False) -> dict:
    return {
        "model": "m",
        "max_tokens": 400,
        "stream": stream,
        "messages": [{"role": "user", "content": text}],
    }


def test_defaults_say_a_hung_engine_fails_a_turn_within_30_s():
    cfg = PolicyConfig()
    # The watch's own budget, and the ping interval it is checked at.
    assert cfg.engine_dead_after + cfg.ping_interval <= 30 - 3


def test_an_engine_stopped_before_the_first_turn_fails_it_within_30_s_as_hung(
    tmp_path, qwen_tokenizer_dir, certs_dir
):
    with (
        engine(qwen_tokenizer_dir, tmp_path) as fake,
        proxy(fake, qwen_tokenizer_dir, certs_dir, tmp_path / "p.db") as (_, client, _),
    ):
        os.kill(fake.proc.pid, signal.SIGSTOP)  # after the preflight, before any turn
        t0 = time.monotonic()
        r = client.post(MESSAGES_URL, json=body("hi"))
        took = time.monotonic() - t0
        assert r.status_code == 529, r.text
        message = r.json()["error"]["message"]
        # The preflight's model info was kept: the turn went straight to the engine and its
        # liveness watch, rather than first asking for the info again (and waiting on that).
        assert "failed its health check (/health_generate)" in message and "hung" in message, message
        assert took <= 30, took


def test_an_engine_stopped_mid_stream_fails_the_turn_within_30_s_as_hung(
    tmp_path, qwen_tokenizer_dir, certs_dir
):
    db = tmp_path / "p.db"
    with (
        engine(qwen_tokenizer_dir, tmp_path) as fake,
        proxy(fake, qwen_tokenizer_dir, certs_dir, db) as (_, client, _),
    ):
        lines: list[str] = []
        stopped_at = None
        with client.stream("POST", MESSAGES_URL, json=body("please talk a while", stream=True)) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                lines.append(line)
                if stopped_at is None and line.startswith("event: content_block_delta"):
                    os.kill(fake.proc.pid, signal.SIGSTOP)
                    stopped_at = time.monotonic()
        took = time.monotonic() - stopped_at
        assert stopped_at is not None
        errors = [json.loads(x[len("data: ") :]) for x in lines if x.startswith("data: ") and '"error"' in x]
        assert errors and "hung" in errors[-1]["error"]["message"], lines[-5:]
        assert not any("message_stop" in x for x in lines)
        assert took <= 30, took
    status, output_len = sqlite3.connect(db).execute("SELECT status, output_len FROM turns").fetchone()
    assert status == "error" and output_len > 0  # the tokens sampled before the engine stopped


def test_sigterm_while_a_turn_waits_on_a_stopped_engine_exits_within_5_s_with_the_turn_stored(
    tmp_path, qwen_tokenizer_dir, certs_dir
):
    db = tmp_path / "p.db"
    with (
        engine(qwen_tokenizer_dir, tmp_path) as fake,
        proxy(fake, qwen_tokenizer_dir, certs_dir, db) as (proc, client, err),
    ):
        with client.stream("POST", MESSAGES_URL, json=body("please talk a while", stream=True)) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("event: content_block_delta"):
                    break
            os.kill(fake.proc.pid, signal.SIGSTOP)
            time.sleep(1)  # the turn now waits on the stopped engine, the client still reading
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
            took = time.monotonic() - t0
        assert took <= 5, took
        assert proc.returncode == 0, err.seen
        rest = "\n".join(drained(err))
        for bad in ("could not record", "Unclosed client session", "Task was destroyed", "Traceback"):
            assert bad not in rest, rest
    rows = sqlite3.connect(db).execute("SELECT status, output_len FROM turns").fetchall()
    assert len(rows) == 1 and rows[0][0] in ("aborted", "error") and rows[0][1] > 0, rows


@contextmanager
def stopped(fake: FakeBackend):
    os.kill(fake.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(fake.proc.pid, signal.SIGCONT)


@pytest.mark.parametrize("api", ["sglang", "vllm"])
async def test_discovery_of_an_engine_hung_before_anyone_asked_it_is_bounded_said_and_not_asked_per_turn(
    tmp_path, qwen_tokenizer_dir, api
):
    """No preflight handed the info over (the gateway alone): the first turn asks the engine for
    it, within --engine-dead-after in all, and says the engine did not answer (not that it is no
    vLLM); the next turn gets that error at once instead of asking again; after the pause, and
    the engine back, a turn is served."""
    from aiohttp.test_utils import TestClient, TestServer

    from polar_mitm.policy import Policy
    from polar_mitm.proxy.gateway import Gateway
    from polar_mitm.store.writer import Store
    from tests.support.rig import GatewayRig

    fake = FakeBackend(qwen_tokenizer_dir, "--api", api)
    store = await Store.open(tmp_path / "d.sqlite")
    await store.ensure_session("s")
    config = PolicyConfig(
        backend_url=fake.url,
        backend_kind=api,
        tokenizer=str(qwen_tokenizer_dir),
        engine_dead_after=2.0,
        engine_probe_interval=0.25,
        ping_interval=0.2,
    )
    policy = Policy(config, store)
    client = TestClient(TestServer(Gateway(policy, default_session="s").app()))
    await client.start_server()
    gw = GatewayRig(client, None, store)
    turn = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    try:
        with stopped(fake):
            t0 = time.monotonic()
            status, _, raw = await gw.post("anthropic", turn)
            took = time.monotonic() - t0
            message = json.loads(raw)["error"]["message"]
            assert status == 529, raw
            assert "did not answer" in message and "within 2 s (--engine-dead-after)" in message, message
            assert "hung" in message and "is it vLLM" not in message, message
            assert took < 2 + 1.5, took
            t0 = time.monotonic()
            status, _, raw = await gw.post("anthropic", turn)
            assert status == 529 and json.loads(raw)["error"]["message"] == message
            assert time.monotonic() - t0 < 0.5  # the kept failure, not a second wait on the engine
        await asyncio.sleep(1.2)  # the first pause after a failure: 1 s
        status, _, raw = await gw.post("anthropic", turn)
        assert status == 200, raw
    finally:
        await client.close()
        await policy.close()
        await store.close()
        fake.stop()
