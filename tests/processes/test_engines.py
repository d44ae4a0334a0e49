"""The engines behind `--backend`: discovery of every front (an engine, SGLang's real router, a
router without workers yet, the options), the routing key that keeps a conversation on one
engine, the engine's API key, the fake's per-engine prefix cache, liveness probes while a turn
waits (a hung scheduler, a SIGSTOPped process), and several `--backend` URLs with one killed.

Everything is real and on loopback: fake engines (in-process, or `polar-mitm fake-backend`
processes), the `sglang-router` binary from PyPI, the gateway's aiohttp app.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import defaultdict
from pathlib import Path

import aiohttp
import pytest

from polar_mitm.fake import STATE, FakeBackendConfig, Fault, start_fake_backend
from polar_mitm.harness.preflight import PreflightError, check_policy
from polar_mitm.policy import Policy, PolicyConfig
from polar_mitm.store.writer import Store
from tests.support.helpers import wait_until_async
from tests.support.rig import GatewayRig
from tests.support.routers import Router, require_router

MODEL = "claude-sonnet-4-5"


async def fake(tok: Path, **cfg):
    """An in-process fake engine whose model path is its tokenizer directory (what a router loads)."""
    return await start_fake_backend(FakeBackendConfig(tokenizer_path=str(tok), model_path=str(tok), **cfg))


class Rig:
    """The gateway over a Policy over `url` (one or several, comma-separated), storing to SQLite."""

    def __init__(self, tmp: Path, tok: Path, url: str, **policy):
        self.tmp, self.tok, self.url, self.policy_kw = tmp, tok, url, policy

    async def __aenter__(self) -> Rig:
        from aiohttp.test_utils import TestClient, TestServer

        from polar_mitm.proxy.gateway import Gateway

        self.store = await Store.open(self.tmp / f"engines-{time.monotonic_ns()}.sqlite")
        await self.store.ensure_session("s-test")
        cfg = {"backend_url": self.url, "tokenizer": str(self.tok), "ping_interval": 0.2, **self.policy_kw}
        self.policy = Policy(PolicyConfig(**cfg), self.store)
        self.client = TestClient(TestServer(Gateway(self.policy, default_session="s-test").app()))
        await self.client.start_server()
        self.gw = GatewayRig(self.client, None, self.store)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.close()
        await self.policy.close()
        await self.store.close()

    async def turn(self, messages: list[dict]) -> tuple[int, dict]:
        body = {"model": MODEL, "max_tokens": 64, "messages": messages}
        status, _, raw = await self.gw.post("anthropic", body)
        return status, json.loads(raw)


def user(text: str) -> dict:
    return {"role": "user", "content": text}


async def converse(rig: Rig, first: str, turns: int) -> list[dict]:
    """`turns` turns of one conversation (each echoes the reply before); the messages so far."""
    messages = [user(first)]
    for i in range(turns):
        status, reply = await rig.turn(messages)
        assert status == 200, reply
        messages += [{"role": "assistant", "content": reply["content"]}, user(f"and then {i}")]
    return messages


async def requests_of(url: str) -> list[dict]:
    async with aiohttp.ClientSession() as http, http.get(url + "/_fake/requests") as r:
        return [q for q in (await r.json())["requests"] if q["path"] == "/generate"]


# --- discovery -------------------------------------------------------------------------------------


async def test_an_engine_is_found_as_one(tmp_path, qwen_tokenizer_dir):
    runner, url = await fake(qwen_tokenizer_dir, context_length=9999)
    said: list[str] = []
    try:
        info = await check_policy(PolicyConfig(backend_url=url), progress=said.append)
        assert (info.front, info.context_length, info.server_info_from) == ("sglang", 9999, "engine")
        assert said == []  # one engine: nothing more to say than before
    finally:
        await runner.cleanup()


@pytest.mark.slow
async def test_behind_the_real_router_run_waits_for_a_worker_then_reads_a_workers_server_info(
    tmp_path, qwen_tokenizer_dir
):
    """The router serves /get_model_info (not /model_info) from a worker, its /get_server_info is
    its own, and without workers it answers 503 no_workers: found as a router, waited on with one
    line, its worker's context length and streaming mode read from the worker."""
    require_router()
    router = Router("manual")
    runner, url = await fake(qwen_tokenizer_dir, context_length=12345, incremental_streaming_output=True)
    said: list[str] = []
    try:
        with pytest.raises(PreflightError, match=r"no worker after 0.5 s \(--backend-wait\)"):
            await check_policy(PolicyConfig(backend_url=router.url, backend_wait=0.5), progress=said.append)
        assert len(said) == 1 and "has no worker yet; waiting up to 0.5 s" in said[0]
        said.clear()
        waiting = asyncio.ensure_future(
            check_policy(PolicyConfig(backend_url=router.url, backend_wait=30), progress=said.append)
        )
        await asyncio.sleep(1.0)
        assert not waiting.done() and len(said) == 1  # one line of progress while it waits
        await asyncio.to_thread(router.add, url)
        info = await asyncio.wait_for(waiting, 30)
        assert info.front == "router" and info.workers == [url] and info.server_info_from == url
        assert (info.context_length, info.incremental_streaming_output) == (12345, True)
        assert info.tokenizer_path == str(qwen_tokenizer_dir)
        assert said[-1] == f"{router.url} is an SGLang router with 1 worker(s); server info from worker {url}"
    finally:
        router.stop()
        await runner.cleanup()


