"""Failure paths a long run meets: an engine that aborts a generation, local processes that are not
the proxy, database file modes, and a backend that stops answering.
"""

import glob
import sqlite3

import httpx
import pytest

from polar_mitm.reconstruct.source import Selection
from polar_mitm.store.reader import read_turns
from tests.support.helpers import MESSAGES_URL, sse_events

LONG = [{"match": "", "text": " ".join(f"word{i}" for i in range(300))}]


def body(messages, **kw):
    return {"model": "claude-sonnet-4-5", "max_tokens": 512, "messages": messages, **kw}


HI = [{"role": "user", "content": "hi"}]


async def inject(stack, mode: str) -> None:
    async with httpx.AsyncClient() as c:
        await c.post(stack.backend_url + "/_fake/fault", json={"mode": mode, "count": 1})


async def backend_generate(stack, input_ids):
    async with httpx.AsyncClient(timeout=60) as c:
        r = await c.post(
            stack.backend_url + "/generate",
            json={"input_ids": input_ids, "sampling_params": {"max_new_tokens": 512}, "return_logprob": True},
        )
        return r.json()


def rows(db: str, columns: str = "status, finish_reason") -> list[tuple]:
    con = sqlite3.connect(db)
    try:
        return con.execute(f"SELECT {columns} FROM turns").fetchall()
    finally:
        con.close()


# --- an engine that aborts a generation -----------------------------------------------------------


@pytest.mark.slow
async def test_backend_abort_mid_stream_is_an_error_event_and_an_aborted_turn(make_stack):
    stack = await make_stack(backend={"token_delay": 0.002, "script": LONG})
    await inject(stack, "abort")
    seen_at_error = None
    raw = ""
    async with stack.client() as c:
        async with c.stream("POST", MESSAGES_URL, json=body(HI, stream=True)) as r:
            async for line in r.aiter_lines():
                raw += line + "\n"
                if line == "event: error":
                    seen_at_error = rows(stack.db)
    events = sse_events(raw)
    assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "overloaded_error"
    assert "abort" in events[-1][1]["error"]["message"]
    assert "message_stop" not in [e for e, _ in events] and "message_delta" not in [e for e, _ in events]
    assert seen_at_error == [("aborted", "abort")]  # committed before the harness saw the end
    [turn] = list(read_turns(stack.db, include_text_only=True))
    full = await backend_generate(stack, turn.prompt_ids)
    n = len(turn.output_ids)
    assert 0 < n < len(full["output_ids"])
    assert turn.output_ids == full["output_ids"][:n]  # exactly the tokens sampled before the abort
    assert turn.output_logprobs == [t[0] for t in full["meta_info"]["output_token_logprobs"][:n]]
    assert not Selection().keeps(turn) and Selection(include_aborted=True).keeps(turn)  # export filter


async def test_backend_abort_before_any_byte_is_a_retryable_overload_error(make_stack):
    stack = await make_stack(backend={"script": LONG})
    await inject(stack, "abort")
    async with stack.client() as c:
        r = await c.post(MESSAGES_URL, json=body(HI))
    assert r.status_code == 529 and r.headers.get("x-should-retry") == "true"
    assert r.json()["error"]["type"] == "overloaded_error"
    assert rows(stack.db) == [("aborted", "abort")]


async def test_backend_abort_in_openai_styles_is_their_retryable_error(make_stack):
    stack = await make_stack(backend={"script": LONG})
    await inject(stack, "abort")
    async with stack.client() as c:
        r = await c.post(
            "https://api.openai.com/v1/chat/completions",
            json={"model": "gpt-x", "messages": HI},
        )
    assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
    assert rows(stack.db) == [("aborted", "abort")]


