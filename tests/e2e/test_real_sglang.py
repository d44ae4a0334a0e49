"""Real Claude Code through `polar-mitm run` against real SGLang (the PyPI wheel on CPU, a tiny
random Qwen2 over the Qwen tokenizer), with a recording hop between the proxy and the engine: what
the store keeps is what SGLang said, bit for bit, streamed and whole; a weight update between two
sessions shows in the next session's turns; a scheduler SIGSTOPped before the first turn, or
mid-stream, fails it within 30 s as hung; an engine SIGKILLed mid-turn fails the turn clearly.

The model is random, so Claude Code gets a few random tokens per call (`--max-tokens-cap`) and
treats them as its answer: the point is the path of the ids and logprobs, not what they say.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import struct
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest

from polar_mitm import procs
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
from tests.support.harness import harness_env, polar_run, proxy_process, require_binary
from tests.support.helpers import MESSAGES_URL, descendants
from tests.support.sglang import SGLangServer, make_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.engines, pytest.mark.slow]

# Tokens per reply. Claude Code answers a reply cut at max_tokens by asking it to resume, three
# times, then exits 1. The tiny model ends about half its replies to Claude Code's prompt within
# 12 tokens and 93 % within 32 (SGLang, 60 samples): at 12, one session in 18 failed that way.
CAP = "32"


@pytest.fixture
def hop(sglang_server):
    h = RecordingHop(sglang_server.url).start()
    yield h
    h.stop()


def run_claude(
    tmp_path: Path, backend_url: str, tokenizer: Path, session: str, *extra: str, env: dict | None = None
):
    work = tmp_path / f"work-{session}"
    work.mkdir()
    return polar_run(
        [
            "--backend",
            backend_url,
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
        ["claude", "-p", "Say hello"],
        cwd=work,
        env={**harness_env(tmp_path / f"home-{session}"), **(env or {})},
        timeout=400,
    )


def bits(values: list[float]) -> bytes:
    return struct.pack(f"<{len(values)}d", *values)


def assert_store_is_what_sglang_said(db: Path, session: str, exchanges: list[Exchange], *, streamed: bool):
    """Every stored turn of `session` is one recorded /generate: its prompt ids are the input_ids
    sent, its sampled ids and logprobs the reply's (float64 bits), its weight version the reply's."""
    turns = list(read_turns(db, session=session))
    assert turns, "no turn was stored"
    sent = defaultdict(list)
    for ex in exchanges:
        sent[tuple(ex.request["input_ids"])].append(ex)
    for t in turns:  # turns in creation order; several with one prompt (a retry) pair in order
        queue = sent[tuple(t.prompt_ids)]
        assert queue, f"turn {t.id}: SGLang never received its prompt ids"
        ex = queue.pop(0)
        assert ex.status == 200 and ex.streamed is streamed and ex.request["return_logprob"] is True
        outs = ex.outputs()
        if streamed:
            assert ex.content_type.startswith("text/event-stream")
            for a, b in zip(outs, outs[1:], strict=False):  # SGLang's chunks repeat everything so far
                assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
        else:
            assert ex.content_type.startswith("application/json") and len(outs) == 1
        final = outs[-1]
        meta = final["meta_info"]
        lps = meta["output_token_logprobs"]
        assert all(len(e) == 3 and e[2] is None for e in lps)  # [logprob, id, null]
        assert [e[1] for e in lps] == final["output_ids"]
        assert t.output_ids == final["output_ids"]
        assert bits(t.output_logprobs) == bits([e[0] for e in lps])
        assert t.weight_version == meta["weight_version"]
        # SGLang 0.5.23 says which weights sampled which tokens: here one span, the turn's version.
        n = len(final["output_ids"])
        assert meta["weight_versions"] == [{"version": t.weight_version, "start": 0, "end": n}]
        assert t.status == "ok"
        assert t.logprobs_mode == "tempered"  # SGLang 0.5.23's sampler: after temperature, before top-p
        assert int(ex.request["sampling_params"]["max_new_tokens"]) <= int(CAP)
    return turns


@pytest.mark.parametrize("stream", ["stream", "whole"])
def test_claude_code_turns_are_sglangs_replies_bit_for_bit(
    tmp_path, sglang_server, hop, qwen_tokenizer_dir, stream
):
    require_binary("claude")
    r = run_claude(tmp_path, hop.url, qwen_tokenizer_dir, f"real-{stream}", "--backend-stream", stream)
    assert r.returncode == 0, r.stderr + r.stdout
    assert "session real-" in r.stderr
    turns = assert_store_is_what_sglang_said(
        tmp_path / "runs.sqlite", f"real-{stream}", hop.exchanges, streamed=stream == "stream"
    )
    # Claude Code's main call has the tool list: a prompt of thousands of tokens, all sent.
    assert max(len(t.prompt_ids) for t in turns) > 2000


def test_weight_update_between_sessions_shows_in_the_next_sessions_turns(
    tmp_path, sglang_server, hop, sglang_model_dir, qwen_tokenizer_dir
):
    require_binary("claude")
    db = tmp_path / "runs.sqlite"
    before = sglang_server.get("/model_info")["weight_version"]
    r = run_claude(tmp_path, hop.url, qwen_tokenizer_dir, "w-before")
    assert r.returncode == 0, r.stderr + r.stdout
    # Against SGLang's default (cumulative chunks) `--backend-stream auto` asks for whole replies.
    first = assert_store_is_what_sglang_said(db, "w-before", hop.exchanges, streamed=False)
    assert {t.weight_version for t in first} == {before}

    other = make_tiny_model(qwen_tokenizer_dir, tmp_path / "model-v2", seed=1)
    try:
        status, reply = sglang_server.post(
            "/update_weights_from_disk", {"model_path": str(other), "weight_version": "step-2"}
        )
        assert status == 200 and reply["success"] is True, reply
        assert sglang_server.get("/model_info")["weight_version"] == "step-2"
        r = run_claude(tmp_path, hop.url, qwen_tokenizer_dir, "w-after")
        assert r.returncode == 0, r.stderr + r.stdout
        second = assert_store_is_what_sglang_said(db, "w-after", hop.exchanges, streamed=False)
        assert {t.weight_version for t in second} == {"step-2"}
        # New weights, new numbers: the same first prompt is sampled with other logprobs.
        assert bits(second[0].output_logprobs) != bits(first[0].output_logprobs)
        # They are the new checkpoint's (transformers over it agrees), and not the old one's.
        rc, report = check_logprobs(db, other, "w-after", 1.0)
        assert rc == 0 and report["tokens"] > 0 and report["max_abs"] < 1e-4, report
        assert check_logprobs(db, sglang_model_dir, "w-after", 1.0)[0] != 0
    finally:  # the server is the session's: give it back its weights
        status, reply = sglang_server.post(
            "/update_weights_from_disk", {"model_path": str(sglang_model_dir), "weight_version": before}
        )
        assert status == 200 and reply["success"] is True, reply


def test_a_request_at_temperature_half_stores_the_tempered_distributions_logprobs(
    tmp_path, sglang_server, hop, sglang_model_dir, qwen_tokenizer_dir
):
    """An OpenAI SDK client asking for temperature 0.5: SGLang samples at 0.5 and reports
    log(softmax(logits / 0.5)) of each sampled token; transformers recomputes them within 1e-4 at
    0.5 and not at 1 (the raw distribution)."""
    work = tmp_path / "work"
    work.mkdir()
    r = polar_run(
        ["--backend", hop.url, "--tokenizer", str(qwen_tokenizer_dir), "--max-tokens-cap", CAP]
        + ["--db", str(tmp_path / "runs.sqlite"), "--session", "t-half"],
        [str(sdk_python()), "-c", HALF_TEMPERATURE_CLIENT],
        cwd=work,
        env=harness_env(tmp_path / "home"),
        timeout=400,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    db = tmp_path / "runs.sqlite"
    turns = assert_store_is_what_sglang_said(db, "t-half", hop.exchanges, streamed=False)
    assert len(turns) == 3
    assert all(ex.request["sampling_params"]["temperature"] == 0.5 for ex in hop.exchanges)
    rc, report = check_logprobs(db, sglang_model_dir, "t-half", 0.5)
    assert rc == 0 and report["tokens"] >= 3 and report["max_abs"] < 1e-4, report
    rc, report = check_logprobs(db, sglang_model_dir, "t-half", 1.0)
    assert rc != 0, report  # the raw distribution's logprobs are other numbers


def test_logprobs_are_tempered_but_not_cut_by_top_k(sglang_server, sglang_model_dir):
    """SGLang 0.5.23 at temperature 0.7 and top_k 5: each sampled token's logprob in the whole of
    logits / 0.7 (transformers, within 1e-4), not in the top-5 distribution it was drawn from."""
    params = {"max_new_tokens": 8, "temperature": 0.7, "top_k": 5, "ignore_eos": True}
    status, reply = sglang_server.post(
        "/generate", {"input_ids": CHAT_PROMPT, "sampling_params": params, "return_logprob": True}
    )
    assert status == 200, reply
    ids = reply["output_ids"]
    lps = [e[0] for e in reply["meta_info"]["output_token_logprobs"]]
    assert len(ids) == 8
    want = recomputed_logprobs(sglang_model_dir, CHAT_PROMPT, ids, 0.7)
    assert max(abs(a - b) for a, b in zip(lps, want, strict=True)) < 1e-4, (lps, want)
    truncated = recomputed_logprobs(sglang_model_dir, CHAT_PROMPT, ids, 0.7, top_k=5)
    assert max(abs(a - b) for a, b in zip(lps, truncated, strict=True)) > 1e-3


def test_a_stopped_scheduler_fails_the_turn_within_30_s_as_hung(
    tmp_path, sglang_server, qwen_tokenizer_dir, certs_dir
):
    """SGLang's scheduler (and every other process below its HTTP server) SIGSTOPped after the
    proxy's preflight, before any turn: the HTTP server still answers (`/model_info`), so only a
    health check that runs a token through the scheduler (`/health_generate`) sees the hang. At the
    default liveness settings the turn fails within 30 s, with an error that says the engine hung."""
    stopped = sorted(descendants(sglang_server.proc.pid) - {sglang_server.proc.pid})
    assert stopped, "SGLang's server has no scheduler process"
    with proxy_process(sglang_server.url, qwen_tokenizer_dir, certs_dir, tmp_path / "p.db") as (_, client, _):
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        try:
            with urllib.request.urlopen(sglang_server.url + "/model_info", timeout=10) as r:
                assert r.status == 200  # the server itself is up: only the scheduler is stuck
            t0 = time.monotonic()
            r = client.post(MESSAGES_URL, json={"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
            took = time.monotonic() - t0
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
    # The session's engine is whole again for the tests after this one.
    with urllib.request.urlopen(sglang_server.url + "/health_generate", timeout=60) as h:
        assert h.status == 200
    assert r.status_code == 529, r.text
    message = r.json()["error"]["message"]
    assert "failed its health check (/health_generate)" in message and "hung" in message, message
    assert took <= 30, took


@pytest.fixture(scope="module")
def long_sglang(tmp_path_factory, qwen_tokenizer_dir):
    """An engine of this module's own (the session's stays whole) over a model that (nearly)
    never samples <|im_end|>: a stop or a kill lands while it is still writing. The last test
    here kills it."""
    tmp = tmp_path_factory.mktemp("long-sglang")
    model = make_tiny_model(qwen_tokenizer_dir, tmp / "model-long", eos_share=1e-9)
    server = SGLangServer(model, tmp / "server.log")
    yield server
    server.stop()


def test_a_scheduler_stopped_mid_stream_fails_the_turn_within_30_s_as_hung(
    tmp_path, long_sglang, qwen_tokenizer_dir, certs_dir
):
    """SGLang's scheduler SIGSTOPped once a streamed reply has sent tokens: its HTTP server holds
    the stream open and silent. At the default liveness settings the proxy ends the harness's
    stream within 30 s with an error saying the engine hung, and stores the turn as `error` with
    the tokens sampled before the stop."""
    db = tmp_path / "p.db"
    stopped = sorted(descendants(long_sglang.proc.pid) - {long_sglang.proc.pid})
    assert stopped, "SGLang's server has no scheduler process"
    lines: list[str] = []
    stopped_at = None
    body = {
        "model": "m",
        "max_tokens": 2000,
        "stream": True,
        "messages": [{"role": "user", "content": "talk"}],
    }
    with proxy_process(long_sglang.url, qwen_tokenizer_dir, certs_dir, db) as (_, client, _):
        try:
            with client.stream("POST", MESSAGES_URL, json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    lines.append(line)
                    if stopped_at is None and line.startswith("event: content_block_delta"):
                        for pid in stopped:
                            os.kill(pid, signal.SIGSTOP)
                        stopped_at = time.monotonic()
            ended = time.monotonic()
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
    assert stopped_at is not None, lines[-5:]
    errors = [json.loads(x[len("data: ") :]) for x in lines if x.startswith("data: ") and '"error"' in x]
    assert errors and "hung" in errors[-1]["error"]["message"], lines[-5:]
    assert not any("message_stop" in x for x in lines)
    assert ended - stopped_at <= 30, ended - stopped_at
    status, output_len = sqlite3.connect(db).execute("SELECT status, output_len FROM turns").fetchone()
    assert status == "error" and output_len > 0  # the tokens sampled before the stop


def test_sglang_killed_mid_turn_fails_the_turn_and_stores_it_as_error(
    tmp_path, long_sglang, qwen_tokenizer_dir
):
    """The module's engine SIGKILLed (the whole group) once a turn streams."""
    require_binary("claude")
    server = long_sglang
    try:
        killed = threading.Event()

        def kill_once_streaming(ex: Exchange) -> None:
            # Sent from the hop's loop at the reply's first piece, before it is relayed.
            if not killed.is_set():
                procs.signal_group(server.proc.pid, signal.SIGKILL)
                killed.set()

        h = RecordingHop(server.url, tap=kill_once_streaming).start()
        # Long replies: the kill lands while SGLang is still sampling the first one.
        r = run_claude(
            tmp_path,
            h.url,
            qwen_tokenizer_dir,
            "killed",
            "--backend-stream",
            "stream",
            "--max-tokens-cap",
            "4000",
            env={"CLAUDE_CODE_MAX_RETRIES": "0"},  # one attempt: the engine stays dead
        )
        h.stop()
    finally:
        server.stop()  # the fixture's stop finds it gone
    assert killed.is_set(), "no reply was streaming to kill"
    assert r.returncode != 0 or "error" in r.stderr.lower(), r.stderr
    con = sqlite3.connect(tmp_path / "runs.sqlite")
    rows = con.execute("SELECT status, error FROM turns WHERE session_id = 'killed' ORDER BY seq").fetchall()
    assert rows and rows[0][0] == "error", rows
    assert "policy backend" in rows[0][1], rows[0][1]