async def test_the_context_length_option_bounds_prompts_when_the_backend_says_none(
    tmp_path, qwen_tokenizer_dir
):
    runner, url = await fake(qwen_tokenizer_dir)
    try:
        async with Rig(tmp_path, qwen_tokenizer_dir, url, context_length=40) as rig:
            status, reply = await rig.turn([user("a question that is longer than forty tokens " * 4)])
            assert status == 400 and "prompt is too long" in json.dumps(reply)
            assert await rig.policy.context_length() == 40
    finally:
        await runner.cleanup()


# --- the routing key ---------------------------------------------------------------------------------


async def test_every_turn_and_retry_of_a_conversation_carries_one_routing_key(tmp_path, qwen_tokenizer_dir):
    runner, url = await fake(qwen_tokenizer_dir)
    try:
        async with Rig(tmp_path, qwen_tokenizer_dir, url) as rig:
            a = await converse(rig, "first task: say hi", 3)
            status, _ = await rig.turn(a[:3])  # turn 2 again, as a retry sends it
            assert status == 200
            await converse(rig, "second task: say bye", 2)
        keys = [q["routing_key"] for q in await requests_of(url)]
        assert len(keys) == 6 and all(keys)
        assert len(set(keys[:4])) == 1, keys  # three turns and a retry: one key
        assert len(set(keys[4:])) == 1 and keys[4] != keys[0]  # another conversation: its own
    finally:
        await runner.cleanup()


@pytest.mark.slow
async def test_under_the_routers_manual_policy_each_conversation_stays_on_one_engine(
    tmp_path, qwen_tokenizer_dir
):
    require_router()
    router = Router("manual")
    engines = [await fake(qwen_tokenizer_dir) for _ in range(2)]
    try:
        for _, url in engines:
            await asyncio.to_thread(router.add, url)
        async with Rig(tmp_path, qwen_tokenizer_dir, router.url) as rig:
            for c in range(8):
                await converse(rig, f"task number {c}: say hi", 3)
        served: dict[str, set[str]] = defaultdict(set)
        for _, url in engines:
            for q in await requests_of(url):
                served[q["routing_key"]].add(url)
        assert len(served) == 8
        assert all(len(where) == 1 for where in served.values()), served
        assert len({u for where in served.values() for u in where}) == 2  # both engines serve
    finally:
        router.stop()
        for runner, _ in engines:
            await runner.cleanup()


# --- the engine's API key ------------------------------------------------------------------------------


async def test_the_api_key_goes_with_every_call_and_an_engine_with_one_refuses_calls_without(
    tmp_path, qwen_tokenizer_dir
):
    runner, url = await fake(qwen_tokenizer_dir, api_key="sekret")
    try:
        async with aiohttp.ClientSession() as http:  # a client without the key gets nothing
            async with http.post(url + "/generate", json={"input_ids": [1, 2], "sampling_params": {}}) as r:
                assert r.status == 401 and await r.json() == {"error": "Unauthorized"}
            async with http.get(url + "/model_info") as r:
                assert r.status == 401
            async with http.get(url + "/health_generate") as r:  # health is open, as in SGLang
                assert r.status == 200
        with pytest.raises(PreflightError, match="--backend-api-key"):
            await check_policy(PolicyConfig(backend_url=url, tokenizer=str(qwen_tokenizer_dir)))
        async with Rig(tmp_path, qwen_tokenizer_dir, url) as rig:
            status, reply = await rig.turn([user("say hi")])
            assert status >= 500 and "--backend-api-key" in json.dumps(reply)
        key = {"backend_api_key": "sekret"}
        await check_policy(PolicyConfig(backend_url=url, **key))
        async with Rig(tmp_path, qwen_tokenizer_dir, url, **key) as rig:
            await converse(rig, "say hi", 2)
        assert len(await requests_of(url)) == 2
    finally:
        await runner.cleanup()


# --- the fake's prefix cache ------------------------------------------------------------------------------


