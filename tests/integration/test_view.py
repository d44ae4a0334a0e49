"""`polar-mitm view` over a real store (SQLite written by the Store), through aiohttp's test client:
every page, the numbers it shows against export's, bad input, and the guards (Host header,
script policy, escaping of what the harness wrote). The browser is tests/e2e/test_view_browser.py."""

from __future__ import annotations

import asyncio
import html
import json
import re
from pathlib import Path

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from click.testing import CliRunner

from polar_mitm.reconstruct.export import iter_trajectories
from polar_mitm.reconstruct.source import Selection
from polar_mitm.store.rollouts import RolloutLog
from polar_mitm.store.turn import Turn
from polar_mitm.store.writer import Store
from polar_mitm.view.server import ViewConfig, Viewer, allowed_hosts
from polar_mitm.view.tokens import TokenPieces
from tests.support.helpers import wait_until_async

# The harness writes this (a reply, a tool result); it must reach the page as text.
EVIL = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'


async def _fill(path: Path, tokenizer_dir: Path) -> dict[str, list[int]]:
    """Two sessions: s1 a three-turn chain (one of its replies carries markup and multibyte
    text), s2 one turn; a rollout group of two samples with equal rewards (no signal)."""
    tok = TokenPieces(tokenizer_dir).tokenizer
    enc = tok.encode
    p1 = enc("<|im_start|>user\nfix the bug<|im_end|>\n<|im_start|>assistant\n")
    o1 = enc("héllo ✓ 日本 " + EVIL + "<|im_end|>")
    p2 = p1 + o1 + enc("\n<|im_start|>user\ntool says ok<|im_end|>\n<|im_start|>assistant\n")
    o2 = enc("done<|im_end|>")
    p3 = p2 + o2 + enc("\n<|im_start|>user\nthanks<|im_end|>\n<|im_start|>assistant\n")
    o3 = enc("bye<|im_end|>")
    lp = lambda n, base: [round(base - 0.01 * i, 6) for i in range(n)]  # noqa: E731
    # The tool parser read s1's first two turns (the second's call did not parse) and u1.
    ok = {"tool_parse": json.dumps({"parser": "qwen25", "calls": 1, "failures": []})}
    bad = {"parser": "qwen25", "calls": 0, "failures": [{"kind": "invalid_json", "span": [0, 2]}]}
    store = await Store.open(path)
    try:
        await store.ensure_session(
            "s1", task_id="task-a", harness="claude-code", command=["claude", "-p", "hi"]
        )
        await store.ensure_session("s2", task_id="task-b", harness="codex")
        turns = [
            ("s1", "t1", p1, o1, ok),
            ("s2", "u1", enc("<|im_start|>user\nother<|im_end|>\n"), enc("x<|im_end|>"), ok),
            (
                "s1",
                "t2",
                p2,
                o2,
                {"prompt_ref": "t1", "prompt_ref_len": len(p1) + len(o1), "tool_parse": json.dumps(bad)},
            ),
            ("s1", "t3", p3, o3, {"prompt_ref": "t2", "prompt_ref_len": len(p2) + len(o2)}),
            # s2's second conversation shares u1's first tokens, then says something else: a break.
            ("s2", "u2", enc("<|im_start|>user\nanother thing<|im_end|>\n"), enc("y<|im_end|>"), {}),
            (
                "s1",
                "t-title",
                enc("<|im_start|>user\nname this chat<|im_end|>\n"),
                enc("Bug fix<|im_end|>"),
                {"tag": "title"},
            ),
        ]
        for i, (session, tid, prompt, output, extra) in enumerate(turns):
            await store.insert_turn(
                Turn(
                    id=tid,
                    session_id=session,
                    created_at=1000.0 + i,
                    style="anthropic",
                    model="policy",
                    finish_reason="stop",
                    weight_version=f"w{i}",
                    prompt_ids=prompt,
                    output_ids=output,
                    output_logprobs=lp(len(output), -0.05 * (i + 1)),
                    latency_ms=12.5,
                    request=json.dumps(
                        {
                            "model": "m",
                            "max_tokens": 64,
                            "stream": tid == "t3",
                            "messages": [{"role": "user", "content": EVIL}],
                            "tools": [{"name": "Bash", "input_schema": {"type": "object"}}],
                        }
                    ),
                    response=json.dumps(
                        {"turn_id": tid, "model": "policy", "text": EVIL, "finish_reason": "stop"}
                    ),
                    **extra,
                )  # fmt: skip
            )
        log = RolloutLog(store)
        await log.begin_rollout("ro1", {"harness": "claude-code"})
        await log.add_group("g1", "ro1", "task-r", 2, "{}")
        for k in range(2):
            sid = f"r{k}"
            await store.ensure_session(sid, task_id="task-r", harness="claude-code")
            await store.insert_turn(
                Turn(
                    id=f"r{k}-t",
                    session_id=sid,
                    style="anthropic",
                    prompt_ids=p1,
                    output_ids=o2,
                    output_logprobs=lp(len(o2), -0.1),
                    finish_reason="stop",
                )  # fmt: skip
            )
            await log.add_sample(sid, "g1", k, 0, "queued")
            await log.finish_sample(
                sid, status="completed", reward=1.0, exit_code=0,
                detail={"passed": 3, "failed": 0, "output_tail": "3 passed " + EVIL},
                timings={"starting": 0.5, "running": 2.0 + k, "scoring": 0.25},
            )  # fmt: skip
        await log.end_group("g1", "done")
        await log.end_rollout("ro1", "done")
    finally:
        await store.close()
    return {"o1": o1}