async def test_backend_abort_in_chat_mode_is_an_aborted_turn(make_stack):
    stack = await make_stack(backend={"script": LONG}, policy={"backend_mode": "chat"})
    await inject(stack, "abort")
    async with stack.client() as c:
        r = await c.post(MESSAGES_URL, json=body(HI))
    assert r.status_code == 529 and r.json()["error"]["type"] == "overloaded_error"
    [(status, finish, n)] = rows(stack.db, "status, finish_reason, output_len")
    assert (status, finish) == ("aborted", "abort") and n > 0


# --- the gateway's loopback port ------------------------------------------------------------------


async def test_gateway_port_refuses_requests_without_the_proxys_secret(make_stack):
    stack = await make_stack()
    direct = f"http://127.0.0.1:{stack.proxy.gateway.port}/v1/messages"
    forged = {"x-polar-host": "api.anthropic.com", "x-polar-session": "intruder"}
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(direct, json=body(HI), headers=forged)
        assert r.status_code == 403
        assert r.json()["error"]["type"] == "permission_error"
        r = await c.post(direct, json=body(HI), headers={**forged, "x-polar-secret": "guess"})
        assert r.status_code == 403
    assert rows(stack.db) == []
    async with stack.client() as c:  # the proxy's own flows still reach it
        r = await c.post(MESSAGES_URL, json=body(HI))
    assert r.status_code == 200
    assert [t.session_id for t in read_turns(stack.db)] == ["s-test"]
    await stack.proxy.store.query("PRAGMA wal_checkpoint(PASSIVE)")
    blob = b"".join(open(p, "rb").read() for p in glob.glob(stack.db + "*"))
    assert stack.proxy.gateway.secret.encode() not in blob


async def test_a_gateway_without_a_secret_still_stands_in_for_a_provider(make_stack):
    from polar_mitm.proxy.gateway import Gateway

    stack = await make_stack()
    gw = Gateway(stack.proxy.policy, default_session="standin", default_host="api.anthropic.com")
    port = await gw.start()
    try:
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(f"http://127.0.0.1:{port}/v1/messages", json=body(HI))
    finally:
        await gw.stop()
    assert r.status_code == 200 and r.json()["content"][0]["type"] == "text"
    assert [t.session_id for t in read_turns(stack.db)] == ["standin"]


# --- database file modes --------------------------------------------------------------------------


async def test_a_new_database_and_its_wal_files_are_private(tmp_path):
    import os
    import stat

    from polar_mitm.store.writer import Store

    path = tmp_path / "runs.sqlite"
    old = os.umask(0o022)  # the usual umask, which would leave them readable by everyone
    try:
        store = await Store.open(path)
        await store.ensure_session("s")
        try:
            for suffix in ("", "-wal", "-shm"):
                mode = stat.S_IMODE(os.stat(f"{path}{suffix}").st_mode)
                assert mode == 0o600, f"{path.name}{suffix} is {oct(mode)}"
        finally:
            await store.close()
    finally:
        os.umask(old)


async def test_an_existing_database_keeps_its_mode(tmp_path):
    import os
    import stat

    from polar_mitm.store.connection import init_db
    from polar_mitm.store.writer import Store

    path = tmp_path / "shared.sqlite"
    init_db(path)
    os.chmod(path, 0o640)  # the owner chose to share it with a group
    store = await Store.open(path)
    await store.close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640


# --- a backend that stops answering ---------------------------------------------------------------


async def test_no_first_token_before_any_byte_is_a_retryable_overload_error(make_stack):
    # hang_seconds bounds the hang if the timeout does not fire; it then answers 503 itself.
    stack = await make_stack(
        backend={"hang_seconds": 5}, policy={"first_token_timeout": 0.5, "ping_interval": 30}
    )
    await inject(stack, "hang")
    async with stack.client() as c:
        r = await c.post(MESSAGES_URL, json=body(HI, stream=True))
    assert r.status_code == 529 and r.headers.get("x-should-retry") == "true"
    assert r.json()["error"]["type"] == "overloaded_error"
    assert "--first-token-timeout" in r.json()["error"]["message"]
    assert rows(stack.db) == []