async def test_each_fake_engine_caches_the_prompts_and_replies_it_has_seen(tmp_path, qwen_tokenizer_dir):
    (r1, u1), (r2, u2) = await fake(qwen_tokenizer_dir), await fake(qwen_tokenizer_dir)
    try:
        async with aiohttp.ClientSession() as http:

            async def generate(url: str, ids: list[int]) -> dict:
                body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 16}}
                async with http.post(url + "/generate", json=body) as r:
                    return await r.json()

            prompt = r1.app[STATE].tokenizer.encode(
                "<|im_start|>user\nsay hi<|im_end|>\n<|im_start|>assistant\n"
            )
            first = await generate(u1, prompt)
            assert first["meta_info"]["cached_tokens"] == 0
            seq = prompt + first["output_ids"]  # what the next turn repeats, spliced
            nxt = seq + [100, 200, 300]
            assert (await generate(u1, nxt))["meta_info"]["cached_tokens"] == len(seq)
            assert (await generate(u2, nxt))["meta_info"]["cached_tokens"] == 0  # another engine's
            assert (await generate(u1, nxt))["meta_info"]["cached_tokens"] == len(nxt) - 1
            async with http.post(u1 + "/flush_cache"):
                pass
            assert (await generate(u1, nxt))["meta_info"]["cached_tokens"] == 0
        async with Rig(tmp_path, qwen_tokenizer_dir, u2) as rig:  # through the proxy, spliced
            messages = await converse(rig, "say hi", 1)
            status, reply = await rig.turn(messages)
            ((first_id,),) = await rig.store.query("SELECT id FROM turns ORDER BY id LIMIT 1")
            seq, _ = await rig.store.sequence(first_id)
        # the spliced second turn found the whole first sequence (prompt and reply) in the cache
        assert status == 200 and reply["usage"]["cache_read_input_tokens"] == len(seq)
    finally:
        await r1.cleanup()
        await r2.cleanup()


# --- liveness while a turn waits -----------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_hung_scheduler_fails_the_turn_after_engine_dead_after_not_the_first_token_timeout(
    tmp_path, qwen_tokenizer_dir
):
    runner, url = await fake(qwen_tokenizer_dir)
    try:
        async with Rig(
            tmp_path, qwen_tokenizer_dir, url, engine_dead_after=1.0, engine_probe_interval=0.25
        ) as rig:
            await converse(rig, "say hi", 1)
            runner.app[STATE].faults.append(Fault(mode="hang", path="/generate"))
            t0 = time.monotonic()
            status, reply = await rig.turn([user("say hi again")])
            took = time.monotonic() - t0
            assert status == 529 and "failed its health check (/health_generate)" in json.dumps(reply)
            assert 0.9 < took < 3.5, took
            async with aiohttp.ClientSession() as http, http.get(url + "/health") as r:
                assert r.status == 200  # the HTTP process is up all along: /health alone would not tell
    finally:
        await runner.cleanup()


@pytest.mark.slow
async def test_chat_mode_waits_through_the_same_loop_pings_then_fails_a_hung_engine_after_engine_dead_after(
    tmp_path, qwen_tokenizer_dir
):
    """Chat mode shares render mode's wait loop: a slow reply keeps the harness alive with pings,
    and a stuck scheduler fails the turn by its health check, not the first-token timeout."""
    runner, url = await fake(qwen_tokenizer_dir, first_token_delay=1.0)
    try:
        async with Rig(
            tmp_path,
            qwen_tokenizer_dir,
            url,
            backend_mode="chat",
            engine_dead_after=1.0,
            engine_probe_interval=0.25,
        ) as rig:
            body = {"model": MODEL, "max_tokens": 64, "stream": True, "messages": [user("say hi")]}
            status, _, raw = await rig.gw.post("anthropic", body)
            assert status == 200 and raw.count(b"event: ping") >= 3, raw[:500]  # ping_interval 0.2 s
            assert b"message_stop" in raw
            runner.app[STATE].faults.append(Fault(mode="hang", path="/v1/chat/completions"))
            t0 = time.monotonic()
            status, reply = await rig.turn([user("say hi again")])
            took = time.monotonic() - t0
            assert status == 529 and "failed its health check (/health_generate)" in json.dumps(reply)
            assert 0.9 < took < 3.5, took
    finally:
        await runner.cleanup()


@pytest.mark.slow
async def test_a_slow_but_live_engine_keeps_the_whole_first_token_timeout(tmp_path, qwen_tokenizer_dir):
    runner, url = await fake(qwen_tokenizer_dir, first_token_delay=2.0)
    try:
        async with Rig(
            tmp_path, qwen_tokenizer_dir, url, engine_dead_after=0.5, engine_probe_interval=0.2
        ) as rig:
            await converse(rig, "say hi", 1)  # 2 s to its first token, probes passing meanwhile
    finally:
        await runner.cleanup()


@pytest.mark.slow
async def test_a_sigstopped_engine_is_detected_within_engine_dead_after(tmp_path, qwen_tokenizer_dir):
    from tests.support.harness import FakeBackend

    engine = FakeBackend(qwen_tokenizer_dir)
    stopped = False
    try:
        async with Rig(
            tmp_path, qwen_tokenizer_dir, engine.url, engine_dead_after=1.5, engine_probe_interval=0.25
        ) as rig:
            await converse(rig, "say hi", 1)
            os.kill(engine.proc.pid, signal.SIGSTOP)
            stopped = True
            t0 = time.monotonic()
            status, reply = await rig.turn([user("say hi again")])
            took = time.monotonic() - t0
            assert status == 529 and "failed its health check" in json.dumps(reply)
            assert took < 1.5 + 1.0, took
    finally:
        if stopped:
            os.kill(engine.proc.pid, signal.SIGCONT)
        engine.stop()