@pytest.fixture
def store(tmp_path: Path, tiny_tokenizer_dir: Path) -> Path:
    db = tmp_path / "runs.sqlite"
    asyncio.run(_fill(db, tiny_tokenizer_dir))
    return db


@pytest.fixture
async def view(store: Path, tiny_tokenizer_dir: Path):
    clients: list[TestClient] = []

    async def make(**kw) -> TestClient:
        cfg = ViewConfig(db=kw.pop("db", store), tokenizer=kw.pop("tokenizer", tiny_tokenizer_dir), **kw)
        client = TestClient(TestServer(Viewer(cfg).app()))
        await client.start_server()
        clients.append(client)
        return client

    yield make
    for c in clients:
        await c.close()


def spans(page: str, kind: str) -> list[str]:
    """The texts of the token spans of one kind (s: trained) on a page."""
    return re.findall(rf'<span class="t {kind}(?: b\d)?(?: e)?" data-i="\d+">(.*?)</span>', page, re.S)


async def test_sessions_list_filters_and_search(view) -> None:
    c = await view()
    r = await c.get("/sessions")
    body = await r.text()
    assert r.status == 200
    assert all(f'href="/session/{s}"' in body for s in ("s1", "s2", "r0", "r1"))
    body = await (await c.get("/sessions?task=task-b")).text()
    assert 'href="/session/s2"' in body and 'href="/session/s1"' not in body
    body = await (await c.get("/sessions?q=r1")).text()
    assert 'href="/session/r1"' in body and 'href="/session/r0"' not in body
    body = await (await c.get("/sessions?status=completed")).text()
    assert 'href="/session/r0"' in body and 'href="/session/s1"' not in body
    body = await (await c.get("/sessions?harness=codex")).text()
    assert 'href="/session/s2"' in body and 'href="/session/s1"' not in body
    assert (await c.get("/sessions?since=not-a-date")).status == 400


def _tool_parse_rows(page: str) -> list[list[str]]:
    table = page.split("Tool-call parse", 1)[1] if "Tool-call parse" in page else ""
    rows = [re.findall(r"<td>(.*?)</td>", tr) for tr in re.findall(r"<tr>(.*?)</tr>", table, re.S)]
    return [r for r in rows if r]  # the header row has none


async def test_sessions_page_shows_the_tool_call_parse_rate_per_harness_and_parser_as_stats_does(
    view, store
) -> None:
    from polar_mitm.store.queries import tool_parse_rates

    c = await view()
    rows = _tool_parse_rows(await (await c.get("/sessions")).text())
    assert rows == [
        ["claude-code", "qwen25", "2", "1", "50.0%", "invalid_json 1"],
        ["codex", "qwen25", "1", "0", "0.0%", "-"],
    ]
    # The numbers are stats' own.
    assert [(r.harness, r.turns, r.failed_turns) for r in tool_parse_rates(store)] == [
        ("claude-code", 2, 1),
        ("codex", 1, 0),
    ]
    # The filters select what it counts.
    assert _tool_parse_rows(await (await c.get("/sessions?harness=codex")).text()) == [rows[1]]
    assert _tool_parse_rows(await (await c.get("/sessions?task=task-a")).text()) == [rows[0]]
    assert "Tool-call parse" not in await (await c.get("/sessions?task=task-r")).text()