async def test_no_first_token_after_pings_ends_the_stream_with_an_error_event(make_stack):
    stack = await make_stack(backend={"hang_seconds": 5}, policy={"first_token_timeout": 0.5})
    await inject(stack, "hang")
    async with stack.client() as c:
        r = await c.post(MESSAGES_URL, json=body(HI, stream=True))
    events = sse_events(r.text)
    assert events[0][0] == "message_start"
    assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "overloaded_error"
    assert "--first-token-timeout" in events[-1][1]["error"]["message"]
    assert rows(stack.db) == []  # nothing was sampled


@pytest.mark.slow
async def test_a_backend_that_stalls_mid_stream_fails_the_turn_and_keeps_it_as_error(make_stack):
    # Four tokens 1.5 s apart: without an idle limit the reply would just arrive slowly. The backend
    # streams incrementally, so the policy streams from it (it asks a cumulative one for whole replies).
    stack = await make_stack(
        backend={
            "token_delay": 1.5,
            "script": [{"match": "", "text": "one two three"}],
            "incremental_streaming_output": True,
        },
        policy={"first_token_timeout": 10, "idle_timeout": 0.5},
    )
    async with stack.client() as c:
        r = await c.post(MESSAGES_URL, json=body(HI, stream=True))
    events = sse_events(r.text)
    assert [d["delta"]["text"] for e, d in events if e == "content_block_delta"]  # a token got through
    assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "overloaded_error"
    assert "--idle-timeout" in events[-1][1]["error"]["message"]
    assert "message_stop" not in [e for e, _ in events]
    [turn] = list(read_turns(stack.db, include_text_only=True))
    assert (turn.status, turn.finish_reason) == ("error", "error")
    assert 0 < len(turn.output_ids) == len(turn.output_logprobs) < 4  # the tokens sampled so far


async def test_chat_mode_waits_for_its_whole_reply_no_longer_than_the_first_token_timeout(make_stack):
    stack = await make_stack(
        backend={"hang_seconds": 5}, policy={"backend_mode": "chat", "first_token_timeout": 0.5}
    )
    await inject(stack, "hang")
    async with stack.client() as c:
        r = await c.post(MESSAGES_URL, json=body(HI))
    assert r.status_code == 529 and "--first-token-timeout" in r.json()["error"]["message"]
    assert rows(stack.db) == []


async def test_info_requests_to_a_silent_backend_time_out():
    import asyncio

    import pytest
    from aiohttp import web

    from polar_mitm.backends.engine_client import EngineClient
    from polar_mitm.neutral import ProviderError

    release = asyncio.Event()

    async def silent(request):
        await asyncio.wait_for(release.wait(), 30)
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/model_info", silent)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    client = EngineClient(f"http://127.0.0.1:{port}", timeout=0.3)
    try:
        with pytest.raises(ProviderError) as e:
            await asyncio.wait_for(client.model_info(), 5)
        assert e.value.kind == "overloaded"
    finally:
        release.set()
        await client.close()
        await runner.cleanup()


def test_timeouts_have_defaults_for_real_engines_and_command_line_options():
    import click
    from click.testing import CliRunner

    from polar_mitm.cli.options import make_policy_config, policy_options
    from polar_mitm.policy import PolicyConfig

    assert (PolicyConfig().first_token_timeout, PolicyConfig().idle_timeout) == (600, 120)

    @click.command()
    @policy_options
    def show(db, certs, **policy):
        cfg = make_policy_config(**policy)
        click.echo(f"{cfg.first_token_timeout} {cfg.idle_timeout}")

    def run(*args):
        result = CliRunner().invoke(show, list(args))
        assert result.exit_code == 0, result.output
        return result.output.split()

    assert run() == ["600.0", "120.0"]
    assert run("--first-token-timeout", "30", "--idle-timeout", "5") == ["30.0", "5.0"]
    assert run("--backend-timeout", "7") == ["7.0", "7.0"]  # the older option sets both
    assert run("--backend-timeout", "7", "--idle-timeout", "2") == ["7.0", "2.0"]