# --- several --backend URLs ------------------------------------------------------------------------------------


async def test_several_backends_pin_conversations_and_a_dead_engines_conversations_move(
    tmp_path, qwen_tokenizer_dir
):
    engines = [await fake(qwen_tokenizer_dir) for _ in range(2)]
    urls = [u for _, u in engines]
    dead = engines[0][0]
    try:
        async with Rig(tmp_path, qwen_tokenizer_dir, ",".join(urls), engine_probe_interval=0.3) as rig:
            # Conversations until both engines serve one (at least 8): which engine a key lands on
            # depends on the engines' ports, so a fixed 8 would all land on one, 1 run in 128.
            convs: dict[int, list] = {}
            while True:
                convs[len(convs)] = await converse(rig, f"task number {len(convs)}: say hi", 2)
                where: dict[str, set[str]] = defaultdict(set)
                for url in urls:
                    for q in await requests_of(url):
                        where[q["routing_key"]].add(url)
                on_dead = {k for k, w in where.items() if urls[0] in w}
                if len(convs) >= 40 or (len(convs) >= 8 and 0 < len(on_dead) < len(convs)):
                    break
            n = len(convs)
            assert len(where) == n and all(len(w) == 1 for w in where.values()), where
            assert 0 < len(on_dead) < n  # both engines serve
            await dead.cleanup()  # engine 0 is killed
            failed = 0
            for messages in convs.values():
                status, reply = await rig.turn(messages)
                if status != 200:  # its engine died: the retryable error, then the retry moves
                    assert status == 529 and "unreachable" in json.dumps(reply)
                    failed += 1
                    status, reply = await rig.turn(messages)
                assert status == 200, reply
            assert failed == 1  # the first turn on the dead engine marks it down; the rest move at once
            after: dict[str, set[str]] = defaultdict(set)
            for q in (await requests_of(urls[1]))[-n:]:
                after[q["routing_key"]].add(urls[1])
            assert set(after) == set(where)  # every conversation's third turn is on the live engine
            stored = await rig.store.query("SELECT status, count(*) FROM turns GROUP BY status")
            assert dict(stored) == {"ok": 3 * n}  # the failed attempt wrote nothing
    finally:
        for runner, _ in engines[1:]:
            await runner.cleanup()


# --- vLLM in render mode -----------------------------------------------------------------------------------------

BASH = {
    "name": "Bash",
    "description": "Run a shell command",
    "input_schema": {
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "required": ["command"],
    },
}