async def test_trajectory_shows_exactly_the_exported_row(view, store: Path) -> None:
    [row] = [r for r in iter_trajectories(store, selection=Selection(session="s1"))]
    c = await view()
    body = await (await c.get(f"/trajectory/{row.trajectory_id}")).text()
    assert f'data-trained="{row.num_trained}"' in body
    assert len(spans(body, "s")) == row.num_trained == int(row.loss_mask.sum())
    data = json.loads(re.search(r'<script type="application/json" id="data">(.*?)</script>', body).group(1))
    full_mask = [0] * len(row.prompt_ids) + row.loss_mask.tolist()
    assert data["trained"] == full_mask
    lp = [0.0] * len(row.prompt_ids) + row.response_logprobs.tolist()
    assert data["lp"] == lp  # float32 values, exactly as export holds them
    assert body.count('class="turn-mark"') == 3  # each turn's sampled tokens begin with a mark
    assert "w0" in body and "w3" in body  # weight versions (per turn, in the hover data)
    # Any turn id reaches the row holding it; a session id goes to the session.
    assert (await c.get("/trajectory/t1")).status == 200
    r = await c.get("/trajectory/s1", allow_redirects=False)
    assert r.status == 302 and r.headers["Location"] == "/session/s1"


async def test_pages_of_a_long_row_add_up_to_the_row(view, store: Path) -> None:
    [row] = list(iter_trajectories(store, selection=Selection(session="s1")))
    c = await view(page_tokens=16)
    pages = -(-row.num_tokens // 16)
    trained = 0
    for p in range(pages):
        body = await (await c.get(f"/trajectory/{row.trajectory_id}?page={p}")).text()
        assert f"page {p + 1} of {pages}" in body
        trained += len(spans(body, "s"))
    assert trained == row.num_trained


async def test_text_decodes_multibyte_tokens_and_markup_stays_text(view, store: Path) -> None:
    c = await view()
    body = await (await c.get("/trajectory/t3")).text()
    text = html.unescape("".join(spans(body, "s")))
    assert "héllo ✓ 日本 " + EVIL in text  # shown as the text it is, split into token spans
    assert "<img" not in body and "<script>window" not in body
    r = await c.get("/turn/t1")
    turn = await r.text()
    assert r.status == 200 and "<img" not in turn and "&lt;img src=x" in turn
    assert "Bash" in turn and "fix the bug" in turn  # the request's tools and the rendered prompt
    assert r.headers["Content-Security-Policy"].startswith("default-src 'none'; script-src 'self'")
    # The reply in the harness's own shape: JSON for t1's request, the SSE stream for t3's.
    assert 'id="reply-kind">anthropic JSON reply' in turn and "&quot;content&quot;" in turn
    streamed = await (await c.get("/turn/t3")).text()
    assert 'id="reply-kind">anthropic SSE stream' in streamed and "event: message_start" in streamed
    assert "event: content_block_delta" in streamed and "&lt;img src=x" in streamed


def test_token_pieces_join_to_the_decoded_text(tiny_tokenizer_dir: Path) -> None:
    pieces = TokenPieces(tiny_tokenizer_dir)
    for text in ["héllo ✓ 日本語 🎉 ok", "<|im_start|>user\nplain<|im_end|>", "ééé" * 20]:
        ids = pieces.tokenizer.encode(text)
        got = pieces.pieces(ids)
        assert len(got) == len(ids) and "".join(got) == pieces.tokenizer.decode(ids)
        assert "\ufffd" not in "".join(got)


async def test_missing_tokenizer_shows_ids_and_says_why(view, store: Path, tmp_path: Path) -> None:
    c = await view(tokenizer=None)
    body = await (await c.get("/trajectory/t3")).text()
    assert "no tokenizer: token ids are shown" in body and "--tokenizer DIR" in body
    [row] = list(iter_trajectories(store, selection=Selection(session="s1")))
    assert spans(body, "s")[0].strip() == str(row.response_ids[0])
    c = await view(tokenizer=tmp_path / "nowhere")
    body = await (await c.get("/trajectory/t3")).text()
    assert "cannot load the tokenizer" in body and "nowhere" in body


async def test_bad_input_gets_a_clear_page_never_a_traceback(view, tmp_path: Path) -> None:
    c = await view(db=tmp_path / "missing.sqlite")
    for url in ("/sessions", "/trajectory/x", "/rollouts", "/plots"):
        r = await c.get(url)
        body = await r.text()
        assert r.status == 503 and "no database at" in body and "missing.sqlite" in body, url
        assert "Traceback" not in body
    c = await view()
    r = await c.get("/session/nope")
    body = await r.text()
    assert r.status == 404 and "no session &#x27;nope&#x27;" in body and "most recent" in body
    for url in (
        "/trajectory/nope",
        "/turn/nope",
        "/group/nope",
        "/nothing/here",
        "/trajectory/t1?strategy=bogus",
    ):
        r = await c.get(url)
        body = await r.text()
        assert r.status in (400, 404) and "Traceback" not in body and "<h1>" in body, url


async def test_a_corrupt_store_is_a_page_too(view, tmp_path: Path) -> None:
    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(b"this is not a database" * 100)
    c = await view(db=bad)
    r = await c.get("/sessions")
    body = await r.text()
    assert r.status == 500 and "Something failed" in body and "Traceback" not in body


async def test_session_page_has_rows_tree_turns_and_per_request_rows(view) -> None:
    c = await view()
    body = await (await c.get("/session/s1")).text()
    assert 'href="/trajectory/t3"' in body and "claude -p hi" in body
    assert all(f'href="/turn/{t}"' in body for t in ("t1", "t2", "t3"))
    body = await (await c.get("/session/s1?strategy=per-request")).text()
    assert all(f'href="/trajectory/{t}?strategy=per-request"' in body for t in ("t1", "t2", "t3"))


async def test_side_calls_are_left_out_as_export_does_and_shown_on_request(view) -> None:
    c = await view()
    body = await (await c.get("/session/s1")).text()
    assert 'href="/trajectory/t-title' not in body and 'href="/turn/t-title"' in body  # a tagged turn
    assert 'href="/session/s1?side=1"' in body
    body = await (await c.get("/session/s1?side=1")).text()
    assert 'href="/trajectory/t-title?side=1"' in body and 'class="role side"' in body
    r = await c.get("/trajectory/t-title")
    assert r.status == 404 and "in no prefix-merge row" in await r.text()
    r = await c.get("/trajectory/t-title?side=1")
    assert r.status == 200 and 'data-trained="' in await r.text()


async def test_a_break_shows_its_class_and_both_first_differing_tokens(
    view, store: Path, tiny_tokenizer_dir
) -> None:
    from polar_mitm.reconstruct.breaks import TokenText

    # As `export --tokenizer` classifies it (the viewer has the tokenizer too).
    text = TokenText.load(tiny_tokenizer_dir)
    rows = {
        r.trajectory_id: r for r in iter_trajectories(store, selection=Selection(session="s2"), text=text)
    }
    [b] = rows["u2"].meta["breaks"]
    assert b["class"] == "other"
    k = b["common_prefix"]
    here = (
        int(rows["u2"].prompt_ids[k])
        if k < len(rows["u2"].prompt_ids)
        else int(rows["u2"].response_ids[k - len(rows["u2"].prompt_ids)])
    )
    c = await view()
    body = await (await c.get("/trajectory/u2")).text()
    table = body[body.index('class="grid breaks"') :]
    assert f'class="break {b["class"]}"' in table and 'href="/turn/u1"' in table
    there = int(np.concatenate([rows["u1"].prompt_ids, rows["u1"].response_ids])[k])
    assert here != there
    assert f"<code>{here} " in table and f"<code>{there} " in table  # both sides' tokens, with text
    assert f"page={k // 4096}#tok{k}" in table


async def test_rollouts_and_group_pages(view, store: Path) -> None:
    c = await view()
    body = await (await c.get("/rollouts")).text()
    assert "Rollout ro1" in body and 'href="/group/g1"' in body and "no signal" in body
    body = await (await c.get("/group/g1")).text()
    statuses = re.findall(r'data-status="(\w+)"', body)
    rewards = re.findall(r'data-reward="([\d.]+)"', body)
    assert statuses == ["completed", "completed"] and rewards == ["1.0", "1.0"]
    assert "GRPO learns nothing" in body and "100%" in body  # pass@1
    assert "3 passed &lt;img" in body and "running 3.00s" in body


async def test_plots_are_inline_svg(view) -> None:
    c = await view()
    body = await (await c.get("/plots")).text()
    assert body.count("<svg") >= 4
    assert (
        "reward distribution · task-r" in body
        and "turns per session" in body
        and "trainer-token ratio" in body
    )


async def test_a_request_naming_another_host_is_refused(view) -> None:
    """DNS rebinding: a page on attacker.example whose name now resolves to 127.0.0.1 would read
    the store through the visitor's browser. The viewer answers only for its own names."""
    c = await view(allowed_hosts=allowed_hosts("127.0.0.1"))
    r = await c.get("/session/s1", headers={"Host": "attacker.example:8790"})
    assert r.status == 403 and "s1" not in (await r.text())
    r = await c.get("/session/s1", headers={"Host": "localhost:8790"})
    assert r.status == 200


def test_the_command_refuses_a_non_loopback_listen(tmp_path: Path) -> None:
    from polar_mitm.cli import main

    r = CliRunner().invoke(main, ["view", "--db", str(tmp_path / "x.sqlite"), "--listen", "0.0.0.0:0"])
    assert r.exit_code == 2 and "--insecure-listen" in r.output
    r = CliRunner().invoke(main, ["view", "--help"])
    assert r.exit_code == 0 and "polar-mitm view --db" in r.output


@pytest.mark.slow
async def test_live_page_relays_the_service_events_over_one_connection(view, tmp_path: Path) -> None:
    """Several browser tabs, one subscription to the service; an event the service publishes
    reaches every tab; without --server the page says how to get one."""
    from polar_mitm import api as m
    from polar_mitm.service.config import ServerConfig
    from polar_mitm.service.server import RolloutServer

    c = await view()
    assert "--server URL" in await (await c.get("/live")).text()
    server = RolloutServer(ServerConfig(db=tmp_path / "svc.sqlite", token="tok"))
    await server.start("127.0.0.1", 0)
    tabs = []
    try:
        c = await view(server=server.url, service_token="tok")
        r = await c.get("/live")
        assert r.status == 200 and 'id="tasks"' in await r.text()
        tabs = [await c.get("/live/events") for _ in range(3)]
        assert all(t.headers["content-type"] == "text/event-stream" for t in tabs)
        await wait_until_async(lambda: server.events.queues, timeout=2, interval=0.02, message="a subscriber")
        assert len(server.events.queues) == 1  # three tabs, one upstream subscriber
        server.events.publish(
            m.Event(kind="sample", task_id="tk", index=0, state="finished", data={"status": "completed"})
        )
        for tab in tabs:
            seen: list[dict] = []
            while not any(e.get("state") == "finished" for e in seen):
                line = (await asyncio.wait_for(tab.content.readline(), 5)).decode()
                if line.startswith("data: "):
                    seen.append(json.loads(line[len("data: ") :]))
            assert [e["task_id"] for e in seen if e.get("state") == "finished"] == ["tk"]
        bad = await view(server=server.url, service_token="wrong")
        r = await bad.get("/live")
        assert r.status == 502 and "did not answer" in await r.text()
    finally:
        for tab in tabs:
            tab.close()

        # The last tab gone, the relay leaves the service's stream: the service's handler finds
        # the reader gone at its next write (so write until it does).
        def left() -> bool:
            server.events.publish(m.Event(kind="node", state="active"))
            return not server.events.queues

        await wait_until_async(left, timeout=10, message="the relay to leave the service's stream")
        assert not server.events.queues
        await server.stop()


def test_show_prints_the_viewer_url_when_a_viewer_runs_over_the_store(
    store: Path, tmp_path: Path, monkeypatch
) -> None:
    from polar_mitm.cli import main
    from polar_mitm.reconstruct import viewers

    monkeypatch.setenv("POLAR_MITM_CACHE", str(tmp_path / "cache"))
    r = CliRunner().invoke(main, ["show", "--db", str(store), "t3"])
    assert r.exit_code == 0 and "view:" not in r.stderr
    viewers.register(store, "http://127.0.0.1:8790")  # as a running `view` does (this process)
    r = CliRunner().invoke(main, ["show", "--db", str(store), "t3"])
    assert r.exit_code == 0 and "view: http://127.0.0.1:8790/trajectory/t3" in r.stderr
    r = CliRunner().invoke(main, ["show", "--db", str(store), "t1", "--strategy", "per-request"])
    assert "view: http://127.0.0.1:8790/trajectory/t1?strategy=per-request" in r.stderr
    other = tmp_path / "other.sqlite"
    other.write_bytes(store.read_bytes())
    r = CliRunner().invoke(main, ["show", "--db", str(other), "t3"])
    assert "view:" not in r.stderr  # a viewer of another store is not named
    viewers.register(store, "http://127.0.0.1:8790", remove=True)
    assert viewers.running_url(store) is None