async def vllm_replay(url: str, prompt: list[int], max_tokens: int) -> dict:
    """The vLLM fake's own answer for `prompt`, asked directly (not streamed)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "logprobs": 0, "return_token_ids": True}
    async with aiohttp.ClientSession() as http, http.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200
        return (await r.json())["choices"][0]


@pytest.mark.parametrize("stream", ["auto", "whole"])
async def test_vllm_render_mode_is_token_exact_against_the_vllm_fake(tmp_path, qwen_tokenizer_dir, stream):
    from polar_mitm.store.reader import read_turns

    runner, url = await fake(qwen_tokenizer_dir, api="vllm", context_length=20000)
    said: list[str] = []
    try:
        info = await check_policy(PolicyConfig(backend_url=url), progress=said.append)  # found by auto
        assert (info.front, info.context_length, info.tokenizer_path) == (
            "vllm",
            20000,
            str(qwen_tokenizer_dir),
        )
        # The fake reports logprobs as vLLM's default does at temperature 1: one token sampled at
        # top_k 1 has its share of the whole distribution, so the mode is raw, and said.
        assert said[0] == f"{url} is a vLLM engine (logprobs of the raw distribution; weight version 0)"
        assert len(said) == 2
        assert "--logprobs-mode processed_logprobs" in said[1]
        assert info.logprobs_mode == "raw"
        async with aiohttp.ClientSession() as http, http.get(url + "/model_info") as r:
            assert r.status == 404  # no SGLang endpoint in vLLM's mode
        async with Rig(tmp_path, qwen_tokenizer_dir, url, backend_stream=stream) as rig:
            messages = [user("Create out.txt containing hi")]
            body = {"model": MODEL, "max_tokens": 200, "messages": messages, "tools": [BASH]}
            status, _, raw = await rig.gw.post("anthropic", body)
            first = json.loads(raw)
            assert status == 200 and first["stop_reason"] == "tool_use", first
            call = next(b for b in first["content"] if b["type"] == "tool_use")
            assert call["name"] == "Bash" and "out.txt" in call["input"]["command"]
            body["messages"] = [
                *messages,
                {"role": "assistant", "content": first["content"]},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": ""}],
                },
            ]
            status, _, raw = await rig.gw.post("anthropic", body)
            second = json.loads(raw)
            assert status == 200 and second["stop_reason"] == "end_turn"
            assert "Done. The command finished." in second["content"][0]["text"]
            db = rig.store.path
        t1, t2 = list(read_turns(db))
        assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.output_ids)] == t1.prompt_ids + t1.output_ids
        for t in (t1, t2):  # what vLLM sampled, id for id and logprob for logprob
            again = await vllm_replay(url, t.prompt_ids, 200)
            assert again["token_ids"] == t.output_ids
            assert again["logprobs"]["token_logprobs"] == t.output_logprobs
            assert t.weight_version == "0"  # what its /weight_info says (the replies name none)
        bodies = [q["body"] for q in await requests_of_path(url, "/v1/completions")]
        # The logprobs-mode probes (the preflight's, the rig's own discovery's), then the turns.
        probes = [b for b in bodies if b["prompt"] == [0]]
        assert probes and all((b["max_tokens"], b["top_k"]) == (1, 1) for b in probes)
        sent = [b for b in bodies if b["prompt"] != [0]][:2]
        assert all(b["return_token_ids"] is True and b["logprobs"] == 0 for b in sent)
        assert [b["stream"] for b in sent] == [stream == "auto"] * 2  # vLLM streams deltas: auto streams
    finally:
        await runner.cleanup()


async def test_vllm_finish_reasons_and_abort(tmp_path, qwen_tokenizer_dir):
    runner, url = await fake(qwen_tokenizer_dir, api="vllm")
    try:
        async with Rig(tmp_path, qwen_tokenizer_dir, url, backend_kind="vllm") as rig:
            body = {"model": MODEL, "max_tokens": 3, "messages": [user("say something long")]}
            status, _, raw = await rig.gw.post("anthropic", body)
            assert status == 200 and json.loads(raw)["stop_reason"] == "max_tokens"
            runner.app[STATE].faults.append(Fault(mode="abort", path="/v1/completions"))
            status, reply = await rig.turn([user("say hi")])
            assert status == 529 and "aborted the generation" in json.dumps(reply)
            rows = await rig.store.query("SELECT status, finish_reason FROM turns ORDER BY id")
            assert rows[-1] == ("aborted", "abort")
    finally:
        await runner.cleanup()


async def post_json(url: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.post(url + path, json=body or {}) as r:
        return r.status, await r.json(content_type=None)


async def turn_of(rig: Rig, session: str, text: str) -> str | None:
    """One turn of `session` through the rig; the weight version it was stored with."""
    await rig.store.ensure_session(session)
    body = {"model": MODEL, "max_tokens": 8, "messages": [user(text)]}
    status, _, raw = await rig.gw.post("anthropic", body, headers={"x-polar-session": session})
    assert status == 200, raw
    rows = await rig.store.query("SELECT weight_version FROM turns ORDER BY id DESC LIMIT 1")
    return rows[0][0]


async def test_vllm_turns_carry_the_weight_version_it_serves_read_once_per_session_and_after_a_resume(
    tmp_path, qwen_tokenizer_dir
):
    runner, url = await fake(qwen_tokenizer_dir, api="vllm")
    try:
        async with Rig(tmp_path, qwen_tokenizer_dir, url, backend_kind="vllm") as rig:
            assert await turn_of(rig, "a", "hi") == "0"
            reads = len(await requests_of_path(url, "/weight_info"))
            assert [await turn_of(rig, "a", f"hi {i}") for i in range(3)] == ["0", "0", "0"]
            assert len(await requests_of_path(url, "/weight_info")) == reads  # once a session, not a turn

            # A trainer names a new version between rollouts: the next session's turns carry it.
            assert await post_json(url, "/update_weight_version", {"new_version": "step-1"}) == (
                200,
                {"success": True, "new_version": "step-1"},
            )
            assert await turn_of(rig, "b", "hello") == "step-1"
            # Within a session the reading holds (a direct update without the gate is seen within
            # MAX_AGE); the gate's pause and resume (the service's weight sync) reads it again.
            await post_json(url, "/update_weight_version", {"new_version": "step-2"})
            assert await turn_of(rig, "b", "again") == "step-1"
            rig.policy.pause()
            rig.policy.resume()
            assert await turn_of(rig, "b", "once more") == "step-2"
            assert await turn_of(rig, "a", "back") == "step-2"
            assert len(await requests_of_path(url, "/weight_info")) == reads + 2

            rig.policy.versions.max_age = 0.0  # a reading older than max_age is read again
            await post_json(url, "/update_weight_version", {"new_version": "step-3"})
            assert await turn_of(rig, "a", "later") == "step-3"
    finally:
        await runner.cleanup()


async def test_vllm_without_dev_mode_says_so_once_and_its_turns_carry_no_version(
    tmp_path, qwen_tokenizer_dir, caplog
):
    runner, url = await fake(qwen_tokenizer_dir, api="vllm", vllm_dev_mode=False)
    said: list[str] = []
    try:
        info = await check_policy(PolicyConfig(backend_url=url, backend_kind="vllm"), progress=said.append)
        assert info.weight_version is None
        assert said[0].endswith(
            "no weight version: it serves no /weight_info (start vLLM with VLLM_SERVER_DEV_MODE=1))"
        )
        async with Rig(tmp_path, qwen_tokenizer_dir, url, backend_kind="vllm") as rig:  # no preflight
            with caplog.at_level("WARNING", logger="polar_mitm.policy"):
                versions = [await turn_of(rig, s, "hi") for s in ("a", "b", "c")]
            assert versions == [None, None, None]
            warned = [r.getMessage() for r in caplog.records if "/weight_info" in r.getMessage()]
            assert len(warned) == 1 and "VLLM_SERVER_DEV_MODE=1" in warned[0], warned
            assert len(await requests_of_path(url, "/weight_info")) == 0  # 404s are not logged
    finally:
        await runner.cleanup()


async def test_a_paused_vllm_aborts_what_runs_holds_new_requests_until_resumed(tmp_path, qwen_tokenizer_dir):
    runner, url = await fake(qwen_tokenizer_dir, api="vllm", token_delay=0.05)
    body = {"prompt": [9707] * 4, "max_tokens": 200, "logprobs": 0, "return_token_ids": True}
    try:
        running = asyncio.ensure_future(post_json(url, "/v1/completions", body))
        await wait_until_async(lambda: runner.app[STATE].in_flight)
        assert await post_json(url, "/pause") == (200, {"status": "paused"})
        status, reply = await running
        assert status == 200 and reply["choices"][0]["finish_reason"] == "abort"
        status, reply = await post_json(url, "/pause?mode=sometimes")
        assert status == 400 and reply["error"]["param"] == "query.mode", reply
        async with aiohttp.ClientSession() as http, http.get(url + "/is_paused") as r:
            assert await r.json() == {"is_paused": True}
        held = asyncio.ensure_future(post_json(url, "/v1/completions", {**body, "max_tokens": 2}))
        await asyncio.sleep(0.3)
        assert not held.done()  # waits for /resume
        assert await post_json(url, "/resume") == (200, {"status": "resumed"})
        status, reply = await held
        assert status == 200 and reply["choices"][0]["finish_reason"] in ("stop", "length")
        assert await post_json(url, "/reset_prefix_cache") == (200, {"success": True})
    finally:
        await runner.cleanup()


async def generate_replay(url: str, prompt: list[int], max_tokens: int) -> dict:
    """The vLLM fake's own /inference/v1/generate answer for `prompt`, asked directly (whole)."""
    body = {
        "token_ids": prompt,
        "sampling_params": {"max_tokens": max_tokens, "logprobs": 0},
        "output_mode": "text",
    }
    async with aiohttp.ClientSession() as http, http.post(url + "/inference/v1/generate", json=body) as r:
        assert r.status == 200
        return (await r.json())["choices"][0]


@pytest.mark.parametrize("stream", ["auto", "whole"])
async def test_vllm_generate_is_token_exact_and_its_turns_carry_the_version_their_replies_name(
    tmp_path, qwen_tokenizer_dir, stream
):
    """`--backend-kind vllm-generate` against the vLLM fake: a tool call and its answer, every
    sampled id and logprob the engine's own, the prompt sent once and never echoed, each turn's
    weight version the one its reply names (a new one from the next turn on, no /weight_info
    read); auto never picks it."""
    from polar_mitm.store.reader import read_turns

    runner, url = await fake(qwen_tokenizer_dir, api="vllm", context_length=20000)
    said: list[str] = []
    try:
        info = await check_policy(
            PolicyConfig(backend_url=url, backend_kind="vllm-generate"), progress=said.append
        )
        assert said[0] == (
            f"{url} is a vLLM engine (logprobs of the raw distribution; weight version 0; "
            "generations at /inference/v1/generate)"
        )
        assert (info.front, info.weight_version) == ("vllm", "0")
        async with Rig(
            tmp_path, qwen_tokenizer_dir, url, backend_kind="vllm-generate", backend_stream=stream
        ) as rig:
            messages = [user("Create out.txt containing hi")]
            body = {"model": MODEL, "max_tokens": 200, "messages": messages, "tools": [BASH]}
            status, _, raw = await rig.gw.post("anthropic", body)
            first = json.loads(raw)
            assert status == 200 and first["stop_reason"] == "tool_use", first
            call = next(b for b in first["content"] if b["type"] == "tool_use")
            assert call["name"] == "Bash" and "out.txt" in call["input"]["command"]
            assert await post_json(url, "/update_weight_version", {"new_version": "step-1"}) == (
                200,
                {"success": True, "new_version": "step-1"},
            )
            body["messages"] = [
                *messages,
                {"role": "assistant", "content": first["content"]},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": ""}],
                },
            ]
            status, _, raw = await rig.gw.post("anthropic", body)
            second = json.loads(raw)
            assert status == 200 and second["stop_reason"] == "end_turn"
            assert "Done. The command finished." in second["content"][0]["text"]
            assert await requests_of_path(url, "/weight_info") == []  # the replies said it
            db = rig.store.path
        t1, t2 = list(read_turns(db))
        assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.output_ids)] == t1.prompt_ids + t1.output_ids
        assert (t1.weight_version, t2.weight_version) == ("0", "step-1")  # within one session
        sent = [q["body"] for q in await requests_of_path(url, "/inference/v1/generate")]
        turns = [b for b in sent if b["token_ids"] != [0]]  # the preflight's and discovery's probes
        assert len(sent) - len(turns) == 2 and len(turns) == 2
        assert [b["token_ids"] for b in turns] == [t1.prompt_ids, t2.prompt_ids]
        assert all(b["output_mode"] == "text" and b["sampling_params"]["logprobs"] == 0 for b in turns)
        assert [b["stream"] for b in turns] == [stream == "auto"] * 2  # deltas: auto streams
        for t in (t1, t2):
            again = await generate_replay(url, t.prompt_ids, 200)
            assert again["token_ids"] == t.output_ids
            assert [c["logprob"] for c in again["logprobs"]["content"]] == t.output_logprobs
            assert t.logprobs_mode == "raw" and t.finish_reason in ("tool_calls", "end_turn", "stop")
        # Only the logprobs-mode probes went to /v1/completions.
        assert all(q["body"]["prompt"] == [0] for q in await requests_of_path(url, "/v1/completions"))
        auto = await check_policy(PolicyConfig(backend_url=url), progress=lambda _: None)
        assert auto.generate_path == ""  # auto is vllm: /inference/v1/generate is asked for by name
    finally:
        await runner.cleanup()


async def test_vllm_generate_without_scale_out_says_how_to_open_it(tmp_path, qwen_tokenizer_dir):
    runner, url = await fake(qwen_tokenizer_dir, api="vllm", vllm_scale_out=False)
    try:
        with pytest.raises(PreflightError, match="start vLLM with --enable-scale-out"):
            await check_policy(
                PolicyConfig(backend_url=url, backend_kind="vllm-generate"), progress=lambda _: None
            )
        async with Rig(
            tmp_path, qwen_tokenizer_dir, url, backend_kind="vllm-generate"
        ) as rig:  # no preflight
            status, reply = await rig.turn([user("hi")])
            assert status == 500 and "--enable-scale-out" in json.dumps(reply), reply
            assert await rig.store.query("SELECT count(*) FROM turns") == [(0,)]
    finally:
        await runner.cleanup()


async def test_vllm_generate_finish_reasons_and_abort_keep_what_was_sampled(tmp_path, qwen_tokenizer_dir):
    runner, url = await fake(qwen_tokenizer_dir, api="vllm", token_delay=0.01)
    try:
        async with Rig(tmp_path, qwen_tokenizer_dir, url, backend_kind="vllm-generate") as rig:
            body = {"model": MODEL, "max_tokens": 3, "messages": [user("say something long")]}
            status, _, raw = await rig.gw.post("anthropic", body)
            assert status == 200 and json.loads(raw)["stop_reason"] == "max_tokens"
            runner.app[STATE].faults.append(Fault(mode="abort", path="/inference/v1/generate"))
            status, reply = await rig.turn([user("say hi")])
            assert status == 529 and "aborted the generation" in json.dumps(reply)
            rows = await rig.store.query(
                "SELECT status, finish_reason, weight_version FROM turns ORDER BY id"
            )
            assert rows == [("ok", "length", "0"), ("aborted", "abort", "0")]
    finally:
        await runner.cleanup()


async def test_engine_weights_drive_vllms_reload_in_order_and_resume_it_when_a_step_fails(
    qwen_tokenizer_dir,
):
    """The reload path against the scripted vLLM fake (no weights: `reload_weights` fails there,
    and the engine must not stay paused); SGLang's path against the scripted SGLang fake.
    `EngineWeights` is synchronous (a trainer's callback): it runs in a thread here."""
    from polar_mitm.backends.weights import EngineWeights, WeightLoadError

    runner, url = await fake(qwen_tokenizer_dir, api="vllm")
    try:
        engine = EngineWeights(url)  # auto: found as the policy's discovery finds it
        assert await asyncio.to_thread(lambda: engine.kind) == "vllm"
        assert await asyncio.to_thread(engine.version) == "0"
        with pytest.raises(WeightLoadError, match="collective_rpc with HTTP 500.*run it with --mode hf"):
            await asyncio.to_thread(engine.load, "/nowhere", "step-1")
        paths = [q["path"] for q in runner.app[STATE].requests]
        assert paths[-3:] == ["/pause", "/collective_rpc", "/resume"]
        assert runner.app[STATE].resumed.is_set() and await asyncio.to_thread(engine.version) == "0"
    finally:
        await runner.cleanup()
    runner, url = await fake(qwen_tokenizer_dir, api="vllm", vllm_dev_mode=False)
    try:
        with pytest.raises(WeightLoadError, match="serves no POST /pause.*VLLM_SERVER_DEV_MODE=1"):
            await asyncio.to_thread(EngineWeights(url, "vllm").load, "/nowhere", "step-1")
    finally:
        await runner.cleanup()
    runner, url = await fake(qwen_tokenizer_dir)
    try:
        engine = EngineWeights(url)
        assert await asyncio.to_thread(lambda: engine.kind) == "sglang"
        assert await asyncio.to_thread(engine.version) == "0"
        with pytest.raises(WeightLoadError, match="update_weights_from_disk with HTTP 404"):
            await asyncio.to_thread(engine.load, "/nowhere", "step-1")
    finally:
        await runner.cleanup()


async def requests_of_path(url: str, path: str) -> list[dict]:
    async with aiohttp.ClientSession() as http, http.get(url + "/_fake/requests") as r:
        return [q for q in (await r.json())["requests"] if q["path"] == path]


@pytest.mark.slow
async def test_an_engine_killed_mid_turn_behind_the_router_moves_its_conversation(
    tmp_path, qwen_tokenizer_dir
):
    """Behind the real router (`manual`, its own retries off: with them it sometimes serves the
    turn elsewhere itself), an engine SIGKILLed while a turn waits on it: that turn gets the
    style's retryable error, the harness's retry and the conversation's next turns land on the
    other engine with the same key, and nothing half-written is stored as a turn."""
    from tests.support.harness import FakeBackend

    require_router()
    router = Router(
        "manual", "--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--disable-retries"
    )
    engines = [
        FakeBackend(qwen_tokenizer_dir, "--model-path", str(qwen_tokenizer_dir), "--first-token-delay", "0.6")
        for _ in range(2)
    ]
    try:
        for e in engines:
            await asyncio.to_thread(router.add, e.url)
        async with Rig(tmp_path, qwen_tokenizer_dir, router.url) as rig:
            messages = await converse(rig, "the long task: say hi", 1)
            (key,) = {q["routing_key"] for e in engines for q in await requests_of(e.url)}
            (victim,) = [e for e in engines if await requests_of(e.url)]
            survivor = next(e for e in engines if e is not victim)
            before = len(await requests_of(victim.url))
            turn = asyncio.ensure_future(rig.turn(messages))

            async def asked() -> bool:  # the turn is waiting for its first token on the victim
                return len(await requests_of(victim.url)) > before

            await wait_until_async(asked, timeout=20, message="the second turn at the victim")
            victim.proc.kill()
            status, reply = await turn
            assert status in (500, 529), reply  # both retryable for Anthropic's clients
            retries = 0
            while status != 200 and retries < 10:  # the harness retries until the router drops the worker
                retries += 1
                await asyncio.sleep(0.5)
                status, reply = await rig.turn(messages)
            assert status == 200, reply
            messages += [{"role": "assistant", "content": reply["content"]}, user("and the last step")]
            status, _ = await rig.turn(messages)
            assert status == 200
            later = [q["routing_key"] for q in await requests_of(survivor.url)]
            assert len(later) >= 2 and set(later) == {key}  # the conversation moved, with its key
            rows = dict(await rig.store.query("SELECT status, count(*) FROM turns GROUP BY status"))
            assert rows.get("ok") == 3 and set(rows) <= {"ok", "error"}, rows
    finally:
        router.stop()
        for e in engines:
            e.stop()


@pytest.mark.slow
async def test_turns_waiting_on_one_engine_share_its_prober(tmp_path, qwen_tokenizer_dir):
    """Probing costs the engine a token per probe (SGLang's /health_generate): 20 turns waiting on
    one engine make one probe an interval, not twenty."""
    from polar_mitm.backends.engine_client import EngineClient
    from polar_mitm.backends.engines import EnginePool

    runner, url = await fake(qwen_tokenizer_dir)
    client = EngineClient(url)
    sent: list[str] = []

    async def counted(base: str, path: str, timeout: float) -> bool:
        sent.append(path)
        return await client.alive(base, path, timeout)

    pool = EnginePool([url], counted, interval=0.2)
    try:
        watches = [asyncio.ensure_future(pool.watch(pool.engines[0], 0.5)) for _ in range(20)]
        await asyncio.sleep(1.3)
        assert not any(w.done() for w in watches)  # a live engine: nobody gives up
        assert 4 <= len(sent) <= 8 and set(sent) == {"/health_generate"}, sent
        runner.app[STATE].hanging += 1  # a stuck scheduler from now on
        done, _ = await asyncio.wait(watches, timeout=3)
        assert len(done) == 20  # every waiting turn hears of it
    finally:
        runner.app[STATE].hanging = 0
        await pool.close()
        await client.close()
        await runner.cleanup()
